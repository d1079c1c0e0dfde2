#include "client/device_patches.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

#if WEIGHTSTORE_HAVE_CUDA_KERNELS
#include <cuda_runtime_api.h>

#include <utility>

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

#if WEIGHTSTORE_HAVE_CUDA_KERNELS

// A run this long is written by its own copy; shorter ones by the kernel.
constexpr uint64_t kCopyRunBytes = 4096;
// The kernel takes the short runs' elements in batches of at most this many:
// the scratch (pinned host and device, twice) holds that many addresses and
// values, whatever the update's size.
constexpr uint64_t kBatchElements = uint64_t{1} << 21;

absl::Status Cuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

// Selects a device for the call and puts back the caller's on the way out
// (the current device is per thread, and torch keeps its own there).
class DeviceGuard {
 public:
  absl::Status Select(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    return Cuda(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

// One batch's buffers: addresses and values in pinned host memory (filled
// here, copied by DMA) and on the device (read by the kernel), and an event
// that says the host side may be filled again.
struct Batch {
  uint64_t* host_addresses = nullptr;
  std::byte* host_values = nullptr;
  void* device_addresses = nullptr;
  void* device_values = nullptr;
  cudaEvent_t copied = nullptr;
  ~Batch() {
    if (copied != nullptr) cudaEventSynchronize(copied);
    cudaFreeHost(host_addresses);
    cudaFreeHost(host_values);
    cudaFree(device_addresses);
    cudaFree(device_values);
    if (copied != nullptr) cudaEventDestroy(copied);
  }
};

absl::Status Allocate(Batch* b, uint64_t elements, uint64_t value_bytes) {
  const bool ok =
      cudaHostAlloc(reinterpret_cast<void**>(&b->host_addresses), elements * 8, cudaHostAllocDefault) == cudaSuccess &&
      cudaHostAlloc(reinterpret_cast<void**>(&b->host_values), value_bytes, cudaHostAllocDefault) == cudaSuccess &&
      cudaMalloc(&b->device_addresses, elements * 8) == cudaSuccess &&
      cudaMalloc(&b->device_values, value_bytes) == cudaSuccess &&
      cudaEventCreateWithFlags(&b->copied, cudaEventDisableTiming) == cudaSuccess;
  if (ok) return absl::OkStatus();
  (void)cudaGetLastError();  // an allocation failure is not sticky: clear it
  return absl::ResourceExhaustedError(absl::StrCat("no memory for the element patches' scratch (", elements,
                                                   " addresses and ", value_bytes, " bytes of values, twice)"));
}

// Feeds short runs to the kernel a batch at a time, on `stream`, two batches
// in turn: one fills while the other's copy is in flight.
class Scatter {
 public:
  Scatter(Batch* batches, uint64_t capacity, uint64_t value_capacity, cudaStream_t stream)
      : batches_(batches), capacity_(capacity), value_capacity_(value_capacity), stream_(stream) {}

  // Adds elements [start, start + length) of a tensor at `base` whose values
  // are at `values`: `e` bytes each, stored whole when `aligned`.
  absl::Status Add(uint64_t base, uint64_t start, uint64_t length, const std::byte* values, uint32_t e, bool aligned) {
    if (count_ > 0 && (e != e_ || aligned != aligned_)) WEIGHTSTORE_RETURN_IF_ERROR(Flush());
    e_ = e;
    aligned_ = aligned;
    for (uint64_t k = 0; k < length; ++k) {
      if (count_ == capacity_ || (count_ + 1) * e > value_capacity_) WEIGHTSTORE_RETURN_IF_ERROR(Flush());
      if (count_ == 0)
        WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(batches_[next_].copied), "a batch's copy"));
      Batch& b = batches_[next_];
      b.host_addresses[count_] = base + (start + k) * e;
      std::memcpy(b.host_values + count_ * e, values + k * e, e);
      ++count_;
    }
    return absl::OkStatus();
  }

  // Copies the batch filled so far to the device and launches the kernel on it.
  absl::Status Flush() {
    if (count_ == 0) return absl::OkStatus();
    Batch& b = batches_[next_];
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(cudaMemcpyAsync(b.device_addresses, b.host_addresses, count_ * 8, cudaMemcpyHostToDevice, stream_),
             "copying patch addresses"));
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(cudaMemcpyAsync(b.device_values, b.host_values, count_ * e_, cudaMemcpyHostToDevice, stream_),
             "copying patch values"));
    WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaEventRecord(b.copied, stream_), "cudaEventRecord"));
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(static_cast<cudaError_t>(cuda::LaunchScatter(static_cast<const uint64_t*>(b.device_addresses),
                                                          b.device_values, count_, e_, aligned_, stream_)),
             "the element patch scatter kernel"));
    count_ = 0;
    next_ ^= 1;
    return absl::OkStatus();
  }

 private:
  Batch* batches_;
  const uint64_t capacity_, value_capacity_;
  cudaStream_t stream_;
  size_t next_ = 0;
  uint64_t count_ = 0;
  uint32_t e_ = 0;
  bool aligned_ = false;
};

// InvalidArgument unless `pointer` is memory of CUDA device `device`.
absl::Status CheckOnDevice(const void* pointer, int device, const std::string& name) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, pointer) != cudaSuccess) {
    (void)cudaGetLastError();
    a.type = cudaMemoryTypeUnregistered;
  }
  if ((a.type == cudaMemoryTypeDevice && a.device == device) || a.type == cudaMemoryTypeManaged) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tensor '", name, "' is not in the memory of cuda:", device,
                   a.type == cudaMemoryTypeDevice ? absl::StrCat(" (it is on cuda:", a.device, ")") : ""));
}

#endif  // WEIGHTSTORE_HAVE_CUDA_KERNELS

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
#if !WEIGHTSTORE_HAVE_CUDA_KERNELS
  return absl::UnimplementedError(
      "this build of weightstore has no CUDA kernels (built without the CUDA toolkit or without a usable nvcc)");
#else
  if (!CudaAvailable()) return absl::UnavailableError("no CUDA device is available");
  DeviceGuard guard;
  WEIGHTSTORE_RETURN_IF_ERROR(guard.Select(options.device));
  // Checked before anything is written: where each tensor is, every patch,
  // and how much scratch the short runs need.
  uint64_t short_elements = 0;
  uint32_t widest = 1;
  for (size_t i = 0; i < patches.size(); ++i) {
    const uint64_t bytes = patches[i].spec.byte_size();
    WEIGHTSTORE_RETURN_IF_ERROR(CheckOnDevice(destinations[i], options.device, patches[i].spec.name));
    if (bytes > 0) {
      WEIGHTSTORE_RETURN_IF_ERROR(CheckOnDevice(static_cast<const std::byte*>(destinations[i]) + bytes - 1,
                                                options.device, patches[i].spec.name));
    }
    const uint32_t e = patches[i].patch.element_size;
    absl::Status checked = ForEachRun(patches[i].patch, [&](uint64_t, uint64_t length, const std::byte*) {
      if (length * e < kCopyRunBytes) short_elements += length;
    });
    if (!checked.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the patch of tensor '", patches[i].spec.name, "': ", checked.message()));
    }
    widest = std::max(widest, e);
  }
  const uint64_t capacity = std::max<uint64_t>(1, std::min(short_elements, kBatchElements));
  Batch batches[2];
  for (Batch& b : batches) WEIGHTSTORE_RETURN_IF_ERROR(Allocate(&b, capacity, capacity * widest));
  cudaStream_t stream = nullptr;
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));

  Scatter scatter(batches, capacity, capacity * widest, stream);
  absl::Status status;
  for (size_t i = 0; i < patches.size() && status.ok(); ++i) {
    const ElementPatch& patch = patches[i].patch;
    const uint32_t e = patch.element_size;
    const auto base = reinterpret_cast<uint64_t>(destinations[i]);
    const bool aligned = (e == 1 || e == 2 || e == 4 || e == 8) && base % e == 0;
    status = ForEachRun(patch, [&](uint64_t start, uint64_t length, const std::byte* values) {
      if (!status.ok()) return;
      if (length * e >= kCopyRunBytes) {
        status = Cuda(cudaMemcpyAsync(reinterpret_cast<void*>(base + start * e), values, length * e,
                                      cudaMemcpyHostToDevice, stream),
                      "copying an element patch's run");
      } else {
        status = scatter.Add(base, start, length, values, e, aligned);
      }
    });
  }
  if (status.ok()) status = scatter.Flush();
  // Whatever was enqueued finishes before the scratch is freed.
  absl::Status synced = Cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize after element patches");
  cudaStreamDestroy(stream);
  if (status.ok()) status = synced;
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat(status.message(), " (the patched tensors may be partly written)"));
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
