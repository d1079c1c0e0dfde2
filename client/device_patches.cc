#include "client/device_patches.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

#if WEIGHTSTORE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <map>
#include <memory>

#include "client/cuda_materializer.h"
#include "client/cuda_scatter.h"
#include "core/catalog/manifest.h"
#include "core/status_macros.h"
#endif

namespace weightstore::client {
namespace {

// Destinations that share bytes would race, and tied weights held under two
// names are one memory: refused before anything is written.
absl::Status CheckDisjoint(std::span<const ReceivedPatch> patches, std::span<void* const> destinations) {
  std::vector<std::pair<uintptr_t, uint64_t>> ranges;
  for (size_t i = 0; i < patches.size(); ++i) {
    ranges.emplace_back(reinterpret_cast<uintptr_t>(destinations[i]), patches[i].spec.byte_size());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i - 1].first + ranges[i - 1].second > ranges[i].first) {
      return absl::InvalidArgumentError("two patched tensors share device memory; they are fetched whole");
    }
  }
  return absl::OkStatus();
}

#if WEIGHTSTORE_HAVE_CUDA

// A run this long is written by its own copy; shorter ones by the kernel.
constexpr uint64_t kCopyRunBytes = 4096;

absl::Status Cuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

// The elements of one kernel launch: device addresses and their values.
struct ScatterGroup {
  std::vector<uint64_t> addresses;
  std::vector<std::byte> values;
};

// A long run, copied as it is from the patch's body.
struct RunCopy {
  uint64_t to;
  const std::byte* from;
  uint64_t bytes;
};

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceMemory = std::unique_ptr<void, DeviceFree>;

absl::StatusOr<DeviceMemory> CopyToNewDeviceMemory(const void* from, uint64_t bytes, cudaStream_t stream) {
  void* p = nullptr;
  if (absl::Status s = Cuda(cudaMalloc(&p, std::max<uint64_t>(bytes, 1)), "cudaMalloc for element patches"); !s.ok()) {
    return absl::ResourceExhaustedError(s.message());
  }
  DeviceMemory memory(p);
  WEIGHTSTORE_RETURN_IF_ERROR(
      Cuda(cudaMemcpyAsync(p, from, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync of element patches"));
  return memory;
}

#endif  // WEIGHTSTORE_HAVE_CUDA

}  // namespace

absl::Status ApplyReceivedPatchesOnDevice(std::span<const ReceivedPatch> patches, std::span<void* const> destinations,
                                          const DevicePatchOptions& options) {
  if (patches.size() != destinations.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(patches.size(), " patches for ", destinations.size(), " destinations"));
  }
  for (size_t i = 0; i < patches.size(); ++i) {
    if (destinations[i] == nullptr || patches[i].patch.tensor_bytes() != patches[i].spec.byte_size()) {
      return absl::InvalidArgumentError(absl::StrCat("the patch of tensor '", patches[i].spec.name, "' is for ",
                                                     patches[i].patch.tensor_bytes(), " bytes, the tensor holds ",
                                                     patches[i].spec.byte_size()));
    }
  }
  if (absl::Status s = CheckDisjoint(patches, destinations); !s.ok()) return s;
#if !WEIGHTSTORE_HAVE_CUDA
  return absl::UnimplementedError("this build of weightstore has no CUDA (built without the CUDA toolkit)");
#else
  if (!CudaAvailable()) return absl::UnavailableError("no CUDA device is available");
  // Planned on the host, every patch checked, before anything is written.
  std::map<std::pair<uint32_t, bool>, ScatterGroup> groups;  // by element size, aligned
  std::vector<RunCopy> copies;
  for (size_t i = 0; i < patches.size(); ++i) {
    const ElementPatch& patch = patches[i].patch;
    const uint32_t e = patch.element_size;
    const auto base = reinterpret_cast<uint64_t>(destinations[i]);
    const bool aligned = (e == 1 || e == 2 || e == 4 || e == 8) && base % e == 0;
    ScatterGroup& group = groups[{e, aligned}];
    absl::Status planned = ForEachRun(patch, [&](uint64_t start, uint64_t length, const std::byte* values) {
      if (length * e >= kCopyRunBytes) {
        copies.push_back({base + start * e, values, length * e});
        return;
      }
      for (uint64_t k = 0; k < length; ++k) group.addresses.push_back(base + (start + k) * e);
      group.values.insert(group.values.end(), values, values + length * e);
    });
    if (!planned.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the patch of tensor '", patches[i].spec.name, "': ", planned.message()));
    }
  }

  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaSetDevice(options.device), "cudaSetDevice"));
  cudaStream_t stream = nullptr;
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  std::vector<DeviceMemory> held;  // freed once the stream is done with them
  auto enqueue = [&]() -> absl::Status {
    for (const auto& [key, group] : groups) {
      if (group.addresses.empty()) continue;
      WEIGHTSTORE_ASSIGN_OR_RETURN(
          DeviceMemory addresses,
          CopyToNewDeviceMemory(group.addresses.data(), group.addresses.size() * sizeof(uint64_t), stream));
      WEIGHTSTORE_ASSIGN_OR_RETURN(DeviceMemory values,
                                   CopyToNewDeviceMemory(group.values.data(), group.values.size(), stream));
      const int launched = cuda::LaunchScatter(static_cast<const uint64_t*>(addresses.get()), values.get(),
                                               group.addresses.size(), key.first, key.second, stream);
      held.push_back(std::move(addresses));
      held.push_back(std::move(values));
      WEIGHTSTORE_RETURN_IF_ERROR(Cuda(static_cast<cudaError_t>(launched), "the element patch scatter kernel"));
    }
    for (const RunCopy& c : copies) {
      WEIGHTSTORE_RETURN_IF_ERROR(
          Cuda(cudaMemcpyAsync(reinterpret_cast<void*>(c.to), c.from, c.bytes, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync of an element patch's run"));
    }
    return absl::OkStatus();
  };
  absl::Status status = enqueue();
  // Whatever was enqueued finishes before its memory is freed.
  absl::Status synced = Cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize after element patches");
  held.clear();
  cudaStreamDestroy(stream);
  if (status.ok()) status = synced;
  if (!status.ok()) {
    return absl::Status(status.code(), absl::StrCat(status.message(), " (the patched tensors may be partly written)"));
  }
  if (!options.verify) return absl::OkStatus();
  std::vector<std::byte> host;
  for (size_t i = 0; i < patches.size(); ++i) {
    host.resize(patches[i].spec.byte_size());
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(cudaMemcpy(host.data(), destinations[i], host.size(), cudaMemcpyDeviceToHost), "cudaMemcpy to check"));
    const std::string got = DigestBytes(host).Hex();
    if (got != patches[i].digest) {
      return absl::DataLossError(absl::StrCat("tensor '", patches[i].spec.name, "' patched on the GPU has digest ", got,
                                              " where the listing says ", patches[i].digest));
    }
  }
  return absl::OkStatus();
#endif
}

}  // namespace weightstore::client
