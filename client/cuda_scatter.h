// The CUDA kernel behind client/device_patches.h, with an interface free of
// CUDA and Abseil types, so that only client/cuda_scatter.cu is built by nvcc.
#ifndef WEIGHTSTORE_CLIENT_CUDA_SCATTER_H_
#define WEIGHTSTORE_CLIENT_CUDA_SCATTER_H_

#include <cstdint>

namespace weightstore::client::cuda {

// Enqueues on `stream` (a cudaStream_t) the writes of `count` elements of
// `element_size` bytes: element i of `values` to the device address
// `addresses[i]`. Both arrays are in device memory; `values` is aligned to
// 256 bytes (cudaMalloc). With `aligned`, every address is a multiple of
// `element_size` (1, 2, 4 or 8), and each element is one store; otherwise
// bytes are stored one at a time. Returns the launch's cudaError_t (0: none).
int LaunchScatter(const uint64_t* addresses, const void* values, uint64_t count, uint32_t element_size, bool aligned,
                  void* stream);

}  // namespace weightstore::client::cuda

#endif  // WEIGHTSTORE_CLIENT_CUDA_SCATTER_H_
