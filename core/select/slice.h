// Tensor slices: the part of a tensor a selection serves, for tensor
// parallelism (each rank receives its shard) or an explicit [start:stop] per
// dimension (HF safetensors' get_slice, computed on the server).
//
// A slice names, for each dimension of the tensor (as served before slicing,
// after any transpose), the index ranges kept, concatenated in order along that
// dimension. One range per dimension is a box; several on one dimension are the
// rank's parts of a fused tensor (QKV: a piece of each of Q, K and V).
//
// Values; the functions are pure and thread-safe.
#ifndef WEIGHTSTORE_CORE_SELECT_SLICE_H_
#define WEIGHTSTORE_CORE_SELECT_SLICE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore {

// Indices [start, stop) of one dimension.
struct IndexRange {
  uint64_t start = 0;
  uint64_t stop = 0;

  uint64_t size() const { return stop - start; }
  friend bool operator==(const IndexRange&, const IndexRange&) = default;
};

struct TensorSlice {
  // One entry per dimension, each a non-empty list of ranges. Empty: the whole
  // tensor is served.
  std::vector<std::vector<IndexRange>> dims;

  bool empty() const { return dims.empty(); }
  // The served shape.
  std::vector<uint64_t> Shape() const;
  // Returns OK if the slice fits a tensor of `shape` (one entry per
  // dimension, ranges ordered start <= stop <= the dimension), else
  // InvalidArgument naming `tensor`.
  absl::Status Check(std::span<const uint64_t> shape, absl::string_view tensor) const;
  // The served elements' first index in the row-major order of a tensor of
  // `shape`, when they are consecutive in it (a dim-0 shard of a row-major
  // tensor, or any slice whose outer dimensions are 1): the slice is then a
  // byte range. nullopt otherwise. REQUIRES: Check(shape).ok().
  std::optional<uint64_t> ContiguousStart(std::span<const uint64_t> shape) const;
  // "[0:512, :]": "a:b" per range, ranges of one dimension joined by "+", and
  // ":" for a whole dimension of `shape`. "" when empty().
  std::string ToString(std::span<const uint64_t> shape) const;

  friend bool operator==(const TensorSlice&, const TensorSlice&) = default;
};

// How a shard rule splits the dimension it names.
struct ShardSplit {
  uint32_t dim = 0;
  // The dimension holds this many equal fused parts (QKV: 3, gate-up: 2); each
  // is split world-size ways and the rank's pieces concatenated. 0 is one part,
  // as 1 (the API's ShardRule.parts, where proto3 cannot tell 0 from unset).
  // Default: 1.
  uint32_t parts = 1;
  // A part not divisible by the world size is split as torch.tensor_split
  // does (the first size % world pieces one longer) instead of refused.
  bool uneven = false;

  friend bool operator==(const ShardSplit&, const ShardSplit&) = default;
};

// "0", "1x3", "0:uneven", "0x2:uneven" (the text after '=' in --shard-dim).
absl::StatusOr<ShardSplit> ParseShardSplit(absl::string_view text);
std::string ShardSplitToString(const ShardSplit& split);

// The slice rank `rank` of `world` receives of a tensor of `shape` split by
// `split`. InvalidArgument naming `tensor` when the dimension is past the
// tensor's rank, or a part's size is not divisible by `world` (without
// `uneven`). REQUIRES: rank < world.
absl::StatusOr<TensorSlice> ShardSlice(std::span<const uint64_t> shape, const ShardSplit& split, uint32_t rank,
                                       uint32_t world, absl::string_view tensor);

// One dimension of an explicit slice: [start:stop], either end open.
struct SliceBound {
  std::optional<uint64_t> start;  // absent: 0
  std::optional<uint64_t> stop;   // absent: the dimension's size

  friend bool operator==(const SliceBound&, const SliceBound&) = default;
};

// Parses "[a:b, :, c:]" (Python slice syntax without steps or negative
// indices; at most kMaxRank dimensions). "[]" selects the whole tensor.
absl::StatusOr<std::vector<SliceBound>> ParseSliceBounds(absl::string_view text);
std::string SliceBoundsToString(std::span<const SliceBound> bounds);

// The slice `bounds` select of a tensor of `shape`; dimensions past the bounds
// are whole. InvalidArgument naming `tensor` when there are more bounds than
// dimensions or a bound lies outside its dimension.
absl::StatusOr<TensorSlice> ExplicitSlice(std::span<const uint64_t> shape, std::span<const SliceBound> bounds,
                                          absl::string_view tensor);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SELECT_SLICE_H_
