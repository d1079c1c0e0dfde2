#include "core/select/snapshot.h"

#include <algorithm>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/host_buffer.h"
#include "core/select/dtype_cast.h"
#include "core/status_macros.h"

namespace weightstore {

std::vector<uint64_t> SnapshotTensor::unsliced_shape() const {
  std::vector<uint64_t> shape = source->spec.shape;
  if (transpose && shape.size() == 2) std::swap(shape[0], shape[1]);
  return shape;
}

namespace {

// A sub-byte tensor (core/dtype.h) as its storage sees it: its shape and its
// slice in units of storage rather than elements (the last dimension divided
// by the elements a unit holds; a whole tensor flattened to its units).
// REQUIRES: CheckUnitSlice.
struct UnitView {
  std::vector<uint64_t> shape;
  TensorSlice slice;
};

UnitView ToUnits(DType dtype, const std::vector<uint64_t>& shape, const TensorSlice& slice) {
  const uint64_t per_unit = DTypeUnitElements(dtype);
  UnitView view;
  if (slice.empty()) {
    uint64_t elements = 1;
    for (uint64_t d : shape) elements *= d;
    view.shape = {elements / per_unit};
    return view;
  }
  view.shape = shape;
  view.shape.back() /= per_unit;
  view.slice = slice;
  for (IndexRange& r : view.slice.dims.back()) {
    r.start /= per_unit;
    r.stop /= per_unit;
  }
  return view;
}

}  // namespace

absl::Status CheckUnitSlice(DType dtype, std::span<const uint64_t> shape, const TensorSlice& slice,
                            absl::string_view name) {
  const uint64_t per_unit = DTypeUnitElements(dtype);
  if (per_unit == 1 || slice.empty()) return absl::OkStatus();
  const std::string what = absl::StrCat("tensor '", name, "' (", DTypeName(dtype), " ", ShapeToString(shape), ")");
  if (shape.empty() || shape.back() % per_unit != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": its rows are not whole bytes (", DTypeName(dtype),
                                                   " packs ", per_unit, " elements in ", DTypeSize(dtype),
                                                   " bytes), so it is served whole only"));
  }
  for (const IndexRange& r : slice.dims.back()) {
    if (r.start % per_unit != 0 || r.stop % per_unit != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the slice [", r.start, ":", r.stop, "] of its last dimension would split a byte (", DTypeName(dtype),
          " packs ", per_unit, " elements in ", DTypeSize(dtype), " bytes); cut at multiples of ", per_unit));
    }
  }
  return absl::OkStatus();
}

uint64_t ServedUnitBytes(const SnapshotTensor& tensor) {
  const DType from = tensor.source->spec.dtype, to = tensor.spec.dtype;
  if (from == to) return DTypeSize(to);
  return DTypeUnitElements(from) * DTypeSize(to);  // a cast's target is never sub-byte
}

std::optional<uint64_t> SnapshotTensor::ByteRangeStart() const {
  if (transpose || spec.dtype != source->spec.dtype || !Checkpoint::IsZeroCopy(*source)) return std::nullopt;
  if (IsSubByte(spec.dtype)) {
    const UnitView units = ToUnits(spec.dtype, source->spec.shape, slice);
    std::optional<uint64_t> first = units.slice.ContiguousStart(units.shape);
    if (!first) return std::nullopt;
    return *first * DTypeSize(spec.dtype);
  }
  std::optional<uint64_t> first = slice.ContiguousStart(source->spec.shape);
  if (!first) return std::nullopt;
  return *first * DTypeSize(spec.dtype);
}

absl::Status SliceTensor(const Selection& selection, const SelectionDeadline& deadline, SnapshotTensor* tensor) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(tensor->slice, selection.SliceOf(tensor->spec.name, tensor->spec.shape, &deadline));
  WEIGHTSTORE_RETURN_IF_ERROR(
      CheckUnitSlice(tensor->source->spec.dtype, tensor->unsliced_shape(), tensor->slice, tensor->spec.name));
  if (!tensor->slice.empty()) tensor->spec.shape = tensor->slice.Shape();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedEntry>> ResolveNames(const Checkpoint& checkpoint, const Selection& selection,
                                                     bool applying_to_target, const SelectionDeadline& deadline) {
  const std::vector<CheckpointEntry>& entries = checkpoint.entries();
  const std::string& key = selection.options().top_level_key;
  std::vector<NamedEntry> named;
  named.reserve(entries.size());
  uint64_t name_bytes = 0;
  auto add = [&](absl::string_view name, size_t i) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::string renamed, selection.Rename(name, &deadline));
    name_bytes += renamed.size();
    if (name_bytes > selection.limits().max_total_name_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("the selected names of '", checkpoint.path(), "' exceed ",
                                                     selection.limits().max_total_name_bytes,
                                                     " bytes together after renaming"));
    }
    named.push_back({std::move(renamed), i});
    return absl::OkStatus();
  };
  if (key.empty()) {
    for (size_t i = 0; i < entries.size(); ++i) WEIGHTSTORE_RETURN_IF_ERROR(add(entries[i].spec.name, i));
  } else {
    const std::string prefix = absl::StrCat(key, ".");
    std::set<std::string> keys;
    for (size_t i = 0; i < entries.size(); ++i) {
      absl::string_view name = entries[i].spec.name;
      if (absl::ConsumePrefix(&name, prefix)) {
        WEIGHTSTORE_RETURN_IF_ERROR(add(name, i));
      } else if (size_t dot = name.find('.'); dot != absl::string_view::npos && keys.size() < 32) {
        keys.insert(std::string(name.substr(0, dot)));
      }
    }
    if (named.empty()) {
      return absl::NotFoundError(
          absl::StrCat("'", checkpoint.path(), "' has no tensors under top-level key '", key, "'; keys with tensors: ",
                       keys.empty() ? "(none)" : absl::StrJoin(keys, ", "), keys.size() >= 32 ? ", ..." : ""));
    }
  }
  if (selection.UsesContiguousIndices(checkpoint.format(), applying_to_target)) {
    std::vector<std::string> names;
    names.reserve(named.size());
    for (const NamedEntry& n : named) names.push_back(n.name);
    names = MapIndicesContiguous(names);
    for (size_t i = 0; i < named.size(); ++i) named[i].name = std::move(names[i]);
  }
  absl::flat_hash_map<absl::string_view, size_t> first;  // name -> entry index
  first.reserve(named.size());
  for (const NamedEntry& n : named) {
    auto [it, inserted] = first.emplace(n.name, n.entry);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("tensors '", entries[it->second].spec.name, "' and '",
                                                     entries[n.entry].spec.name, "' of '", checkpoint.path(),
                                                     "' are both renamed to '", n.name, "'"));
    }
  }
  return named;
}

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
absl::Status FollowWeight(const SnapshotTensor& weight, const ScaleLink& link, const QuantizationConfig* config,
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
  } else if (const QuantScheme* scheme = config == nullptr ? nullptr : config->SchemeOf(weight.source->spec.name)) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(configured, ConfigBlock(*scheme, weight, w, s, what));
    if (configured) {
      block = *configured;
      source = absl::StrCat(" (", config->source(), ": ", DescribeQuantScheme(*scheme), ")");
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

// Expert parallelism (ShardSpec::experts): drops the experts of other ranks.
absl::Status KeepTheRanksExperts(const Selection& selection, const SelectionDeadline& deadline,
                                 std::vector<SnapshotTensor>* tensors) {
  const ShardSpec& shard = selection.options().shard;
  std::vector<std::optional<Selection::ExpertOf>> experts(tensors->size());
  absl::flat_hash_map<std::string, uint64_t> count;  // group -> largest index + 1
  for (size_t i = 0; i < tensors->size(); ++i) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(experts[i], selection.ExpertOfName((*tensors)[i].spec.name, deadline));
    if (!experts[i]) continue;
    if (experts[i]->index == UINT64_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", (*tensors)[i].spec.name, "': expert index ", UINT64_MAX, " is out of range"));
    }
    uint64_t& n = count[experts[i]->group];
    n = std::max(n, experts[i]->index + 1);
  }
  std::vector<SnapshotTensor> kept;
  kept.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    if (experts[i]) {
      // Rank r of N: [r * E / N, (r + 1) * E / N), in 128-bit arithmetic.
      const unsigned __int128 e = count[experts[i]->group], r = shard.rank, n = shard.world_size;
      const unsigned __int128 begin = r * e / n, end = (r + 1) * e / n, index = experts[i]->index;
      if (index < begin || index >= end) continue;
    }
    kept.push_back(std::move((*tensors)[i]));
  }
  *tensors = std::move(kept);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Snapshot>> Snapshot::Select(std::shared_ptr<const Checkpoint> checkpoint,
                                                                 const Selection& selection) {
  const SelectionDeadline deadline(selection.limits());
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<NamedEntry> named,
                               ResolveNames(*checkpoint, selection, /*applying_to_target=*/false, deadline));
  std::vector<SnapshotTensor> tensors;
  tensors.reserve(named.size());
  for (NamedEntry& n : named) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(bool kept, selection.Matches(n.name, deadline));
    if (!kept) continue;
    SnapshotTensor t;
    t.source = &checkpoint->entries()[n.entry];
    t.spec = t.source->spec;
    t.spec.name = std::move(n.name);
    if (selection.options().dtype && IsFloatingPoint(t.spec.dtype)) {
      WEIGHTSTORE_RETURN_IF_ERROR(CheckCast(t.spec.dtype, *selection.options().dtype));
      t.spec.dtype = *selection.options().dtype;
    }
    if (const QuantizationConfig* config = checkpoint->quantization();
        config != nullptr && HasStandardScale(*checkpoint, t.source->spec.name)) {
      if (const QuantScheme* scheme = config->SchemeOf(t.source->spec.name)) {
        t.quantization = absl::StrCat(DescribeQuantScheme(*scheme), " (", config->source(), ")");
      }
    }
    tensors.push_back(std::move(t));
  }
  const ShardSpec& shard = selection.options().shard;
  if (shard.world_size > 0 && !shard.experts.empty()) {
    WEIGHTSTORE_RETURN_IF_ERROR(KeepTheRanksExperts(selection, deadline, &tensors));
  }
  std::vector<std::optional<ScaleLink>> scales(tensors.size());
  if (shard.world_size > 0) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(scales, FindScales(selection, deadline, tensors));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!scales[i]) WEIGHTSTORE_RETURN_IF_ERROR(SliceTensor(selection, deadline, &tensors[i]));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (scales[i]) {
      WEIGHTSTORE_RETURN_IF_ERROR(
          FollowWeight(tensors[scales[i]->weight], *scales[i], checkpoint->quantization(), &tensors[i]));
    }
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Snapshot> snapshot,
                               Create(std::move(checkpoint), std::move(tensors)));
  WEIGHTSTORE_RETURN_IF_ERROR(
      selection.CheckSlicesUsed([&](absl::string_view name) { return snapshot->Find(name) != nullptr; }));
  return snapshot;
}

absl::StatusOr<std::shared_ptr<const Snapshot>> Snapshot::Create(std::shared_ptr<const Checkpoint> checkpoint,
                                                                 std::vector<SnapshotTensor> tensors) {
  std::shared_ptr<Snapshot> snapshot(new Snapshot());
  snapshot->tensors_ = std::move(tensors);  // by_name_ views point into these names
  snapshot->by_name_.reserve(snapshot->tensors_.size());
  for (size_t i = 0; i < snapshot->tensors_.size(); ++i) {
    const SnapshotTensor& t = snapshot->tensors_[i];
    if (t.transpose && t.source->spec.shape.size() != 2) {
      return absl::InternalError(absl::StrCat("tensor '", t.spec.name, "': transpose needs a rank-2 source"));
    }
    if (t.transpose && IsSubByte(t.source->spec.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.spec.name, "': its ",
                                                     DTypeName(t.source->spec.dtype),
                                                     " elements are packed and cannot be transposed"));
    }
    const std::vector<uint64_t> unsliced = t.unsliced_shape();
    WEIGHTSTORE_RETURN_IF_ERROR(t.slice.Check(unsliced, t.spec.name));
    WEIGHTSTORE_RETURN_IF_ERROR(CheckUnitSlice(t.source->spec.dtype, unsliced, t.slice, t.spec.name));
    if (t.spec.shape != (t.slice.empty() ? unsliced : t.slice.Shape())) {
      return absl::InternalError(absl::StrCat("tensor '", t.spec.name, "': served shape ", ShapeToString(t.spec.shape),
                                              " is not that of its source and slice"));
    }
    WEIGHTSTORE_RETURN_IF_ERROR(CheckCast(t.source->spec.dtype, t.spec.dtype));
    if (!snapshot->by_name_.emplace(t.spec.name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat("two tensors are served as '", t.spec.name, "'"));
    }
  }
  snapshot->checkpoint_ = std::move(checkpoint);
  return std::shared_ptr<const Snapshot>(std::move(snapshot));
}

uint64_t Snapshot::total_bytes() const {
  uint64_t total = 0;
  for (const SnapshotTensor& t : tensors_) total += t.spec.byte_size();
  return total;
}

const SnapshotTensor* Snapshot::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<SharedTensor> Snapshot::Read(absl::string_view name) const {
  const SnapshotTensor* t = Find(name);
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tensor '", name, "' not in this selection of '", checkpoint_->path(), "'"));
  }
  return Read(*t);
}

absl::StatusOr<SharedTensor> Snapshot::Read(const SnapshotTensor& tensor) const {
  std::optional<uint64_t> start;
  if (tensor.is_identity() || (start = tensor.ByteRangeStart())) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, checkpoint_->Read(*tensor.source));
    t.spec = tensor.spec;
    if (start) t.bytes = t.bytes.Subspan(*start, tensor.spec.byte_size());
    return t;
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(tensor.spec.byte_size()));
  WEIGHTSTORE_RETURN_IF_ERROR(ReadInto(tensor, buffer.span()));
  return SharedTensor{tensor.spec, std::move(buffer).Freeze()};
}

absl::Status Snapshot::ReadInto(const SnapshotTensor& tensor, std::span<std::byte> out) const {
  if (tensor.is_identity()) return checkpoint_->ReadInto(*tensor.source, out);
  WEIGHTSTORE_RETURN_IF_ERROR(CheckDestination(tensor.spec, out.size()));
  if (!tensor.slice.empty()) return ReadRange(tensor, 0, out);
  // Source bytes (a view when contiguous), then one pass of transpose and cast.
  WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor source, checkpoint_->Read(*tensor.source));
  const DType from = tensor.source->spec.dtype, to = tensor.spec.dtype;
  if (tensor.transpose) {
    TransposeCast(from, source.bytes.data(), to, out.data(), tensor.source->spec.shape[0],
                  tensor.source->spec.shape[1]);
  } else {
    CastElements(from, source.bytes.data(), to, out.data(), tensor.source->spec.num_elements());
  }
  return absl::OkStatus();
}

namespace {

// One served dimension as the odometer walks it: served index i lies in range
// k (served_start[k] <= i < served_start[k + 1]) and reads source index
// source_start[k] + (i - served_start[k]), `stride` elements apart.
struct DimWalk {
  uint64_t size = 0;
  uint64_t stride = 0;
  std::vector<uint64_t> served_start, source_start;

  size_t RangeOf(uint64_t i) const {
    return static_cast<size_t>(std::upper_bound(served_start.begin(), served_start.end(), i) - served_start.begin()) -
           1;
  }
  uint64_t RangeEnd(size_t k) const { return k + 1 < served_start.size() ? served_start[k + 1] : size; }
};

}  // namespace

absl::Status Snapshot::ReadRange(const SnapshotTensor& tensor, uint64_t offset, std::span<std::byte> out) const {
  const CheckpointEntry& source = *tensor.source;
  // Sizes in units of storage (core/dtype.h): one element but for sub-byte
  // sources, whose shape and slice are then counted in units too.
  const uint64_t out_size = ServedUnitBytes(tensor), in_size = DTypeSize(source.spec.dtype);
  const uint64_t per_unit = DTypeUnitElements(source.spec.dtype);
  UnitView units;
  const std::vector<uint64_t>* source_shape = &source.spec.shape;
  const TensorSlice* slice = &tensor.slice;
  if (per_unit > 1) {
    units = ToUnits(source.spec.dtype, source.spec.shape, tensor.slice);
    source_shape = &units.shape;
    slice = &units.slice;
  }
  const uint64_t total = tensor.spec.byte_size();
  if (offset > total || out.size() > total - offset || offset % out_size != 0 || out.size() % out_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", offset, ", +", out.size(), ") are not a range of ",
                                                   DTypeName(tensor.spec.dtype), " elements of tensor '",
                                                   tensor.spec.name, "' (", total, " bytes)"));
  }
  if (out.empty()) return absl::OkStatus();
  absl::StatusOr<SharedBytes> storage = source.layout.storage->Get();
  if (!storage.ok()) {
    return absl::Status(storage.status().code(),
                        absl::StrCat("tensor '", source.spec.name, "': ", storage.status().message()));
  }
  const std::byte* base = storage->data() + source.layout.offset;
  // A transposed tensor is 2-D, so its slice (if any) has two dimensions.
  if (tensor.transpose && source.layout.strides.empty() &&
      (tensor.slice.empty() || (tensor.slice.dims[0].size() == 1 && tensor.slice.dims[1].size() == 1))) {
    // Whole rows of the served [c, r] matrix (of the block a slice keeps:
    // source rows [r0, r1), columns [c0, c1)): produced by tiles, as reads a
    // column at a time would touch a cache line per element.
    const uint64_t cols = source.spec.shape[1];
    const IndexRange c = tensor.slice.empty() ? IndexRange{0, cols} : tensor.slice.dims[0][0];
    const IndexRange r = tensor.slice.empty() ? IndexRange{0, source.spec.shape[0]} : tensor.slice.dims[1][0];
    const uint64_t rows = r.size(), row_bytes = rows * out_size;
    if (row_bytes > 0 && offset % row_bytes == 0 && out.size() % row_bytes == 0) {
      TransposeCastRows(source.spec.dtype, base + r.start * cols * in_size, tensor.spec.dtype, out.data(), rows, cols,
                        c.start + offset / row_bytes, c.start + (offset + out.size()) / row_bytes, cols);
      if (source.layout.normalize_bool && tensor.spec.dtype == DType::kBool) {
        for (std::byte& b : out) b = std::byte{b != std::byte{0}};
      }
      return absl::OkStatus();
    }
  }
  // The served tensor as a strided view of the source elements: the source's
  // own strides (row-major when it has none), swapped for a transpose, walked
  // through the slice's ranges.
  std::vector<uint64_t> shape = *source_shape, strides = source.layout.strides;
  if (strides.empty()) {
    strides.assign(shape.size(), 1);
    for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  }
  if (tensor.transpose) {
    std::swap(shape[0], shape[1]);
    std::swap(strides[0], strides[1]);
  }
  std::vector<DimWalk> dims(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    DimWalk& w = dims[d];
    w.stride = strides[d];
    if (slice->empty()) {
      w.size = shape[d];
      w.served_start = {0};
      w.source_start = {0};
      continue;
    }
    for (const IndexRange& r : slice->dims[d]) {
      if (r.size() == 0) continue;  // serves nothing (a non-empty `out` means every dimension has some)
      w.served_start.push_back(w.size);
      w.source_start.push_back(r.start);
      w.size += r.size();
    }
  }
  if (source.layout.strides.empty() && !tensor.transpose) {
    if (std::optional<uint64_t> start = slice->ContiguousStart(*source_shape)) {
      // The served elements are consecutive in the source: one run, so a cast
      // streams through CastElements' fast loops instead of row by row.
      base += *start * in_size;
      dims = {DimWalk{tensor.spec.num_elements() / per_unit, 1, {0}, {0}}};
    }
  }
  uint64_t first = offset / out_size, count = out.size() / out_size;
  std::byte* dst = out.data();
  if (dims.empty()) {  // a scalar
    CastElements(source.spec.dtype, base, tensor.spec.dtype, dst, 1);
  } else {
    // The odometer starts at element `first`; each step covers a run of the
    // innermost dimension within one of its ranges.
    const size_t rank = dims.size();
    std::vector<uint64_t> index(rank);
    for (size_t d = rank, rest = first; d-- > 0;) {
      index[d] = rest % dims[d].size;
      rest /= dims[d].size;
    }
    while (count > 0) {
      uint64_t at = 0;
      size_t k = 0;
      for (size_t d = 0; d < rank; ++d) {
        k = dims[d].RangeOf(index[d]);
        at += (dims[d].source_start[k] + index[d] - dims[d].served_start[k]) * dims[d].stride;
      }
      const DimWalk& inner = dims[rank - 1];
      const uint64_t run = std::min(count, inner.RangeEnd(k) - index[rank - 1]);
      if (per_unit == 1) {
        CastStrided(source.spec.dtype, base + at * in_size, inner.stride, tensor.spec.dtype, dst, run);
      } else {  // packed: a unit's elements are consecutive, and so are the units of a run
        CastElements(source.spec.dtype, base + at * in_size, tensor.spec.dtype, dst, run * per_unit);
      }
      dst += run * out_size;
      count -= run;
      index[rank - 1] += run;
      for (size_t d = rank - 1; d > 0 && index[d] == dims[d].size; --d) {
        index[d] = 0;
        ++index[d - 1];
      }
    }
  }
  if (source.layout.normalize_bool && tensor.spec.dtype == DType::kBool) {
    for (std::byte& b : out) b = std::byte{b != std::byte{0}};
  }
  return absl::OkStatus();
}

absl::Status WriteSnapshot(const Snapshot& snapshot, const std::string& path, const FormatSpec& format,
                           const Metadata& metadata, const WriteOptions& options) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                               CheckpointWriter::Create(path, format, options));
  writer->SetMetadata(metadata);
  for (const SnapshotTensor& tensor : snapshot.tensors()) {
    WEIGHTSTORE_RETURN_IF_ERROR(writer->Add(tensor.spec, [&snapshot, &tensor]() -> absl::StatusOr<SharedBytes> {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, snapshot.Read(tensor));
      return t.bytes;
    }));
  }
  return writer->Finish();
}

}  // namespace weightstore
