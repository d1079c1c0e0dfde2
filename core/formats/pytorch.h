// PyTorch checkpoint reader (read-only): torch.save's zip format, the legacy
// pre-1.6 stream, the TAR format of torch < 0.1.10, and plain pickles.
//
// The pickle is interpreted by a data-only machine (core/pickle.h), never run.
// TorchScript archives and big-endian files are refused. Storage offsets, strides
// (non-contiguous tensors are gathered on read) and views sharing one storage are
// honoured; every view is checked against its storage, and no data is ever
// replaced by zeros. Nested dicts are flattened with '.', and `top_level_key`
// selects one dict-valued root key first.
#ifndef WEIGHTSTORE_CORE_FORMATS_PYTORCH_H_
#define WEIGHTSTORE_CORE_FORMATS_PYTORCH_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/checkpoint.h"
#include "core/format.h"

namespace weightstore {

// The format's entry in the table (core/format.h): ".pt" and ".pth" files (and
// ".bin" when named); read-only. Last in detection order: it takes any file,
// so its reader names what is wrong with one that is no checkpoint at all.
extern const FormatSpec kPyTorchFormat;

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParsePyTorch(SharedBytes bytes, const std::string& path,
                                                               const OpenOptions& options);

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadPyTorch(std::shared_ptr<const MappedFile> file,
                                                              const OpenOptions& options);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_PYTORCH_H_
