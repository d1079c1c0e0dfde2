// Selection: which tensors of a checkpoint to serve, under which names, and in
// which dtype. burn-store's semantics, implemented once here and used by the CLI,
// the daemon and every client.
//
// The pipeline, in order (burn-store's load order):
//   0. top-level key: keep names under "<key>." and strip that prefix;
//   1. rename: each rule is a regex replace-all on the previous rule's output,
//      with $1 / ${1} / $name / ${name} / $$ in the replacement, as Rust's regex;
//   2. contiguous indices: numeric path segments renumbered 0, 1, 2... per prefix
//      (by default only when a PyTorch source is applied to a target);
//   3. filter: kept if it matches any include regex (unanchored) or exact path,
//      or if there are none; then dropped if it matches any exclude regex;
//   4. dtype: floating-point tensors cast to `dtype` (integers are left alone);
//   5. slice: a tensor named by an explicit slice, or matched by a shard rule,
//      is served in part (core/select/slice.h); the rest are served whole.
// Adapters need to know module types, so they run when a selection is applied
// to a target schema (core/select/apply.h).
#ifndef WEIGHTSTORE_CORE_SELECT_SELECTION_H_
#define WEIGHTSTORE_CORE_SELECT_SELECTION_H_

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/checkpoint.h"
#include "core/dtype.h"
#include "core/select/slice.h"

namespace re2 {
class RE2;
}

namespace weightstore {

struct RenameRule {
  std::string pattern;      // RE2 syntax, unanchored
  std::string replacement;  // $1, ${1}, $name, ${name}, $$
};

// Tensor parallelism: rank `rank` of `world_size` receives, of each tensor a
// rule matches, its shard along the rule's dimension; tensors no rule matches
// are served whole (replicated).
struct ShardRule {
  std::string pattern;  // RE2, unanchored, on the served name (after renaming)
  ShardSplit split;
};
// A tensor of quantization scales that follows its weight: whatever part of
// the weight a rank is served, it is served the scales that cover it. Scale
// element i of dimension d covers weight elements [i * block[d],
// (i + 1) * block[d]) of the weight's dimension d (a scale of lower rank
// covers the weight's leading dimensions). A rank whose part ends inside a
// block gets that block too, and the listing says the block is shared.
struct ScaleRule {
  std::string pattern;  // RE2 on the scale's served name, unanchored
  // The weight's served name: the scale's name with `pattern` replaced by
  // this (as a rename rule: "weight_scale_inv$" -> "weight").
  std::string weight;
  // Weight elements a scale element covers, per dimension of the scale.
  // Empty: for each dimension the smallest power of two that gives the
  // scale's size (300 rows in 3 blocks: 128), else weight / scale when that
  // divides.
  std::vector<uint64_t> block;
};

struct ShardSpec {
  uint32_t rank = 0;
  uint32_t world_size = 0;  // 0: no sharding
  std::vector<ShardRule> rules;
  // Scales that follow their weights (ScaleRule), checked before `rules`.
  std::vector<ScaleRule> scales;
  // Also follow the scales the standard names give, when their weight is
  // served (each shown in the listing as the scale of its weight):
  // "X.weight_scale_inv", "X.weight_scale", "X.scale" of "X.weight" (FP8
  // block, ModelOpt NVFP4 and FP8, DeepSeek-V4), "X.weight_scale" of
  // "X.weight_packed" (compressed-tensors), "X_scales" of "X_blocks"
  // (gpt-oss MXFP4). A scale of rank 0 (a global scale) is replicated.
  bool detect_scales = true;
  // Expert parallelism for experts stored one per tensor: a served name
  // matching one of these RE2 patterns, whose first capture group is the
  // expert's index, is served only to the rank whose experts hold it: rank r
  // of N gets [r * E / N, (r + 1) * E / N) of the E experts of its group (the
  // names alike but for the index; E is the largest index plus one). Names
  // keep their global index. Experts stacked in one tensor are a shard rule
  // on their dimension.
  std::vector<std::string> experts;
};

// An explicit slice of one tensor, by its served name.
struct NamedSlice {
  std::string name;
  std::vector<SliceBound> bounds;  // one per leading dimension; the rest whole
};

enum class Adapter { kNone, kPyTorchToBurn, kBurnToPyTorch };

// "pytorch-to-burn", "burn-to-pytorch", "none".
absl::string_view AdapterName(Adapter adapter);
std::optional<Adapter> ParseAdapter(absl::string_view name);

struct SelectionOptions {
  // Serve only tensors under this first path segment, without the segment
  // (PyTorch's "model_state_dict.fc.weight" -> "fc.weight"). Default: all.
  std::string top_level_key;
  std::vector<std::string> include;  // regexes; a tensor matching any is kept
  std::vector<std::string> paths;    // exact names (after renaming), also kept
  std::vector<std::string> exclude;  // regexes; a tensor matching any is dropped
  std::vector<RenameRule> renames;   // applied in order
  // Renumber numeric path segments per prefix. Default: on when a PyTorch source
  // is applied to a target (burn-store's PytorchStore load), off otherwise, so
  // plain reads and conversions keep the file's names.
  std::optional<bool> contiguous_indices;
  // Used by Apply() with a target schema. Default: none.
  Adapter adapter = Adapter::kNone;
  // Cast floating-point tensors to this dtype. Default: keep the file's dtype.
  std::optional<DType> dtype;
  // Serve each rank its shard. Default: off.
  ShardSpec shard;
  // Serve these tensors in part. A tensor may have an explicit slice or match
  // shard rules, not both. Default: none.
  std::vector<NamedSlice> slices;

  bool empty() const {
    return top_level_key.empty() && include.empty() && paths.empty() && exclude.empty() && renames.empty() &&
           !contiguous_indices.has_value() && adapter == Adapter::kNone && !dtype.has_value() &&
           shard.world_size == 0 && shard.rules.empty() && shard.scales.empty() && shard.experts.empty() &&
           slices.empty();
  }
};

// What one selection may cost: every bound a request's author controls. The
// daemon sets these from its flags; the defaults suit a service.
struct SelectionLimits {
  // Most patterns (include + exclude + rename). Default: 256.
  size_t max_patterns = 256;
  // Longest pattern, replacement, exact path or top-level key, in bytes.
  // Default: 4096.
  size_t max_pattern_bytes = 4096;
  // Largest compiled program of one pattern (RE2 instructions). Default: 10,000.
  int max_program_size = 10000;
  // RE2 instructions of every pattern of the selection together: the regex
  // budget of one request, whatever the pattern count. Default: 50,000.
  int64_t max_total_program_size = 50000;
  // Memory RE2 may use for every pattern of the selection together (programs
  // and match caches). Default: 16 MiB.
  int64_t max_regex_memory = 16 << 20;
  // Most exact paths, and most explicit slices. Default: 100,000 (a
  // checkpoint's tensor limit).
  size_t max_paths = 100000;
  // Largest tensor-parallel world size. Default: 65,536.
  uint32_t max_world_size = 65536;
  // Most fused parts a shard rule may name. Default: 64.
  uint32_t max_fused_parts = 64;
  // Longest tensor name a rename may produce. Default: 4096 bytes.
  size_t max_name_bytes = 4096;
  // Bytes of every selected name together (after renaming); also bounds the
  // work of contiguous indices (~0.4 us a numeric segment). Default: 32 MiB.
  uint64_t max_total_name_bytes = uint64_t{32} << 20;
  // Bytes of names the selection's patterns may scan, every pass of every
  // pattern counted: a replace-all rescans the rest of a name from each match,
  // so a name can cost its length squared. A count, not a clock, so the same
  // request is refused the same way on a busy machine. Default: 1 GiB.
  uint64_t max_scan_bytes = uint64_t{1} << 30;
  // CPU time one selection may take (renaming, filtering): RE2 is linear in
  // the bytes it scans, but a byte can cost from 1 ns to over 200 ns
  // (a pattern whose DFA does not fit its memory). Default: 2 s.
  std::chrono::milliseconds max_time{2000};
  // Asked with the clock (once per 64 KiB of work): once it returns true the
  // selection stops with CANCELLED, as when its client went away. Default:
  // never.
  std::function<bool()> cancelled;
};

// What one selection may still spend: SelectionLimits::max_scan_bytes of
// names scanned (checked at every charge) and max_time from its start. The
// clock is read once per 64 KiB of work or 64 charges, whichever comes first:
// short names cost few clock reads, and one slow search at a time (a pattern
// whose DFA does not fit) cannot run far past the time. Thread-compatible.
class SelectionDeadline {
 public:
  explicit SelectionDeadline(const SelectionLimits& limits)
      : budget_(limits.max_time),
        max_work_(limits.max_scan_bytes),
        end_(std::chrono::steady_clock::now() + limits.max_time),
        cancelled_(limits.cancelled) {}
  // Counts `work` bytes scanned; ResourceExhausted, naming `what` was being
  // done, once the bytes or the time are spent; Cancelled once
  // SelectionLimits::cancelled says so.
  absl::Status Check(absl::string_view what, uint64_t work) const {
    work_ += work;
    if (work_ < next_check_ && ++charges_ < kChargesBetweenChecks && work_ <= max_work_) return absl::OkStatus();
    next_check_ = work_ + kWorkBetweenChecks;
    charges_ = 0;
    return CheckSpent(what);
  }
  uint64_t scanned() const { return work_; }

 private:
  static constexpr uint64_t kWorkBetweenChecks = 64 << 10;
  static constexpr uint32_t kChargesBetweenChecks = 64;
  absl::Status CheckSpent(absl::string_view what) const;
  std::chrono::milliseconds budget_;
  uint64_t max_work_;
  std::chrono::steady_clock::time_point end_;
  std::function<bool()> cancelled_;
  mutable uint64_t work_ = 0, next_check_ = 0;
  mutable uint32_t charges_ = 0;
};

// A validated, compiled selection. Thread-safe: immutable, shareable.
class Selection {
 public:
  // Compiles every pattern. Returns InvalidArgument naming the first pattern
  // that does not compile or is too large, and ResourceExhausted when the
  // patterns together exceed `limits`.
  static absl::StatusOr<std::shared_ptr<const Selection>> Compile(const SelectionOptions& options,
                                                                  const SelectionLimits& limits = {});
  ~Selection();

  const SelectionOptions& options() const { return options_; }
  const SelectionLimits& limits() const { return limits_; }

  // Applies the rename rules in order. Returns InvalidArgument, naming the
  // tensor and the rule, when a rule grows the name past limits().max_name_bytes.
  // Between rules it checks `deadline` (when given).
  absl::StatusOr<std::string> Rename(absl::string_view name, const SelectionDeadline* deadline = nullptr) const;
  // True if `name` (already renamed) passes the filter.
  bool Matches(absl::string_view name) const;
  // As above, charging `deadline` the bytes scanned: its error once spent.
  absl::StatusOr<bool> Matches(absl::string_view name, const SelectionDeadline& deadline) const;
  // Whether contiguous indices apply to a checkpoint of `format`, read on its
  // own or applied to a target.
  bool UsesContiguousIndices(const FormatSpec& format, bool applying_to_target) const;
  // The part of tensor `name` (served, `shape` before slicing) to serve: its
  // explicit slice, or its shard under the rule that matches it; empty (the
  // whole tensor) when neither applies. InvalidArgument naming the tensor when
  // the slice does not fit it, a dimension is not divisible, or the tensor has
  // an explicit slice and matches a rule, or matches rules that disagree.
  absl::StatusOr<TensorSlice> SliceOf(absl::string_view name, std::span<const uint64_t> shape,
                                      const SelectionDeadline* deadline = nullptr) const;
  // Whether the selection has an explicit slice of `name`.
  bool HasExplicitSlice(absl::string_view name) const { return slices_.contains(name); }
  // NotFound naming the first explicit slice for which `served` is false.
  absl::Status CheckSlicesUsed(const std::function<bool(absl::string_view)>& served) const;
  // When `name` is a scale an explicit ScaleRule names: the weight's name and
  // the rule. nullopt otherwise.
  struct ScaleOf {
    std::string weight;
    const ScaleRule* rule = nullptr;  // null: found by a standard name
  };
  absl::StatusOr<std::optional<ScaleOf>> ScaleRuleOf(absl::string_view name, const SelectionDeadline& deadline) const;
  // The expert index in `name` and its group (the name without the index),
  // when an expert pattern matches it; nullopt otherwise. InvalidArgument
  // naming the tensor when the capture is not a decimal index.
  struct ExpertOf {
    uint64_t index = 0;
    std::string group;
  };
  absl::StatusOr<std::optional<ExpertOf>> ExpertOfName(absl::string_view name, const SelectionDeadline& deadline) const;

 private:
  Selection() = default;
  SelectionOptions options_;
  SelectionLimits limits_;
  // Each list of patterns joined into one alternation, so a name is scanned
  // once per list rather than once per pattern (null when the list is empty).
  std::unique_ptr<re2::RE2> include_any_, exclude_any_;
  absl::flat_hash_set<std::string> paths_;
  std::vector<std::unique_ptr<re2::RE2>> rename_;
  std::vector<std::unique_ptr<re2::RE2>> shard_rules_;   // one per options_.shard.rules
  std::vector<std::unique_ptr<re2::RE2>> scale_rules_;   // one per options_.shard.scales
  std::vector<std::unique_ptr<re2::RE2>> expert_rules_;  // one per options_.shard.experts
  absl::flat_hash_map<std::string, size_t> slices_;      // name -> index into options_.slices
};

// Renumbers every numeric path segment, per original prefix, to 0, 1, 2...
// in ascending order (burn-store's map_indices_contiguous): fc.0, fc.2, fc.4
// become fc.0, fc.1, fc.2, and layers.2.block.3 is numbered within
// "layers.2.block.". Returns the new names in input order.
std::vector<std::string> MapIndicesContiguous(const std::vector<std::string>& names);

// Replaces every non-overlapping match of `re` in `text` with `replacement`,
// expanding $1, ${1}, $name, ${name} and $$ (Rust regex rules: "$1a" names the
// group "1a"; an unknown group expands to nothing).
std::string ReplaceAll(const re2::RE2& re, absl::string_view text, absl::string_view replacement);

enum class ReplaceOutcome { kNoMatch, kReplaced, kTooLong };
// As ReplaceAll, in place, stopping as soon as the result would exceed
// `max_bytes` (then `text` is unchanged and kTooLong is returned). Allocates
// nothing when nothing matches.
ReplaceOutcome ReplaceAllInPlace(const re2::RE2& re, std::string* text, absl::string_view replacement,
                                 size_t max_bytes);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_SELECTION_H_
