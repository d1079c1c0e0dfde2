#include "core/select/slice.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/tensor.h"

namespace weightstore {

std::vector<uint64_t> TensorSlice::Shape() const {
  std::vector<uint64_t> shape;
  shape.reserve(dims.size());
  for (const std::vector<IndexRange>& ranges : dims) {
    uint64_t size = 0;
    for (const IndexRange& r : ranges) size += r.size();
    shape.push_back(size);
  }
  return shape;
}

absl::Status TensorSlice::Check(std::span<const uint64_t> shape, absl::string_view tensor) const {
  if (empty()) return absl::OkStatus();
  if (dims.size() != shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': a slice of ", dims.size(),
                                                   " dimensions for a tensor of shape ", ShapeToString(shape)));
  }
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': dimension ", d, " has no range"));
    }
    uint64_t previous_stop = 0;  // ranges ascend without overlapping, so they add up to at most shape[d]
    for (const IndexRange& r : dims[d]) {
      if (r.start > r.stop || r.stop > shape[d] || r.start < previous_stop) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': range ", r.start, ":", r.stop,
                                                       " of dimension ", d, " is outside [0, ", shape[d],
                                                       ") or not after the range before it"));
      }
      previous_stop = r.stop;
    }
  }
  return absl::OkStatus();
}

std::optional<uint64_t> TensorSlice::ContiguousStart(std::span<const uint64_t> shape) const {
  if (empty()) return 0;
  // Served elements are consecutive when, past the first dimension served
  // with more than one index, every dimension is whole, and the dimensions
  // before it are served one index each; the dimension itself needs one range.
  const std::vector<uint64_t> served = Shape();
  for (uint64_t n : served) {
    if (n == 0) return 0;  // nothing served: any start will do
  }
  size_t d = 0;
  while (d < dims.size() && served[d] == 1) ++d;
  auto non_empty = [](const std::vector<IndexRange>& ranges) {
    return std::count_if(ranges.begin(), ranges.end(), [](const IndexRange& r) { return r.size() > 0; });
  };
  if (d < dims.size()) {
    if (non_empty(dims[d]) != 1) return std::nullopt;
    for (size_t inner = d + 1; inner < dims.size(); ++inner) {
      if (served[inner] != shape[inner]) {  // whole (the ranges ascend without overlapping)
        return std::nullopt;
      }
    }
  }
  // Row-major index of the first served element (each dimension's first
  // non-empty range: none is empty, as nothing served returned above).
  uint64_t first = 0;
  for (size_t k = 0; k < dims.size(); ++k) {
    auto range = std::find_if(dims[k].begin(), dims[k].end(), [](const IndexRange& r) { return r.size() > 0; });
    first = first * shape[k] + range->start;
  }
  return first;
}

std::string TensorSlice::ToString(std::span<const uint64_t> shape) const {
  if (empty()) return "";
  std::vector<std::string> parts;
  parts.reserve(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d].size() == 1 && dims[d][0].start == 0 && d < shape.size() && dims[d][0].stop == shape[d]) {
      parts.push_back(":");
      continue;
    }
    parts.push_back(absl::StrJoin(
        dims[d], "+", [](std::string* out, const IndexRange& r) { absl::StrAppend(out, r.start, ":", r.stop); }));
  }
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

namespace {

// Adjacent ranges merged; and a slice that keeps every index is no slice: the
// tensor is served whole.
TensorSlice Normalized(TensorSlice slice, std::span<const uint64_t> shape) {
  for (std::vector<IndexRange>& ranges : slice.dims) {
    size_t kept = 0;
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (kept > 0 && ranges[kept - 1].stop == ranges[i].start) {
        ranges[kept - 1].stop = ranges[i].stop;
      } else {
        ranges[kept++] = ranges[i];
      }
    }
    ranges.resize(kept);
  }
  for (size_t d = 0; d < slice.dims.size(); ++d) {
    if (slice.dims[d].size() != 1 || slice.dims[d][0].start != 0 || slice.dims[d][0].stop != shape[d]) return slice;
  }
  return TensorSlice{};
}

}  // namespace

absl::StatusOr<ShardSplit> ParseShardSplit(absl::string_view text) {
  ShardSplit split;
  absl::string_view rest = absl::StripAsciiWhitespace(text);
  if (absl::ConsumeSuffix(&rest, ":uneven")) split.uneven = true;
  absl::string_view dim = rest, parts;
  if (size_t x = rest.find('x'); x != absl::string_view::npos) {
    dim = rest.substr(0, x);
    parts = rest.substr(x + 1);
  }
  auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a shard split: DIM, DIMxPARTS, optionally followed by ':uneven'"));
  };
  if (!absl::SimpleAtoi(dim, &split.dim) || dim.empty() || dim[0] == '-' || dim[0] == '+') return bad();
  if (!parts.empty() || rest.find('x') != absl::string_view::npos) {
    if (!absl::SimpleAtoi(parts, &split.parts) || parts.empty() || parts[0] == '-' || parts[0] == '+' ||
        split.parts == 0) {
      return bad();
    }
  }
  return split;
}

std::string ShardSplitToString(const ShardSplit& split) {
  return absl::StrCat(split.dim, split.parts > 1 ? absl::StrCat("x", split.parts) : "", split.uneven ? ":uneven" : "");
}

absl::StatusOr<TensorSlice> ShardSlice(std::span<const uint64_t> shape, const ShardSplit& split, uint32_t rank,
                                       uint32_t world, absl::string_view tensor) {
  if (split.dim >= shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "' of shape ", ShapeToString(shape),
                                                   " has no dimension ", split.dim, " to shard"));
  }
  const uint64_t size = shape[split.dim];
  const uint32_t parts = split.parts == 0 ? 1 : split.parts;
  if (size % parts != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': dimension ", split.dim, " (", size,
                                                   ") does not hold ", parts, " equal fused parts"));
  }
  const uint64_t part = size / parts;
  if (part % world != 0 && !split.uneven) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "': dimension ", split.dim, " (", size,
                                                   parts > 1 ? absl::StrCat(", ", parts, " parts of ", part) : "",
                                                   ") is not divisible by the world size ", world,
                                                   " (the rule may say ':uneven' for torch.tensor_split sizes)"));
  }
  // torch.tensor_split: the first part % world pieces are one longer.
  const uint64_t base = part / world, longer = part % world;
  const uint64_t start = rank * base + std::min<uint64_t>(rank, longer);
  const uint64_t length = base + (rank < longer ? 1 : 0);
  TensorSlice slice;
  slice.dims.resize(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    if (d != split.dim) {
      slice.dims[d] = {{0, shape[d]}};
      continue;
    }
    for (uint64_t p = 0; p < parts; ++p) slice.dims[d].push_back({p * part + start, p * part + start + length});
  }
  return Normalized(std::move(slice), shape);
}

absl::StatusOr<std::vector<SliceBound>> ParseSliceBounds(absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text.substr(0, 256), "' is not a slice like '[0:512, :]': ", why));
  };
  absl::string_view body = absl::StripAsciiWhitespace(text);
  if (!absl::ConsumePrefix(&body, "[") || !absl::ConsumeSuffix(&body, "]")) return bad("it needs brackets");
  std::vector<SliceBound> bounds;
  if (absl::StripAsciiWhitespace(body).empty()) return bounds;
  for (absl::string_view dim : absl::StrSplit(body, ',')) {
    if (bounds.size() == kMaxRank) return bad(absl::StrCat("more than ", kMaxRank, " dimensions"));
    dim = absl::StripAsciiWhitespace(dim);
    const size_t colon = dim.find(':');
    if (colon == absl::string_view::npos) return bad("each dimension needs 'start:stop' (either may be left out)");
    SliceBound bound;
    for (auto [part, out] : {std::pair{dim.substr(0, colon), &bound.start}, {dim.substr(colon + 1), &bound.stop}}) {
      part = absl::StripAsciiWhitespace(part);
      if (part.empty()) continue;
      uint64_t value;
      if (!absl::SimpleAtoi(part, &value) || part[0] == '-' || part[0] == '+') {
        return bad(
            absl::StrCat("'", part, "' is not a non-negative index (steps and negative indices are not supported)"));
      }
      *out = value;
    }
    bounds.push_back(bound);
  }
  return bounds;
}

std::string SliceBoundsToString(std::span<const SliceBound> bounds) {
  return absl::StrCat("[",
                      absl::StrJoin(bounds, ", ",
                                    [](std::string* out, const SliceBound& b) {
                                      absl::StrAppend(out, b.start ? absl::StrCat(*b.start) : "", ":",
                                                      b.stop ? absl::StrCat(*b.stop) : "");
                                    }),
                      "]");
}

absl::StatusOr<TensorSlice> ExplicitSlice(std::span<const uint64_t> shape, std::span<const SliceBound> bounds,
                                          absl::string_view tensor) {
  if (bounds.size() > shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "' of shape ", ShapeToString(shape), " has ",
                                                   shape.size(), " dimensions; the slice ", SliceBoundsToString(bounds),
                                                   " names ", bounds.size()));
  }
  TensorSlice slice;
  slice.dims.resize(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    IndexRange range{0, shape[d]};
    if (d < bounds.size()) {
      range.start = bounds[d].start.value_or(0);
      range.stop = bounds[d].stop.value_or(shape[d]);
      if (range.start > range.stop || range.stop > shape[d]) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor, "' of shape ", ShapeToString(shape),
                                                       ": the slice ", SliceBoundsToString(bounds), " asks for ",
                                                       range.start, ":", range.stop, " of dimension ", d));
      }
    }
    slice.dims[d] = {range};
  }
  return Normalized(std::move(slice), shape);
}

}  // namespace weightstore
