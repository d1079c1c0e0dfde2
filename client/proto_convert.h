// The client's conversions between wire messages and its types: requests out,
// results in. server/proto_convert.h holds the other direction.
#ifndef WEIGHTSTORE_CLIENT_PROTO_CONVERT_H_
#define WEIGHTSTORE_CLIENT_PROTO_CONVERT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/store.h"
#include "core/element_patch.h"
#include "weightstore/v1/weight_store.pb.h"

namespace weightstore::client {

namespace pb = ::weightstore::v1;

void ToProto(const Query& in, pb::Selection* out);
// Returns InvalidArgument for an unknown dtype or a size that disagrees with the shape.
absl::Status FromProto(const pb::TensorInfo& in, TensorDescription* out);
void FromProto(const pb::ApplyResult& in, ApplyResult* out);
void FromProto(const pb::CheckpointInfo& in, CheckpointSummary* out);
DeltaInfo FromProto(const pb::DeltaInfo& in);
// The header of an element patch sent for tensor `spec` (its body is left
// empty): DataLoss, saying what is wrong, for an unknown encoding, an element
// size unlike the dtype's, or a size that is not smaller than the tensor (a
// patch is only sent where it is; so a patch never costs more memory than its
// tensor would have).
absl::StatusOr<ElementPatch> FromProto(const pb::TensorPatch& in, const TensorSpec& spec);

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_PROTO_CONVERT_H_
