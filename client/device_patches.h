// Element patches applied to tensors in GPU memory: what an update does for
// held tensors that live on a CUDA device (docs/updates.md). Declared in every
// build; without the CUDA kernel (client/cuda_scatter.cu) the call is
// Unimplemented.
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
// one call, on a stream of its own that is synchronized before it returns;
// the caller's current device is restored. First, with nothing written: every
// destination is checked to lie in options.device's memory, and every patch to
// parse; the scratch is allocated (pinned and device memory for two batches
// of at most 2M elements: an 8-byte address and the value each). Then runs of
// 4 KiB or more are copied as they are and the shorter ones scattered by the
// kernel, a batch at a time. Then, with `verify`, each result is copied back
// and checked. InvalidArgument naming the tensor for a malformed patch, a
// destination of another size or device, or destinations that overlap;
// ResourceExhausted for scratch that cannot be had; Unavailable without a
// GPU; Unimplemented in a build without the kernel (all with nothing
// written). Internal for a CUDA error once writing began (the tensors may be
// partly written); DataLoss naming the tensor for a result unlike its digest.
absl::Status ApplyReceivedPatchesOnDevice(std::span<const ReceivedPatch> patches, std::span<void* const> destinations,
                                          const DevicePatchOptions& options = {});

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_DEVICE_PATCHES_H_
