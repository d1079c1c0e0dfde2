#include "server/proto_convert.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace weightstore {

absl::Status FromProto(const pb::Selection& in, SelectionRequest* out) {
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

void ToProto(const TensorSpec& spec, const std::string& source_name, pb::TensorInfo* out) {
  out->set_name(spec.name);
  out->set_dtype(std::string(DTypeName(spec.dtype)));
  for (uint64_t d : spec.shape) out->add_shape(d);
  out->set_byte_size(spec.byte_size());
  if (source_name != spec.name) out->set_source_name(source_name);
  if (spec.param_id) out->set_param_id(*spec.param_id);
}

void ToProto(const ApplyResult& in, pb::ApplyResult* out) {
  for (const auto& s : in.applied) out->add_applied(s);
  for (const auto& s : in.skipped) out->add_skipped(s);
  for (const auto& s : in.missing) out->add_missing(s);
  for (const auto& s : in.unused) out->add_unused(s);
  for (const ApplyError& e : in.errors) out->add_errors(absl::StrCat(e.path, ": ", e.message));
  for (const auto& s : in.suggestions) out->add_suggestions(s);
}

}  // namespace weightstore
