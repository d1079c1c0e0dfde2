// The steps of the selection pipeline (core/select/selection.h) that
// Snapshot::Select and Apply share: a fetch and a load into a target take a
// tensor through the same code, so they serve it alike (names, quantization,
// dtype, a rank's experts and cuts). What differs between them stays with
// each: the filter's place, and Apply's target lookup, adapters and checks.
#ifndef WEIGHTSTORE_CORE_SELECT_PIPELINE_H_
#define WEIGHTSTORE_CORE_SELECT_PIPELINE_H_

#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"

namespace weightstore {

// A checkpoint entry under its selected name.
struct NamedEntry {
  std::string name;  // after top-level key, rename and contiguous indices
  size_t entry;      // index into checkpoint.entries()
};

// Steps 0-2 (top-level key, rename, contiguous indices), before the filter.
// Returns NotFound listing the available keys when no tensor is under the
// top-level key, and InvalidArgument naming both tensors when two get the
// same name. Charges `deadline` for the renaming.
absl::StatusOr<std::vector<NamedEntry>> ResolveNames(const Checkpoint& checkpoint, const Selection& selection,
                                                     bool applying_to_target, const SelectionDeadline& deadline);

// A tensor the filter kept: `entry` of `checkpoint` served as `name`, in its
// stored dtype and shape, with the quantization the checkpoint's config
// describes (DescribeQuantization). Every selected tensor starts here.
SnapshotTensor StartTensor(const Checkpoint& checkpoint, const CheckpointEntry& entry, std::string name);

// Step 4: a floating-point tensor is served in the selection's dtype, if it
// has one. Returns InvalidArgument naming both dtypes when the stored dtype
// cannot be cast to it (CheckCast); the dtype is set either way, and
// Snapshot::Create refuses the tensor unless a later step replaces it.
absl::Status CastToSelectionDType(const Selection& selection, SnapshotTensor* tensor);

// Step 5 for one tensor: sets its slice from `selection` and its served shape
// from the slice. REQUIRES: tensor->spec.shape unsliced.
absl::Status SliceTensor(const Selection& selection, const SelectionDeadline& deadline, SnapshotTensor* tensor);

// Step 5 for a rank's tensors: drops the experts of other ranks
// (OtherRanksExperts), keeping the order of the rest, then cuts each by its
// shard rule or explicit slice, scales following their weights
// (ShardTensors). Calls visit(i, dropped) for each tensor i, in order, before
// it is dropped or moved to its new place (the kept ones before it).
// REQUIRES: each spec's shape unsliced.
absl::Status CutTensors(const Checkpoint& checkpoint, const Selection& selection, const SelectionDeadline& deadline,
                        std::vector<SnapshotTensor>* tensors, absl::FunctionRef<void(size_t i, bool dropped)> visit);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_PIPELINE_H_
