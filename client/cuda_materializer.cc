#include "client/cuda_materializer.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/host_buffer.h"
#include "core/status_macros.h"

namespace weightstore::client {
namespace {

absl::Status Cuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

absl::StatusOr<DeviceTensor> AllocateDevice(const TensorSpec& spec, int device) {
  // The current device is per thread, and sinks may be called from a store's
  // helper thread: name it every time.
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaSetDevice(device), "cudaSetDevice"));
  void* ptr = nullptr;
  if (spec.byte_size() > 0) {
    absl::Status s = Cuda(cudaMalloc(&ptr, spec.byte_size()), absl::StrCat("cudaMalloc for tensor '", spec.name, "'"));
    if (!s.ok()) return absl::ResourceExhaustedError(s.message());
  }
  return DeviceTensor{spec, device, std::shared_ptr<void>(ptr, [](void* p) {
                        if (p != nullptr) cudaFree(p);
                      })};
}

}  // namespace

bool CudaAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

struct CudaSink::Slot {
  void* pinned = nullptr;
  size_t capacity = 0;
  cudaEvent_t done = nullptr;
  bool in_flight = false;
  ~Slot() {
    if (pinned != nullptr) cudaFreeHost(pinned);
    if (done != nullptr) cudaEventDestroy(done);
  }
};

absl::StatusOr<std::unique_ptr<CudaSink>> CudaSink::Create(const CudaSinkOptions& options) {
  if (!CudaAvailable()) return absl::UnavailableError("no CUDA device is available");
  std::unique_ptr<CudaSink> sink(new CudaSink());
  sink->options_ = options;
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaSetDevice(options.device), "cudaSetDevice"));
  cudaStream_t stream;
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  sink->stream_ = stream;
  for (int i = 0; i < std::max(1, options.slots); ++i) {
    auto slot = std::make_unique<Slot>();
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(cudaHostAlloc(&slot->pinned, options.slot_bytes, cudaHostAllocDefault), "cudaHostAlloc"));
    slot->capacity = options.slot_bytes;
    WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&slot->done, cudaEventDisableTiming), "cudaEventCreate"));
    sink->slots_.push_back(std::move(slot));
  }
  return sink;
}

CudaSink::~CudaSink() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
    slots_.clear();
    cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  }
}

absl::StatusOr<std::span<std::byte>> CudaSink::Begin(const TensorSpec& spec) {
  // The next slot; wait until its previous copy has left it.
  Slot* slot = slots_[next_].get();
  if (slot->in_flight) {
    WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(slot->done), "waiting for a staging buffer"));
    slot->in_flight = false;
  }
  if (spec.byte_size() > slot->capacity) {
    cudaFreeHost(slot->pinned);
    slot->pinned = nullptr;
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(cudaHostAlloc(&slot->pinned, spec.byte_size(), cudaHostAllocDefault), "growing a staging buffer"));
    slot->capacity = spec.byte_size();
  }
  current_ = slot;
  return std::span<std::byte>(static_cast<std::byte*>(slot->pinned), spec.byte_size());
}

absl::Status CudaSink::End(const TensorSpec& spec) {
  if (current_ == nullptr) return absl::FailedPreconditionError("End without Begin");
  WEIGHTSTORE_ASSIGN_OR_RETURN(DeviceTensor tensor, AllocateDevice(spec, options_.device));
  auto stream = static_cast<cudaStream_t>(stream_);
  if (spec.byte_size() > 0) {
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(cudaMemcpyAsync(tensor.data(), current_->pinned, spec.byte_size(), cudaMemcpyHostToDevice, stream),
             absl::StrCat("copying tensor '", spec.name, "' to the device")));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaEventRecord(current_->done, stream), "cudaEventRecord"));
  current_->in_flight = true;
  current_ = nullptr;
  next_ = (next_ + 1) % slots_.size();
  tensors_.push_back(std::move(tensor));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<DeviceTensor>> CudaSink::Finish() {
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize"));
  std::vector<DeviceTensor> out = std::move(tensors_);
  tensors_.clear();
  return out;
}

namespace {

// The page-aligned range covering `storage`.
std::pair<void*, size_t> PageRange(const SharedBytes& storage) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(storage.data()) & ~(page - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(storage.data()) + storage.size() + page - 1) & ~(page - 1);
  return {reinterpret_cast<void*>(lo), hi - lo};
}

}  // namespace

PinnedMappings::~PinnedMappings() { Clear(); }

absl::Status PinnedMappings::Pin(const SharedBytes& storage) {
  auto [base, length] = PageRange(storage);
  absl::MutexLock lock(&mu_);
  for (const Entry& e : entries_) {
    if (e.base == base) return absl::OkStatus();
  }
  if (cudaHostRegister(base, length, cudaHostRegisterReadOnly | cudaHostRegisterPortable) != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError("cudaHostRegister refused the mapping");
  }
  entries_.push_back({storage.owner(), base, length});
  return absl::OkStatus();
}

void PinnedMappings::Clear() {
  absl::MutexLock lock(&mu_);
  for (const Entry& e : entries_) cudaHostUnregister(e.base);
  entries_.clear();
}

size_t PinnedMappings::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

namespace {

// A tensor on the host and, when its bytes lie in a mapping that may be
// registered with CUDA, that mapping's whole range.
struct HostTensor {
  SharedTensor host;
  std::optional<SharedBytes> storage;
};

absl::StatusOr<std::vector<DeviceTensor>> CopyHostTensors(std::vector<HostTensor> items,
                                                          const CopyToDeviceOptions& options) {
  if (!CudaAvailable()) return absl::UnavailableError("no CUDA device is available");
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaSetDevice(options.device), "cudaSetDevice"));
  cudaStream_t stream;
  WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
  PinnedMappings local;  // released at the end unless the caller keeps registrations
  PinnedMappings& pinned = options.pinned != nullptr ? *options.pinned : local;
  auto cleanup = [&] {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  };
  // Tensors in registered memory are copied straight from it: those of one
  // storage share one device allocation and one DMA over their extent (when they
  // cover most of it), and each DeviceTensor aliases its piece. The rest go
  // through a CudaSink's pinned ring. Output keeps snapshot order.
  std::vector<std::optional<DeviceTensor>> out(items.size());
  std::vector<size_t> staged;
  std::unique_ptr<CudaSink> sink;
  std::vector<SharedTensor> keep;  // host bytes stay alive until the copies finish
  struct Direct {
    size_t index;
    const std::byte* host;
  };
  std::map<const std::byte*, std::vector<Direct>> by_region;  // registered base -> tensors
  absl::Status status;
  for (size_t i = 0; i < items.size() && status.ok(); ++i) {
    const TensorSpec& spec = items[i].host.spec;
    std::optional<SharedTensor> host = items[i].host;
    const std::byte* region = nullptr;
    if (options.register_mapping && items[i].storage && host->bytes.size() > 0 && pinned.Pin(*items[i].storage).ok()) {
      region = static_cast<const std::byte*>(PageRange(*items[i].storage).first);
    }
    if (region != nullptr) {
      by_region[region].push_back({i, host->bytes.data()});
      keep.push_back(*std::move(host));
      continue;
    }
    if (sink == nullptr) {
      CudaSinkOptions sink_options;
      sink_options.device = options.device;
      absl::StatusOr<std::unique_ptr<CudaSink>> created = CudaSink::Create(sink_options);
      if (!created.ok()) {
        status = created.status();
        break;
      }
      sink = *std::move(created);
    }
    absl::StatusOr<std::span<std::byte>> staging = sink->Begin(spec);
    if (!staging.ok()) {
      status = staging.status();
      break;
    }
    if (!staging->empty()) std::memcpy(staging->data(), host->bytes.data(), staging->size());
    status = sink->End(spec);
    staged.push_back(i);
  }
  // A tensor copied into an allocation of its own.
  auto CopyAlone = [&](const Direct& d) -> absl::Status {
    const TensorSpec& spec = items[d.index].host.spec;
    WEIGHTSTORE_ASSIGN_OR_RETURN(DeviceTensor dev, AllocateDevice(spec, options.device));
    absl::Status copied = Cuda(cudaMemcpyAsync(dev.data(), d.host, spec.byte_size(), cudaMemcpyHostToDevice, stream),
                               absl::StrCat("copying tensor '", spec.name, "' to the device"));
    out[d.index] = std::move(dev);
    return copied;
  };
  for (auto& [region, all] : by_region) {
    if (!status.ok()) break;
    // A tensor in the shared block keeps its address's alignment modulo
    // kBlockAlign. One not aligned to its element size in the file (a
    // hand-made SafeTensors file can place it anywhere) gets an allocation of
    // its own: a kernel reading it misaligned would fault, and poison the
    // CUDA context.
    constexpr uintptr_t kBlockAlign = 256;  // cudaMalloc's
    std::vector<Direct> tensors, misaligned;
    for (const Direct& d : all) {
      const uintptr_t address = reinterpret_cast<uintptr_t>(d.host);
      const uint64_t unit = DTypeSize(items[d.index].host.spec.dtype);  // 3 for F6: read as bytes
      (address % (std::has_single_bit(unit) ? unit : 1) == 0 ? tensors : misaligned).push_back(d);
    }
    for (const Direct& d : misaligned) {
      status = CopyAlone(d);
      if (!status.ok()) break;
    }
    if (!status.ok() || tensors.empty()) continue;
    // The block starts at a kBlockAlign boundary at or below the first
    // tensor: the region is page-aligned, so the boundary lies inside it.
    const std::byte* lo =
        reinterpret_cast<const std::byte*>(reinterpret_cast<uintptr_t>(tensors.front().host) & ~(kBlockAlign - 1));
    const std::byte* hi = tensors.front().host;
    uint64_t selected = 0;
    for (const Direct& d : tensors) {
      const uint64_t n = items[d.index].host.spec.byte_size();
      lo = std::min(lo, reinterpret_cast<const std::byte*>(reinterpret_cast<uintptr_t>(d.host) & ~(kBlockAlign - 1)));
      hi = std::max(hi, d.host + n);
      selected += n;
    }
    const uint64_t extent = static_cast<uint64_t>(hi - lo);
    if (selected * 2 >= extent) {  // dense enough: one allocation, one DMA
      TensorSpec whole{"(extent)", DType::kU8, {extent}};
      absl::StatusOr<DeviceTensor> block = AllocateDevice(whole, options.device);
      if (!block.ok()) {
        status = block.status();
        break;
      }
      status =
          Cuda(cudaMemcpyAsync(block->data(), lo, extent, cudaMemcpyHostToDevice, stream), "copying to the device");
      for (const Direct& d : tensors) {
        const TensorSpec& spec = items[d.index].host.spec;
        void* piece = static_cast<std::byte*>(block->data()) + (d.host - lo);
        out[d.index] = DeviceTensor{spec, options.device, std::shared_ptr<void>(block->memory, piece)};
      }
      continue;
    }
    for (const Direct& d : tensors) {  // sparse: a copy per tensor
      status = CopyAlone(d);
      if (!status.ok()) break;
    }
  }
  if (status.ok() && sink != nullptr) {
    absl::StatusOr<std::vector<DeviceTensor>> done = sink->Finish();
    if (done.ok()) {
      for (size_t k = 0; k < staged.size(); ++k) out[staged[k]] = std::move((*done)[k]);
    } else {
      status = done.status();
    }
  }
  if (status.ok()) status = Cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cleanup();
  if (!status.ok()) return status;
  std::vector<DeviceTensor> result;
  result.reserve(out.size());
  for (auto& d : out) result.push_back(*std::move(d));
  return result;
}

}  // namespace

absl::StatusOr<std::vector<DeviceTensor>> CopyToDevice(const Snapshot& snapshot, const CopyToDeviceOptions& options) {
  std::vector<HostTensor> items;
  items.reserve(snapshot.size());
  for (const SnapshotTensor& t : snapshot.tensors()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor host, snapshot.Read(t));
    std::optional<SharedBytes> storage;
    if (t.is_identity()) {
      absl::StatusOr<SharedBytes> s = t.source->layout.storage->Get();
      if (s.ok()) storage = *std::move(s);
    }
    items.push_back({std::move(host), std::move(storage)});
  }
  return CopyHostTensors(std::move(items), options);
}

absl::StatusOr<std::vector<DeviceTensor>> CopyToDevice(const MappedTensors& mapped,
                                                       const CopyToDeviceOptions& options) {
  std::vector<HostTensor> items;
  items.reserve(mapped.tensors.size());
  for (const SharedTensor& t : mapped.tensors) {
    std::optional<SharedBytes> storage;
    for (const auto& segment : mapped.segments) {
      uint64_t offset;
      if (segment->Contains(t.bytes, &offset)) storage = segment->bytes();
    }
    items.push_back({t, std::move(storage)});
  }
  return CopyHostTensors(std::move(items), options);
}

absl::StatusOr<SharedBytes> CopyToHost(const DeviceTensor& tensor) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(tensor.spec.byte_size()));
  if (buffer.size() > 0) {
    WEIGHTSTORE_RETURN_IF_ERROR(Cuda(cudaSetDevice(tensor.device), "cudaSetDevice"));
    WEIGHTSTORE_RETURN_IF_ERROR(
        Cuda(cudaMemcpy(buffer.data(), tensor.data(), buffer.size(), cudaMemcpyDeviceToHost), "copying to the host"));
  }
  return std::move(buffer).Freeze();
}

}  // namespace weightstore::client
