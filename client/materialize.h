// Materialize: one call that puts a selection of any Store (local, same-host
// socket, remote) on a device, as tensors that own (or share) their memory.
//
//   CPU   from a SharedMemoryStore: views of the daemon's read-only mappings
//         (no copy); from other stores: 2 MiB-aligned, huge-page host buffers.
//   CUDA  from a SharedMemoryStore: one DMA per mapped extent, straight from
//         the mapping registered with cudaHostRegister (kept in `pinned` when
//         given); from other stores: a pinned staging ring with async copies
//         that overlap the transfer. Needs a build with the CUDA toolkit
//         (WEIGHTSTORE_WITH_CUDA); otherwise Unavailable.
//
// To fill buffers of your own instead, pass a TensorSink to Store::FetchTensors.
#ifndef WEIGHTSTORE_CLIENT_MATERIALIZE_H_
#define WEIGHTSTORE_CLIENT_MATERIALIZE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/store.h"

namespace weightstore::client {

class PinnedMappings;  // client/cuda_materializer.h

struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;

  static Device Cpu() { return {}; }
  static Device Cuda(int index = 0) { return {Kind::kCuda, index}; }
  // Parses "cpu", "cuda" or "cuda:N". InvalidArgument otherwise.
  static absl::StatusOr<Device> Parse(absl::string_view text);
  std::string ToString() const;
};

// A tensor on a device. Copies share the memory, freed with the last copy. CPU
// views of a shared mapping are read-only.
struct MaterializedTensor {
  TensorSpec spec;
  Device device;
  std::shared_ptr<void> memory;
  void* data() const { return memory.get(); }
};

struct MaterializeOptions {
  Device device;
  // CUDA from a SharedMemoryStore: registrations to reuse and keep. Default: none
  // (register for this call only).
  PinnedMappings* pinned = nullptr;
};

// Loads every tensor `query` selects from `name` onto options.device, in
// selection order. Returns the store's errors as they are, and Unavailable for
// CUDA without a GPU or without CUDA support in this build.
absl::StatusOr<std::vector<MaterializedTensor>> Materialize(Store& store, const std::string& name,
                                                            const Query& query = {},
                                                            const MaterializeOptions& options = {});

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_MATERIALIZE_H_
