// The server's conversions between wire messages and core's types (STYLE.md §4):
// requests in, results out. client/proto_convert.h holds the other direction.
#ifndef WEIGHTSTORE_SERVER_PROTO_CONVERT_H_
#define WEIGHTSTORE_SERVER_PROTO_CONVERT_H_

#include <optional>

#include "absl/status/status.h"
#include "core/select/apply.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"
#include "weightstore/v1/weight_store.pb.h"

namespace weightstore {

namespace pb = ::weightstore::v1;

// A selection and, when the request carries one, its target.
struct SelectionRequest {
  SelectionOptions options;
  std::optional<TargetSchema> target;
  bool allow_partial = false;
};

// Returns InvalidArgument naming the field for an unknown adapter or dtype.
absl::Status FromProto(const pb::Selection& in, SelectionRequest* out);
void ToProto(const TensorSpec& spec, const std::string& source_name, pb::TensorInfo* out);
void ToProto(const ApplyResult& in, pb::ApplyResult* out);

}  // namespace weightstore

#endif  // WEIGHTSTORE_SERVER_PROTO_CONVERT_H_
