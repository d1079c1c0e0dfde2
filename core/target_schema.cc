#include "core/target_schema.h"

#include <memory>
#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/mapped_file.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore {
namespace {
constexpr uint64_t kMaxFileBytes = uint64_t{64} << 20;
}  // namespace

absl::StatusOr<TargetSchema> TargetSchema::FromJson(absl::string_view json, absl::string_view source) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("target schema '", source, "': ", what));
  };
  nlohmann::json doc = nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return bad("invalid JSON");
  if (!doc.is_object() || !doc.contains("parameters") || !doc["parameters"].is_array()) {
    return bad("needs a \"parameters\" array");
  }
  TargetSchema schema;
  absl::flat_hash_set<std::string> seen;
  for (size_t i = 0; i < doc["parameters"].size(); ++i) {
    const nlohmann::json& p = doc["parameters"][i];
    const std::string where = absl::StrCat("parameters[", i, "]");
    if (!p.is_object()) return bad(absl::StrCat(where, " is not an object"));
    TargetParameter param;
    if (!p.contains("path") || !p["path"].is_string() || p["path"].get<std::string>().empty()) {
      return bad(absl::StrCat(where, ".path must be a non-empty string"));
    }
    param.path = p["path"].get<std::string>();
    if (!seen.insert(param.path).second) {
      return bad(absl::StrCat(where, ".path '", ShortForError(param.path), "' appears twice"));
    }
    if (!p.contains("shape") || !p["shape"].is_array()) return bad(absl::StrCat(where, ".shape must be an array"));
    for (const auto& d : p["shape"]) {
      if (!d.is_number_unsigned()) return bad(absl::StrCat(where, ".shape must hold non-negative integers"));
      param.shape.push_back(d.get<uint64_t>());
    }
    if (p.contains("dtype")) {
      std::optional<DType> dtype = p["dtype"].is_string() ? ParseDType(p["dtype"].get<std::string>()) : std::nullopt;
      if (!dtype) return bad(absl::StrCat(where, ".dtype is not a dtype name (F32, BF16, I64, ...)"));
      param.dtype = dtype;
    }
    if (p.contains("module")) {
      if (!p["module"].is_string()) return bad(absl::StrCat(where, ".module must be a string"));
      param.module = std::string(absl::StripPrefix(p["module"].get<std::string>(), "Struct:"));
    }
    schema.parameters.push_back(std::move(param));
  }
  return schema;
}

absl::StatusOr<TargetSchema> TargetSchema::Load(const std::string& path) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file, MappedFile::Open(path));
  if (file->size() > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("target schema '", path, "' is larger than 64 MiB"));
  }
  return FromJson(file->bytes().view(), path);
}

}  // namespace weightstore
