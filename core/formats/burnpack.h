// Burnpack (.bpk) reader and planner, byte-compatible with Burn's burn-pack.
//
// Layout (core/formats/FORMAT.md): u32 LE magic 0x4255524E ("NRUB" on disk), u16 LE
// version 1, u32 LE CBOR metadata length, the CBOR metadata, zero padding to the
// next multiple of 256, then tensor data; each tensor starts at a multiple of 256
// relative to the data section. The reader applies Burn's limits (100 MiB of
// metadata, 100,000 tensors, CBOR depth 128, 10 GiB per tensor, 100 GiB per
// file) plus checks Burn leaves out: byte length = element count x dtype size,
// no overlapping tensors, every tensor inside the file, no trailing bytes.
#ifndef WEIGHTSTORE_CORE_FORMATS_BURNPACK_H_
#define WEIGHTSTORE_CORE_FORMATS_BURNPACK_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/checkpoint.h"
#include "core/format.h"
#include "core/formats/write_plan.h"

namespace weightstore {

// The format's entry in the table (core/format.h): ".bpk" files; writable.
extern const FormatSpec kBurnpackFormat;

inline constexpr uint64_t kBurnpackAlignment = 256;

// True if `head` starts with the Burnpack magic.
bool IsBurnpack(absl::string_view head);

absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseBurnpack(SharedBytes bytes, const std::string& path,
                                                                const OpenOptions& options);

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadBurnpack(std::shared_ptr<const MappedFile> file,
                                                               const OpenOptions& options);

// Lays out a Burnpack file as Burn's writer does: tensors in input order, the
// descriptor map sorted by name, "metadata" omitted when empty, shortest CBOR
// heads, 256-byte alignment, no trailing padding. Deterministic.
absl::StatusOr<WritePlan> PlanBurnpack(const std::vector<TensorSpec>& tensors, const Metadata& metadata);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_BURNPACK_H_
