// Apply: load a selection into a target, the description of the model being
// loaded (burn-store's ModuleSnapshot::apply), and report what happened.
//
// A checkpoint alone does not say which module a tensor belongs to, so adapters
// read it from the target schema: each parameter's path, dtype, shape and module
// type ("Linear", "BatchNorm", "LayerNorm", "GroupNorm", "RmsNorm", ...).
//
// For each target parameter P, in schema order (burn-store's load order):
//   1. look P up among the selection's names (after rename and contiguous
//      indices); if absent, try the adapter's alternative name (norm layers:
//      gamma <-> weight, beta <-> bias); if still absent, P is missing;
//   2. adapt: a rank-2 `weight` of a Linear module is transposed (PyTorch stores
//      [out, in], Burn [in, out]; both adapters transpose);
//   3. if the filter excludes P, P is skipped; else P is sliced (its shard or
//      explicit slice, named by its path; core/select/selection.h);
//   4. the served shape must equal the target's, else a shape-mismatch error
//      (so a rank's target describes its shards);
//   5. P is applied with the file's dtype, or the selection's --dtype, or the
//      target's dtype when cast_to_target is set.
// P goes through the steps Snapshot::Select takes (core/select/pipeline.h),
// so it is served as a fetch serves it: with its quantization, a rank's
// experts only, and each scale following its weight.
// Unused: selection names no parameter used, sorted. Unlike burn-store, a
// tensor found through an alternative name counts as used.
#ifndef WEIGHTSTORE_CORE_SELECT_APPLY_H_
#define WEIGHTSTORE_CORE_SELECT_APPLY_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checkpoint.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"
#include "core/target_schema.h"

namespace weightstore {

struct ApplyError {
  enum class Kind { kShapeMismatch, kDTypeMismatch };
  Kind kind = Kind::kShapeMismatch;
  std::string path;
  std::string message;
};

struct ApplyResult {
  std::vector<std::string> applied;  // traversal order
  std::vector<std::string> skipped;  // sorted
  std::vector<std::string> missing;  // sorted
  std::vector<std::string> unused;   // sorted
  std::vector<ApplyError> errors;
  std::vector<std::string> suggestions;

  bool is_success() const { return errors.empty(); }
  // A readable summary: counts, up to 10 entries per list, suggestions.
  std::string Summary() const;
};

struct ApplyOptions {
  // Missing parameters are not an error. Default: false.
  bool allow_partial = false;
  // Errors (shape mismatches) fail the load. Default: true.
  bool validate = true;
  // Cast each tensor to its parameter's dtype when they differ (floats to
  // floats, integers widened). Default: false: the file's dtype is kept.
  bool cast_to_target = false;
};

struct Applied {
  std::shared_ptr<const Snapshot> snapshot;  // the applied tensors, named by target path
  ApplyResult result;
  // FailedPrecondition when the options reject the result (missing without
  // allow_partial, errors with validate); OK otherwise.
  absl::Status status;
};

absl::StatusOr<Applied> Apply(std::shared_ptr<const Checkpoint> checkpoint, const Selection& selection,
                              const TargetSchema& target, const ApplyOptions& options = {});

// Jaro similarity of two strings, in [0, 1].
double JaroSimilarity(absl::string_view a, absl::string_view b);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_APPLY_H_
