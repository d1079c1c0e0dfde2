#include "server/proto_convert.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace weightstore {

absl::Status FromProto(const pb::Selection& in, const SelectionLimits& limits, SelectionRequest* out) {
  // Counts first: a request's message is bounded, but its repeated fields
  // would be copied before Selection::Compile sees them.
  const size_t patterns =
      static_cast<size_t>(in.include_size()) + in.exclude_size() + in.renames_size() + in.shard().rules_size();
  if (patterns > limits.max_patterns) {
    return absl::InvalidArgumentError(
        absl::StrCat("the selection has ", patterns, " patterns; at most ", limits.max_patterns, " are allowed"));
  }
  if (static_cast<size_t>(in.paths_size()) > limits.max_paths ||
      static_cast<size_t>(in.slices_size()) > limits.max_paths) {
    return absl::InvalidArgumentError(absl::StrCat("the selection has ", in.paths_size(), " exact paths and ",
                                                   in.slices_size(), " slices; at most ", limits.max_paths,
                                                   " of each are allowed"));
  }
  for (const pb::TensorSliceSpec& slice : in.slices()) {
    if (static_cast<size_t>(slice.dims_size()) > kMaxRank) {
      return absl::InvalidArgumentError(absl::StrCat("selection.slices: the slice of '", slice.name().substr(0, 256),
                                                     "' has ", slice.dims_size(), " dimensions; at most ", kMaxRank,
                                                     " are allowed"));
    }
  }
  SelectionOptions& o = out->options;
  o.top_level_key = in.top_level_key();
  o.include.assign(in.include().begin(), in.include().end());
  o.paths.assign(in.paths().begin(), in.paths().end());
  o.exclude.assign(in.exclude().begin(), in.exclude().end());
  for (const pb::RenameRule& r : in.renames()) o.renames.push_back({r.pattern(), r.replacement()});
  if (in.has_contiguous_indices()) o.contiguous_indices = in.contiguous_indices();
  if (!in.adapter().empty()) {
    std::optional<Adapter> adapter = ParseAdapter(in.adapter());
    if (!adapter) return absl::InvalidArgumentError(absl::StrCat("selection.adapter '", in.adapter(), "' is unknown"));
    o.adapter = *adapter;
  }
  if (!in.dtype().empty()) {
    std::optional<DType> dtype = ParseDType(absl::AsciiStrToUpper(in.dtype()));
    if (!dtype) return absl::InvalidArgumentError(absl::StrCat("selection.dtype '", in.dtype(), "' is unknown"));
    o.dtype = dtype;
  }
  o.shard.rank = in.shard().rank();
  o.shard.world_size = in.shard().world_size();
  for (const pb::ShardRule& r : in.shard().rules()) {
    o.shard.rules.push_back({r.pattern(), ShardSplit{r.dim(), std::max<uint32_t>(r.parts(), 1), r.uneven()}});
  }
  for (const pb::ScaleRule& r : in.shard().scales()) {
    o.shard.scales.push_back({r.pattern(), r.weight(), std::vector<uint64_t>(r.block().begin(), r.block().end())});
  }
  o.shard.detect_scales = !in.shard().no_scale_detection();
  o.shard.experts.assign(in.shard().experts().begin(), in.shard().experts().end());
  for (const pb::TensorSliceSpec& slice : in.slices()) {
    NamedSlice& named = o.slices.emplace_back();
    named.name = slice.name();
    for (const pb::SliceBound& b : slice.dims()) {
      SliceBound& bound = named.bounds.emplace_back();
      if (b.has_start()) bound.start = b.start();
      if (b.has_stop()) bound.stop = b.stop();
    }
  }
  out->allow_partial = in.allow_partial();
  if (in.has_target()) {
    TargetSchema schema;
    for (int i = 0; i < in.target().parameters_size(); ++i) {
      const pb::TargetParameter& p = in.target().parameters(i);
      TargetParameter param;
      param.path = p.path();
      if (param.path.empty())
        return absl::InvalidArgumentError(absl::StrCat("selection.target.parameters[", i, "].path is empty"));
      param.shape.assign(p.shape().begin(), p.shape().end());
      if (!p.dtype().empty()) {
        param.dtype = ParseDType(p.dtype());
        if (!param.dtype) {
          return absl::InvalidArgumentError(
              absl::StrCat("selection.target.parameters[", i, "].dtype '", p.dtype(), "' is unknown"));
        }
      }
      param.module = p.module();
      schema.parameters.push_back(std::move(param));
    }
    out->target = std::move(schema);
  }
  if (o.adapter != Adapter::kNone && !out->target) {
    return absl::InvalidArgumentError("selection.adapter needs selection.target");
  }
  return absl::OkStatus();
}

void ToProto(const SnapshotTensor& tensor, pb::TensorInfo* out) {
  const TensorSpec& spec = tensor.spec;
  out->set_name(spec.name);
  out->set_dtype(std::string(DTypeName(spec.dtype)));
  for (uint64_t d : spec.shape) out->add_shape(d);
  out->set_byte_size(spec.byte_size());
  if (tensor.source->spec.name != spec.name) out->set_source_name(tensor.source->spec.name);
  if (spec.param_id) out->set_param_id(*spec.param_id);
  if (!tensor.scale_of.empty()) out->set_scale_of(tensor.scale_of);
  out->set_shares_scale_blocks(tensor.shares_scale_blocks);
  for (uint64_t b : tensor.scale_block) out->add_scale_block(b);
  if (!tensor.quantization.empty()) out->set_quantization(tensor.quantization);
  if (tensor.slice.empty()) return;
  for (uint64_t d : tensor.unsliced_shape()) out->add_unsliced_shape(d);
  for (const std::vector<IndexRange>& ranges : tensor.slice.dims) {
    pb::DimRanges* dim = out->add_slice();
    for (const IndexRange& r : ranges) {
      pb::IndexRange* range = dim->add_ranges();
      range->set_start(r.start);
      range->set_stop(r.stop);
    }
  }
}

void ToProto(const ApplyResult& in, pb::ApplyResult* out) {
  for (const auto& s : in.applied) out->add_applied(s);
  for (const auto& s : in.skipped) out->add_skipped(s);
  for (const auto& s : in.missing) out->add_missing(s);
  for (const auto& s : in.unused) out->add_unused(s);
  for (const ApplyError& e : in.errors) out->add_errors(absl::StrCat(e.path, ": ", e.message));
  for (const auto& s : in.suggestions) out->add_suggestions(s);
}

void ToProto(const ElementPatch& patch, pb::TensorPatch* out) {
  out->set_encoding(std::string(PatchEncodingName(patch.encoding)));
  out->set_element_size(patch.element_size);
  out->set_changed_elements(patch.changed);
  out->set_patch_bytes(patch.body.size());
}

absl::StatusOr<PushedTensor> FromProto(const pb::PushTensor& in, absl::string_view checkpoint) {
  // Names come from the client: bounded in messages.
  const std::string tensor = absl::StrCat("push to '", checkpoint, "': tensor '", in.name().substr(0, 256), "'");
  std::optional<DType> dtype = ParseDType(in.dtype());
  if (!dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor, " has unknown dtype '", absl::CHexEscape(in.dtype().substr(0, 32)), "'"));
  }
  if (in.shape_size() > static_cast<int>(kMaxRank)) {
    return absl::InvalidArgumentError(absl::StrCat(tensor, " has rank ", in.shape_size(), ", more than ", kMaxRank));
  }
  PushedTensor out;
  out.spec = TensorSpec{in.name(), *dtype, {in.shape().begin(), in.shape().end()}};
  out.crc32c = in.crc32c();
  if (!in.has_patch()) return out;
  const std::string where =
      absl::StrCat("push to '", checkpoint, "': the patch of tensor '", in.name().substr(0, 256), "'");
  std::optional<PatchEncoding> encoding = ParsePatchEncoding(in.patch().encoding());
  if (!encoding) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has unknown encoding '",
                                                   absl::CHexEscape(in.patch().encoding().substr(0, 32)),
                                                   "' (\"positions\" or \"runs\")"));
  }
  std::optional<TensorDigest> base = TensorDigest::FromHex(in.base_digest());
  std::optional<TensorDigest> digest = TensorDigest::FromHex(in.digest());
  if (!base || !digest) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " needs base_digest and digest, each 32 lowercase hex digits"));
  }
  const uint32_t element_size = in.patch().element_size();
  out.patch = ElementPatch{*encoding,
                           element_size,
                           element_size == 0 ? 0 : out.spec.byte_size() / element_size,
                           in.patch().changed_elements(),
                           {}};
  out.patch_bytes = in.patch().patch_bytes();
  out.base_digest = *base;
  out.digest = *digest;
  return out;
}

void ToProto(const CheckpointVersion& version, pb::CheckpointInfo* out) {
  const Checkpoint& c = *version.checkpoint();
  out->set_name(version.name());
  out->set_format(std::string(c.format().name));
  out->set_container(c.detail());
  out->set_path(version.relative_path());
  out->set_total_bytes(c.total_bytes());
  out->set_tensor_count(c.size());
  for (const auto& [k, v] : c.metadata()) (*out->mutable_metadata())[k] = v;
  out->set_version(version.version());
  out->set_loaded_at_unix_seconds(version.loaded_at_unix_seconds());
  if (c.quantization() != nullptr) out->set_quantization(c.quantization()->Describe());
}

void AddFollowing(const PullStats& following, pb::CheckpointInfo* out) {
  if (!following.follow.following) return;
  // Sorted by name: one lookup, so listing n checkpoints is not n x followed.
  const auto& all = following.follow.checkpoints;
  const auto it = std::lower_bound(all.begin(), all.end(), out->name(),
                                   [](const FollowedStats& c, const std::string& name) { return c.name < name; });
  if (it != all.end() && it->name == out->name()) {
    const FollowedStats& c = *it;
    pb::FollowInfo* f = out->mutable_follow();
    f->set_upstream(following.origin);
    f->set_upstream_version(c.lag_versions > 0 && !c.newest.empty() ? c.newest : out->version());
    f->set_lag_versions(c.lag_versions);
    f->set_lag_seconds(c.lag_seconds);
    f->set_upstream_connected(following.follow.upstream_connected);
    f->set_blocked(c.blocked_reason.substr(0, 1024));
  }
}

}  // namespace weightstore
