#include "client/proto_convert.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"

namespace weightstore::client {

void ToProto(const Query& in, pb::Selection* out) {
  const SelectionOptions& s = in.selection;
  out->set_top_level_key(s.top_level_key);
  for (const auto& p : s.include) out->add_include(p);
  for (const auto& p : s.paths) out->add_paths(p);
  for (const auto& p : s.exclude) out->add_exclude(p);
  for (const RenameRule& r : s.renames) {
    pb::RenameRule* rule = out->add_renames();
    rule->set_pattern(r.pattern);
    rule->set_replacement(r.replacement);
  }
  if (s.contiguous_indices) out->set_contiguous_indices(*s.contiguous_indices);
  if (s.adapter != Adapter::kNone) out->set_adapter(std::string(AdapterName(s.adapter)));
  if (s.dtype) out->set_dtype(std::string(DTypeName(*s.dtype)));
  out->set_allow_partial(in.allow_partial);
  if (s.shard.world_size > 0 || !s.shard.rules.empty() || !s.shard.scales.empty() || !s.shard.experts.empty()) {
    pb::Shard* shard = out->mutable_shard();
    shard->set_rank(s.shard.rank);
    shard->set_world_size(s.shard.world_size);
    for (const ShardRule& r : s.shard.rules) {
      pb::ShardRule* rule = shard->add_rules();
      rule->set_pattern(r.pattern);
      rule->set_dim(r.split.dim);
      rule->set_parts(r.split.parts);
      rule->set_uneven(r.split.uneven);
    }
    for (const ScaleRule& r : s.shard.scales) {
      pb::ScaleRule* rule = shard->add_scales();
      rule->set_pattern(r.pattern);
      rule->set_weight(r.weight);
      for (uint64_t b : r.block) rule->add_block(b);
    }
    shard->set_no_scale_detection(!s.shard.detect_scales);
    for (const std::string& e : s.shard.experts) shard->add_experts(e);
  }
  for (const NamedSlice& slice : s.slices) {
    pb::TensorSliceSpec* spec = out->add_slices();
    spec->set_name(slice.name);
    for (const SliceBound& b : slice.bounds) {
      pb::SliceBound* bound = spec->add_dims();
      if (b.start) bound->set_start(*b.start);
      if (b.stop) bound->set_stop(*b.stop);
    }
  }
  if (in.target) {
    pb::TargetSchema* target = out->mutable_target();
    for (const TargetParameter& p : in.target->parameters) {
      pb::TargetParameter* param = target->add_parameters();
      param->set_path(p.path);
      for (uint64_t d : p.shape) param->add_shape(d);
      if (p.dtype) param->set_dtype(std::string(DTypeName(*p.dtype)));
      param->set_module(p.module);
    }
  }
}

absl::Status FromProto(const pb::TensorInfo& in, TensorDescription* out) {
  std::optional<DType> dtype = ParseDType(in.dtype());
  if (!dtype)
    return absl::InvalidArgumentError(absl::StrCat("tensor '", in.name(), "' has unknown dtype '", in.dtype(), "'"));
  out->spec.name = in.name();
  out->spec.dtype = *dtype;
  out->spec.shape.assign(in.shape().begin(), in.shape().end());
  std::optional<uint64_t> numel = CheckedNumElements(out->spec.shape);
  if (out->spec.shape.size() > kMaxRank || !numel || !DTypeBytes(*dtype, *numel)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", in.name(),
                                                   "' has a shape whose byte size overflows, is not a whole number of "
                                                   "bytes, or whose rank passes ",
                                                   kMaxRank));
  }
  if (out->spec.byte_size() != in.byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", in.name(), "' declares ", in.byte_size(),
                                                   " bytes, but its shape and dtype make ", out->spec.byte_size()));
  }
  out->source_name = in.source_name().empty() ? in.name() : in.source_name();
  if (in.has_crc32c()) out->crc32c = in.crc32c();
  if (in.has_param_id()) out->spec.param_id = in.param_id();
  out->digest = in.digest();
  out->unchanged = in.unchanged();
  out->patched = in.has_patch();
  out->scale_of = in.scale_of();
  out->shares_scale_blocks = in.shares_scale_blocks();
  out->scale_block.assign(in.scale_block().begin(), in.scale_block().end());
  out->quantization = in.quantization();
  out->unsliced_shape.clear();
  out->slice = {};
  if (in.slice_size() > 0 || in.unsliced_shape_size() > 0) {
    out->unsliced_shape.assign(in.unsliced_shape().begin(), in.unsliced_shape().end());
    for (const pb::DimRanges& dim : in.slice()) {
      std::vector<IndexRange>& ranges = out->slice.dims.emplace_back();
      for (const pb::IndexRange& r : dim.ranges()) ranges.push_back({r.start(), r.stop()});
    }
    // The slice must fit the whole tensor and give the served shape.
    absl::Status fits = out->slice.Check(out->unsliced_shape, in.name());
    if (fits.ok() && (out->slice.empty() || out->slice.Shape() != out->spec.shape)) {
      fits = absl::InvalidArgumentError(
          absl::StrCat("tensor '", in.name(), "': its slice does not give its shape ", ShapeToString(out->spec.shape)));
    }
    if (!fits.ok()) return fits;
  }
  return absl::OkStatus();
}

void FromProto(const pb::ApplyResult& in, ApplyResult* out) {
  out->applied.assign(in.applied().begin(), in.applied().end());
  out->skipped.assign(in.skipped().begin(), in.skipped().end());
  out->missing.assign(in.missing().begin(), in.missing().end());
  out->unused.assign(in.unused().begin(), in.unused().end());
  for (const auto& e : in.errors()) {
    size_t colon = e.find(": ");
    out->errors.push_back(
        {ApplyError::Kind::kShapeMismatch, e.substr(0, colon), colon == std::string::npos ? e : e.substr(colon + 2)});
  }
  out->suggestions.assign(in.suggestions().begin(), in.suggestions().end());
}

void FromProto(const pb::CheckpointInfo& in, CheckpointSummary* out) {
  out->name = in.name();
  out->format = in.format();
  out->container = in.container();
  out->path = in.path();
  out->total_bytes = in.total_bytes();
  out->tensor_count = in.tensor_count();
  out->metadata = Metadata(in.metadata().begin(), in.metadata().end());
  out->version = in.version();
  out->loaded_at_unix_seconds = in.loaded_at_unix_seconds();
  out->quantization = in.quantization();
  if (in.has_follow()) {
    const pb::FollowInfo& f = in.follow();
    out->follow = CheckpointSummary::Following{f.upstream(),    f.upstream_version(),   f.lag_versions(),
                                               f.lag_seconds(), f.upstream_connected(), f.blocked()};
  }
}

DeltaInfo FromProto(const pb::DeltaInfo& in) {
  return DeltaInfo{in.since_version(),     in.delta(),       in.full_reason(), in.changed_tensors(),
                   in.unchanged_tensors(), in.patch_reason()};
}

absl::StatusOr<ElementPatch> FromProto(const pb::TensorPatch& in, const TensorSpec& spec) {
  std::optional<PatchEncoding> encoding = ParsePatchEncoding(in.encoding());
  if (!encoding) {
    return absl::DataLossError(absl::StrCat("unknown encoding '", absl::CHexEscape(in.encoding().substr(0, 32)), "'"));
  }
  ElementPatch header;
  header.encoding = *encoding;
  header.element_size = PatchElementSize(spec.dtype);
  if (in.element_size() != header.element_size) {
    return absl::DataLossError(absl::StrCat("elements of ", in.element_size(), " bytes where ", DTypeName(spec.dtype),
                                            " has ", header.element_size));
  }
  header.elements = spec.byte_size() / header.element_size;
  header.changed = in.changed_elements();
  if (in.patch_bytes() == 0 || in.patch_bytes() >= spec.byte_size() || header.changed > header.elements) {
    return absl::DataLossError(absl::StrCat(in.patch_bytes(), " bytes for ", header.changed, " of ", header.elements,
                                            " elements (", spec.byte_size(), " bytes)"));
  }
  return header;
}

}  // namespace weightstore::client
