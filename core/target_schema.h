// TargetSchema: the description of a model's parameters, in its declaration
// order: the JSON {"parameters": [{"path", "shape", "dtype"?, "module"?}]}
// that Apply loads into (core/select/apply.h) and that a Burn bincode record
// is read with (Burn's record format, in core/formats/). Parsed once, here,
// for both.
#ifndef WEIGHTSTORE_CORE_TARGET_SCHEMA_H_
#define WEIGHTSTORE_CORE_TARGET_SCHEMA_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"

namespace weightstore {

struct TargetParameter {
  std::string path;
  std::optional<DType> dtype;  // absent: any dtype is accepted
  std::vector<uint64_t> shape;
  std::string module;  // "Linear", "BatchNorm", ... ("Struct:" prefix allowed)
};

struct TargetSchema {
  std::vector<TargetParameter> parameters;

  // Parses {"parameters": [{"path", "shape", "dtype"?, "module"?}, ...]}.
  // Returns InvalidArgument naming the field (and `source`) on bad input:
  // invalid JSON, a path that is empty or given twice, a shape that is not
  // non-negative integers. Long paths are quoted short (ShortForError).
  static absl::StatusOr<TargetSchema> FromJson(absl::string_view json, absl::string_view source);
  // Reads `path` (at most 64 MiB) and parses it.
  static absl::StatusOr<TargetSchema> Load(const std::string& path);
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_TARGET_SCHEMA_H_
