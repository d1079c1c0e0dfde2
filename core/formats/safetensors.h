// SafeTensors reader and planner: the format of Hugging Face's safetensors.
//
// Layout: u64 LE header length N, N bytes of JSON header, then the data section.
// The reader enforces every rule of reliability-and-ecosystem.md §1.3: header size
// bound, JSON whitespace only around the object, duplicate keys rejected at every
// level, bounded nesting and tensor count, known dtypes, overflow-checked sizes,
// byte size = element count x dtype size, offsets contiguous from 0 without gaps
// or overlaps, and no trailing bytes.
#ifndef WEIGHTSTORE_CORE_FORMATS_SAFETENSORS_H_
#define WEIGHTSTORE_CORE_FORMATS_SAFETENSORS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/checkpoint.h"
#include "core/format.h"
#include "core/formats/write_plan.h"

namespace weightstore {

// The format's entry in the table (core/format.h): ".safetensors" files and
// "*.safetensors.index.json" sharded indexes; writable.
extern const FormatSpec kSafeTensorsFormat;

// True if `file` starts like a SafeTensors file (a plausible length, then '{').
bool IsSafeTensors(absl::string_view file);

// A SafeTensors file's header, parsed and validated.
struct SafeTensorsHeader {
  struct Tensor {
    TensorSpec spec;
    uint64_t offset = 0;  // in the data section
  };
  uint64_t data_start = 0;      // 8 + the header's length: where the data begins
  std::vector<Tensor> tensors;  // in header order
  Metadata metadata;
};
// Parses the header of a SafeTensors file of `file_size` bytes from `prefix`,
// its first bytes (at least 8 + the header's length), with the checks
// ParseSafeTensors makes of the header itself (not OpenOptions' limits on
// names and shapes, which opening the file applies): for a file not at hand
// (a remote object).
absl::StatusOr<SafeTensorsHeader> ParseSafeTensorsHeader(absl::string_view prefix, uint64_t file_size,
                                                         const std::string& path, const OpenOptions& options);

// Parses and validates a whole SafeTensors file held in `bytes`; `path` names it
// in errors. Tensors keep header order.
absl::StatusOr<std::shared_ptr<const Checkpoint>> ParseSafeTensors(SharedBytes bytes, const std::string& path,
                                                                   const OpenOptions& options);

absl::StatusOr<std::shared_ptr<const Checkpoint>> ReadSafeTensors(std::shared_ptr<const MappedFile> file,
                                                                  const OpenOptions& options);

// Opens `model.safetensors.index.json` and its shards as one checkpoint. Every
// tensor of the weight map must be in the shard it names, and every shard tensor
// in the weight map. String values of the index's "metadata" become metadata.
// The shard files `index_path` names, next to it; empty when it cannot be read.
std::vector<std::string> ShardFilesOf(const std::string& index_path);

absl::StatusOr<std::shared_ptr<const Checkpoint>> OpenShardedSafeTensors(const std::string& index_path,
                                                                         const OpenOptions& options);

// Lays out a SafeTensors file as the reference writer does: compact JSON with
// "__metadata__" first, tensors ordered by dtype descending then name, header
// padded with spaces to a multiple of 8, contiguous offsets.
absl::StatusOr<WritePlan> PlanSafeTensors(const std::vector<TensorSpec>& tensors, const Metadata& metadata);
// The same, with the tensors in the order given (a copy that keeps another
// writer's order: readers take any).
absl::StatusOr<WritePlan> PlanSafeTensorsInOrder(const std::vector<TensorSpec>& tensors, const Metadata& metadata);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_FORMATS_SAFETENSORS_H_
