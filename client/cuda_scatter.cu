#include <cuda_runtime.h>

#include <algorithm>

#include "client/cuda_scatter.h"

namespace weightstore::client::cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr uint64_t kMaxBlocks = 1 << 20;  // a grid-stride loop takes the rest

template <typename T>
__global__ void ScatterElements(const uint64_t* __restrict__ addresses, const T* __restrict__ values, uint64_t count) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    *reinterpret_cast<T*>(addresses[i]) = values[i];
  }
}

__global__ void ScatterBytes(const uint64_t* __restrict__ addresses, const unsigned char* __restrict__ values,
                             uint64_t count, uint32_t size) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count; i += stride) {
    unsigned char* out = reinterpret_cast<unsigned char*>(addresses[i]);
    const unsigned char* in = values + i * size;
    for (uint32_t k = 0; k < size; ++k) out[k] = in[k];
  }
}

}  // namespace

int LaunchScatter(const uint64_t* addresses, const void* values, uint64_t count, uint32_t element_size, bool aligned,
                  void* stream) {
  if (count == 0) return cudaSuccess;
  // An error left pending by an earlier launch would be taken for this one's.
  (void)cudaGetLastError();
  const auto blocks = static_cast<unsigned>(std::min<uint64_t>((count + kThreads - 1) / kThreads, kMaxBlocks));
  auto s = static_cast<cudaStream_t>(stream);
  switch (aligned ? element_size : 0) {
    case 1:
      ScatterElements<<<blocks, kThreads, 0, s>>>(addresses, static_cast<const uint8_t*>(values), count);
      break;
    case 2:
      ScatterElements<<<blocks, kThreads, 0, s>>>(addresses, static_cast<const uint16_t*>(values), count);
      break;
    case 4:
      ScatterElements<<<blocks, kThreads, 0, s>>>(addresses, static_cast<const uint32_t*>(values), count);
      break;
    case 8:
      ScatterElements<<<blocks, kThreads, 0, s>>>(addresses, static_cast<const uint64_t*>(values), count);
      break;
    default:
      ScatterBytes<<<blocks, kThreads, 0, s>>>(addresses, static_cast<const unsigned char*>(values), count,
                                               element_size);
  }
  return cudaGetLastError();
}

}  // namespace weightstore::client::cuda
