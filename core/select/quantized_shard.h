// What a rank of a quantized checkpoint is served beyond its shard rules
// (docs/selection.md, "Quantized checkpoints"): the experts that are its own
// (ShardSpec::experts), and each scale cut as its weight is
// (ShardSpec::scales, the standard names, the checkpoint's quantization
// config). Both Snapshot::Select and Apply reach them through the shared
// steps of core/select/pipeline.h, so a fetch and a load into a target cut a
// rank alike.
#ifndef WEIGHTSTORE_CORE_SELECT_QUANTIZED_SHARD_H_
#define WEIGHTSTORE_CORE_SELECT_QUANTIZED_SHARD_H_

#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "core/checkpoint.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"

namespace weightstore {

// For each of `count` served names (name_of(0), ...), whether it is an
// expert of another rank than the selection's: all false without a shard or
// expert patterns. Rank r of N holds experts [r * E / N, (r + 1) * E / N) of
// each group's E (the largest index plus one). InvalidArgument naming the
// tensor when an index is not a decimal number or is 2^64 - 1.
absl::StatusOr<std::vector<bool>> OtherRanksExperts(const Selection& selection, const SelectionDeadline& deadline,
                                                    size_t count, absl::FunctionRef<absl::string_view(size_t)> name_of);

// Step 5 of the pipeline for a rank's tensors: the shard rules and slices cut
// each tensor (SliceTensor), then each scale is served the blocks that cover
// its weight's part, with the block from its rule, the quantization config or
// the shapes. REQUIRES: each spec's shape unsliced. InvalidArgument naming the
// scale and the weight when a scale cannot follow.
absl::Status ShardTensors(const Checkpoint& checkpoint, const Selection& selection, const SelectionDeadline& deadline,
                          std::vector<SnapshotTensor>* tensors);

// Sets tensor->quantization when the checkpoint's quantization config
// describes the tensor and a scale of a standard name follows it in the file
// (StartTensor, for every selected tensor).
void DescribeQuantization(const Checkpoint& checkpoint, SnapshotTensor* tensor);
// What DescribeQuantization says of `entry` (one of checkpoint's): empty when
// nothing.
std::string DescribeQuantizationOf(const Checkpoint& checkpoint, const CheckpointEntry& entry);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_QUANTIZED_SHARD_H_
