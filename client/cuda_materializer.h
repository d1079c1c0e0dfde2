// Materializing tensors on a CUDA GPU (built when the CUDA toolkit is found).
//
// CudaSink receives fetched tensors (from any Store) through a ring of pinned
// host staging buffers: the bytes of tensor i+1 arrive while tensor i is copied
// to the device with cudaMemcpyAsync. CopyToDevice copies tensors that are
// already in host memory (a LocalStore's zero-copy views of a mapped file)
// straight from the mapping, after registering it with cudaHostRegister, with no
// staging copy. Device memory is owned by the returned DeviceTensors.
#ifndef WEIGHTSTORE_CLIENT_CUDA_MATERIALIZER_H_
#define WEIGHTSTORE_CLIENT_CUDA_MATERIALIZER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "core/select/snapshot.h"

namespace weightstore::client {

// A tensor in GPU memory; copies share the allocation, freed with the last one.
struct DeviceTensor {
  TensorSpec spec;
  int device = 0;
  std::shared_ptr<void> memory;
  void* data() const { return memory.get(); }
};

// True if a CUDA device can be used (driver loaded, at least one GPU).
bool CudaAvailable();

struct CudaSinkOptions {
  int device = 0;
  // Pinned staging buffers in the ring. Default: 2 (double buffering).
  int slots = 2;
  // Initial size of each buffer; a larger tensor grows its slot. Default: 64 MiB.
  size_t slot_bytes = 64 << 20;
};

class CudaSink final : public TensorSink {
 public:
  static absl::StatusOr<std::unique_ptr<CudaSink>> Create(const CudaSinkOptions& options = {});
  ~CudaSink() override;

  absl::StatusOr<std::span<std::byte>> Begin(const TensorSpec& spec) override;
  absl::Status End(const TensorSpec& spec) override;
  // Waits for every copy; returns the device tensors in arrival order.
  absl::StatusOr<std::vector<DeviceTensor>> Finish();

 private:
  struct Slot;
  CudaSink() = default;
  CudaSinkOptions options_;
  void* stream_ = nullptr;  // cudaStream_t
  std::vector<std::unique_ptr<Slot>> slots_;
  size_t next_ = 0;
  Slot* current_ = nullptr;
  std::vector<DeviceTensor> tensors_;
};

// Keeps host mappings registered with CUDA (cudaHostRegister) across calls, so
// copying a served checkpoint to the GPU again skips registration (measured:
// 34 ms per GiB on an H100 host, more than the copy itself). Each registration
// holds its mapping's owner alive, so pages are never unmapped while registered.
// Thread-safe.
class PinnedMappings {
 public:
  PinnedMappings() = default;
  PinnedMappings(const PinnedMappings&) = delete;
  PinnedMappings& operator=(const PinnedMappings&) = delete;
  ~PinnedMappings();

  // Registers the pages of `storage` (read-only) unless already registered.
  // Returns Unavailable if the driver refuses.
  absl::Status Pin(const SharedBytes& storage);
  // Unregisters everything and releases the mappings.
  void Clear();
  size_t size() const;

 private:
  struct Entry {
    std::shared_ptr<const void> owner;
    void* base;
    size_t length;
  };
  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

struct CopyToDeviceOptions {
  int device = 0;
  // Registrations to reuse and keep (see PinnedMappings). Default: none, so each
  // call registers what it needs and unregisters it at the end.
  PinnedMappings* pinned = nullptr;
  // Register the snapshot's mapped file with cudaHostRegister and copy from it
  // directly; if the driver refuses, tensors go through a pinned staging buffer.
  bool register_mapping = true;
};

// Copies every tensor of `snapshot` to the device. Tensors of one mapped file
// that cover most of their extent share one device allocation filled by one DMA
// (each DeviceTensor aliases its piece); transformed tensors (casts, transposes)
// are produced on the host first and staged.
absl::StatusOr<std::vector<DeviceTensor>> CopyToDevice(const Snapshot& snapshot,
                                                       const CopyToDeviceOptions& options = {});

// Copies tensors mapped from weightstored's same-host socket to the device,
// straight from the shared mappings (registered with cudaHostRegister, kept in
// options.pinned when given), with no staging copy.
absl::StatusOr<std::vector<DeviceTensor>> CopyToDevice(const MappedTensors& mapped,
                                                       const CopyToDeviceOptions& options = {});

// Copies a device tensor back to host memory (tests and checks).
absl::StatusOr<SharedBytes> CopyToHost(const DeviceTensor& tensor);

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_CUDA_MATERIALIZER_H_
