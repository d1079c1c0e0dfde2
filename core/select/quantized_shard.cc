#include "core/select/quantized_shard.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/select/pipeline.h"
#include "core/status_macros.h"

namespace weightstore {
namespace {

// A scale tensor and the weight it follows (an index into the snapshot's
// tensors).
struct ScaleLink {
  size_t weight = 0;
  const ScaleRule* rule = nullptr;  // null: a standard name
};

// The standard names of scales (ShardSpec::detect_scales): a suffix of the
// scale's name, and what replaces it in the weight's.
constexpr std::pair<absl::string_view, absl::string_view> kStandardScales[] = {
    {".weight_scale_inv", ".weight"},     // FP8 block (DeepSeek-V3, Qwen FP8)
    {".weight_scale", ".weight"},         // ModelOpt NVFP4 and FP8
    {".weight_scale", ".weight_packed"},  // compressed-tensors NVFP4
    {".scale", ".weight"},                // DeepSeek-V4
    {"_scales", "_blocks"},               // gpt-oss MXFP4
};

// True when a scale of a standard name follows the tensor `name` in
// `checkpoint` (both source names).
bool HasStandardScale(const Checkpoint& checkpoint, absl::string_view name) {
  for (const auto& [suffix, replacement] : kStandardScales) {
    if (!absl::EndsWith(name, replacement)) continue;
    const std::string scale = absl::StrCat(name.substr(0, name.size() - replacement.size()), suffix);
    if (checkpoint.Find(scale) != nullptr) return true;
  }
  return false;
}

// Which served tensors are scales of which served weights: by the explicit
// rules first, then (detect_scales) by the standard names. A scale of rank 0
// (a global scale) follows nothing: it is replicated.
absl::StatusOr<std::vector<std::optional<ScaleLink>>> FindScales(const Selection& selection,
                                                                 const SelectionDeadline& deadline,
                                                                 const std::vector<SnapshotTensor>& tensors) {
  absl::flat_hash_map<absl::string_view, size_t> by_name;
  by_name.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) by_name.emplace(tensors[i].spec.name, i);
  std::vector<std::optional<ScaleLink>> links(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = tensors[i].spec.name;
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<Selection::ScaleOf> rule, selection.ScaleRuleOf(name, deadline));
    if (rule) {
      auto it = by_name.find(rule->weight);
      if (it == by_name.end() || it->second == i) {
        return absl::InvalidArgumentError(absl::StrCat("scale '", name, "' follows weight '", rule->weight,
                                                       "' (scale rule '", rule->rule->pattern,
                                                       "'), which is not served"));
      }
      links[i] = ScaleLink{it->second, rule->rule};
      continue;
    }
    if (!selection.options().shard.detect_scales || tensors[i].unsliced_shape().empty()) continue;
    for (const auto& [suffix, replacement] : kStandardScales) {
      if (!absl::EndsWith(name, suffix)) continue;
      const std::string weight = absl::StrCat(name.substr(0, name.size() - suffix.size()), replacement);
      auto it = by_name.find(weight);
      if (it == by_name.end() || it->second == i) continue;
      if (tensors[it->second].unsliced_shape().size() < tensors[i].unsliced_shape().size()) continue;
      links[i] = ScaleLink{it->second, nullptr};
      break;
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!links[i]) continue;
    const std::string& name = tensors[i].spec.name;
    const std::string& weight = tensors[links[i]->weight].spec.name;
    if (links[links[i]->weight]) {  // a chain or a cycle: which cut would win depends on the order
      return absl::InvalidArgumentError(absl::StrCat("scale '", name, "' follows '", weight, "', itself a scale of '",
                                                     tensors[links[links[i]->weight]->weight].spec.name,
                                                     "'; a scale follows a weight"));
    }
    if (selection.HasExplicitSlice(name)) {
      return absl::InvalidArgumentError(absl::StrCat("scale '", name, "' follows weight '", weight,
                                                     "' and has an explicit slice; give it one or the other"));
    }
  }
  return links;
}

// The block a scale dimension of `scale` elements implies for a weight
// dimension of `weight`: the smallest power of two that gives that many
// blocks (quantizers' blocks are: 16, 32, 128), else weight / scale when it
// divides; 0 when neither (an explicit ScaleRule must say).
uint64_t InferBlock(uint64_t weight, uint64_t scale) {
  if (scale == 0) return weight == 0 ? 1 : 0;
  for (uint64_t b = 1; b != 0 && b <= weight; b <<= 1) {
    if ((weight + b - 1) / b == scale) return b;
  }
  if (weight % scale == 0) return weight / scale;
  return 0;
}

// The block a quantization config's scheme gives `scale` (shape `s`) of
// `weight` (shape `w`), in elements of each scale dimension; nullopt when the
// scheme names no block or does not describe a scale of this shape (the
// shapes decide then, as without a config). The scheme counts values: a
// weight in a wider integer dtype packs several per element (two FP4 values
// per U8), so its last dimension's block is that many times fewer elements.
absl::StatusOr<std::optional<std::vector<uint64_t>>> ConfigBlock(const QuantScheme& scheme,
                                                                 const SnapshotTensor& weight,
                                                                 const std::vector<uint64_t>& w,
                                                                 const std::vector<uint64_t>& s,
                                                                 absl::string_view what) {
  if (scheme.block.size() != 2 || w.empty()) return std::nullopt;
  uint64_t rows = scheme.block[0], cols = scheme.block[1];
  if (weight.transpose) std::swap(rows, cols);
  const DType stored = weight.source->spec.dtype;
  const uint32_t bits = DTypeBits(stored);
  if (!IsFloatingPoint(stored) && scheme.value_bits != 0 && bits > scheme.value_bits) {
    const uint64_t per_element = bits / scheme.value_bits;
    if (bits % scheme.value_bits != 0 || cols % per_element != 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": its blocks of ", cols, " ", scheme.value_bits,
                                                     "-bit values (", DescribeQuantScheme(scheme), ") are not whole ",
                                                     DTypeName(stored), " elements"));
    }
    cols /= per_element;
  }
  std::vector<uint64_t> block(s.size(), 1);
  if (s.size() == w.size()) {
    block.back() = cols;
    if (s.size() >= 2) block[s.size() - 2] = rows;
    return block;
  }
  // A scale without the weight's last dimension, whose every row holds one
  // block (gpt-oss: blocks [E, out, G, 16] of U8, scales [E, out, G]).
  if (s.size() + 1 == w.size() && w.back() == cols && rows == 1) return block;
  return std::nullopt;
}

// Serves `scale` the blocks that cover the part of `weight` this rank is
// served (ScaleRule): for each dimension the weight is cut along, the blocks
// from the one holding its first element to the one holding its last. The
// block is the rule's, else the checkpoint's quantization config's, else
// inferred from the shapes (InferBlock).
absl::Status FollowWeight(const Checkpoint& checkpoint, const SnapshotTensor& weight, const ScaleLink& link,
                          SnapshotTensor* scale) {
  const std::vector<uint64_t> w = weight.unsliced_shape(), s = scale->unsliced_shape();
  const std::string what = absl::StrCat("scale '", scale->spec.name, "' ", ShapeToString(s), " of weight '",
                                        weight.spec.name, "' ", ShapeToString(w));
  if (s.size() > w.size()) return absl::InvalidArgumentError(absl::StrCat(what, ": more dimensions than its weight"));
  std::vector<uint64_t> block(s.size(), 1);
  std::string source;  // where the block came from, when not the shapes
  const bool given = link.rule != nullptr && !link.rule->block.empty();
  if (given && link.rule->block.size() != s.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": scale rule '", link.rule->pattern, "' gives ",
                                                   link.rule->block.size(), " block sizes for ", s.size(),
                                                   " dimensions"));
  }
  std::optional<std::vector<uint64_t>> configured;
  if (given) {
    block = link.rule->block;
    source = absl::StrCat(" (scale rule '", link.rule->pattern, "')");
  } else if (const QuantScheme* scheme = checkpoint.QuantSchemeOf(*weight.source)) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(configured, ConfigBlock(*scheme, weight, w, s, what));
    if (configured) {
      block = *configured;
      source = absl::StrCat(" (", checkpoint.quantization()->source(), ": ", DescribeQuantScheme(*scheme), ")");
    }
  }
  for (size_t d = 0; d < s.size(); ++d) {
    if (!given && !configured) block[d] = InferBlock(w[d], s[d]);
    if (block[d] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": no block size gives dimension ", d,
                                                     "; name the block with a scale rule (--shard-scale)"));
    }
    if ((w[d] + block[d] - 1) / block[d] != s[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dimension ", d, " does not hold its weight's blocks of ", block[d], source));
    }
  }
  scale->scale_block = block;
  scale->scale_of = weight.spec.name;
  if (weight.slice.empty()) return absl::OkStatus();  // the whole weight: all its scales
  TensorSlice slice;
  slice.dims.resize(s.size());
  bool cut = false;
  for (size_t d = 0; d < s.size(); ++d) {
    const std::vector<IndexRange>& ranges = weight.slice.dims[d];
    if (ranges.size() == 1 && ranges[0].start == 0 && ranges[0].stop == w[d]) {
      slice.dims[d] = {IndexRange{0, s[d]}};
      continue;
    }
    cut = true;
    for (const IndexRange& r : ranges) {
      const uint64_t first = r.start / block[d], end = r.size() == 0 ? first : (r.stop + block[d] - 1) / block[d];
      if (!slice.dims[d].empty() && first < slice.dims[d].back().stop) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": a block of ", block[d], " along dimension ", d,
            " spans two pieces of the weight this rank is served (fused parts); it cannot be served once per piece"));
      }
      slice.dims[d].push_back({first, end});
      if (r.size() > 0 && (r.start % block[d] != 0 || (r.stop % block[d] != 0 && r.stop != w[d]))) {
        scale->shares_scale_blocks = true;
      }
    }
  }
  if (!cut) return absl::OkStatus();  // cut only along dimensions the scale does not have
  WEIGHTSTORE_RETURN_IF_ERROR(CheckUnitSlice(scale->source->spec.dtype, s, slice, scale->spec.name));
  scale->slice = std::move(slice);
  scale->spec.shape = scale->slice.Shape();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<bool>> OtherRanksExperts(const Selection& selection, const SelectionDeadline& deadline,
                                                    size_t count,
                                                    absl::FunctionRef<absl::string_view(size_t)> name_of) {
  const ShardSpec& shard = selection.options().shard;
  std::vector<bool> other(count, false);
  if (shard.world_size == 0 || shard.experts.empty()) return other;
  std::vector<std::optional<Selection::ExpertOf>> experts(count);
  absl::flat_hash_map<std::string, uint64_t> experts_of;  // group -> largest index + 1
  for (size_t i = 0; i < count; ++i) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(experts[i], selection.ExpertOfName(name_of(i), deadline));
    if (!experts[i]) continue;
    if (experts[i]->index == UINT64_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name_of(i), "': expert index ", UINT64_MAX, " is out of range"));
    }
    uint64_t& n = experts_of[experts[i]->group];
    n = std::max(n, experts[i]->index + 1);
  }
  for (size_t i = 0; i < count; ++i) {
    if (!experts[i]) continue;
    // Rank r of N: [r * E / N, (r + 1) * E / N), in 128-bit arithmetic.
    const unsigned __int128 e = experts_of[experts[i]->group], r = shard.rank, n = shard.world_size;
    const unsigned __int128 begin = r * e / n, end = (r + 1) * e / n, index = experts[i]->index;
    other[i] = index < begin || index >= end;
  }
  return other;
}

absl::Status ShardTensors(const Checkpoint& checkpoint, const Selection& selection, const SelectionDeadline& deadline,
                          std::vector<SnapshotTensor>* tensors) {
  std::vector<std::optional<ScaleLink>> scales(tensors->size());
  if (selection.options().shard.world_size > 0) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(scales, FindScales(selection, deadline, *tensors));
  }
  for (size_t i = 0; i < tensors->size(); ++i) {
    if (!scales[i]) WEIGHTSTORE_RETURN_IF_ERROR(SliceTensor(selection, deadline, &(*tensors)[i]));
  }
  for (size_t i = 0; i < tensors->size(); ++i) {
    if (scales[i]) {
      WEIGHTSTORE_RETURN_IF_ERROR(FollowWeight(checkpoint, (*tensors)[scales[i]->weight], *scales[i], &(*tensors)[i]));
    }
  }
  return absl::OkStatus();
}

void DescribeQuantization(const Checkpoint& checkpoint, SnapshotTensor* tensor) {
  tensor->quantization = DescribeQuantizationOf(checkpoint, *tensor->source);
}

std::string DescribeQuantizationOf(const Checkpoint& checkpoint, const CheckpointEntry& entry) {
  const QuantScheme* scheme = checkpoint.QuantSchemeOf(entry);
  if (scheme == nullptr || !HasStandardScale(checkpoint, entry.spec.name)) return "";
  return absl::StrCat(DescribeQuantScheme(*scheme), " (", checkpoint.quantization()->source(), ")");
}

}  // namespace weightstore
