// Element patches applied to tensors in GPU memory: what an update does for
// held tensors that live on a CUDA device (docs/updates.md). Declared in every
// build; without CUDA the call is Unimplemented.
#ifndef WEIGHTSTORE_CLIENT_DEVICE_PATCHES_H_
#define WEIGHTSTORE_CLIENT_DEVICE_PATCHES_H_

#include <span>

#include "absl/status/status.h"
#include "client/store.h"

namespace weightstore::client {

struct DevicePatchOptions {
  int device = 0;
  // Copy each patched tensor back to the host and check it against its
  // digest: a read of every patched tensor over the bus and an XXH3-128 pass
  // on the host. Off only for a caller that checks the results otherwise.
  bool verify = true;
};

// Applies patches[i] to destinations[i] (memory of options.device holding
// the tensor as of the since version: patches[i].spec.byte_size() bytes), in
// one call. Every patch is checked and planned on the host first; then one
// scatter kernel per element size writes the short runs (an address of 8
// bytes and the value per element, both copied to the device) and a copy per
// run of 4 KiB or more writes the long ones, all on one stream; then, with
// `verify`, each result is checked. InvalidArgument naming the tensor for a
// malformed patch or a destination of another size, or destinations that
// overlap (nothing written); Unavailable without a GPU; Unimplemented in a
// build without CUDA; Internal for a CUDA error once writing began; DataLoss
// naming the tensor for a result unlike its digest.
absl::Status ApplyReceivedPatchesOnDevice(std::span<const ReceivedPatch> patches, std::span<void* const> destinations,
                                          const DevicePatchOptions& options = {});

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_DEVICE_PATCHES_H_
