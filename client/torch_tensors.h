// LibTorch integration (optional target weightstore::torch, built when CMake
// finds Torch: Debian's libtorch-dev 1.13, CPU only).
//
// Tensors from any Store become torch::Tensors. From a SharedMemoryStore they
// are zero-copy views of the daemon's read-only mappings, and each view keeps
// its mapping alive; writing to one crashes the process (clone() first). From
// the other stores they own the memory they were fetched into.
#ifndef WEIGHTSTORE_CLIENT_TORCH_TENSORS_H_
#define WEIGHTSTORE_CLIENT_TORCH_TENSORS_H_

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/store.h"

namespace weightstore::client {

// The torch dtype of `dtype`; Unimplemented for those torch 1.13 lacks
// (U16, U32, U64, F8 variants).
absl::StatusOr<torch::ScalarType> TorchType(DType dtype);

// A CPU tensor over `tensor`'s bytes, no copy; it holds the bytes' owner.
absl::StatusOr<torch::Tensor> ToTorch(const SharedTensor& tensor);

// Every tensor `query` selects from `name`, by served name, in selection order.
absl::StatusOr<std::vector<std::pair<std::string, torch::Tensor>>> LoadTorchTensors(Store& store,
                                                                                    const std::string& name,
                                                                                    const Query& query = {});

// Loads `name` into `module`'s parameters and buffers in one call: the target is
// built from the module (paths, shapes, dtypes, and module kinds such as
// "Linear" for the adapters), selected on the server, then copied in. Contiguous
// indices default off (a PyTorch module keeps the gaps of Sequential's
// parameter-free layers). Returns the apply result; a failed load is
// FailedPrecondition with burn-store's summary, and leaves `module` untouched.
absl::StatusOr<ApplyResult> LoadIntoModule(Store& store, const std::string& name, torch::nn::Module& module,
                                           Query query = {});

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_TORCH_TENSORS_H_
