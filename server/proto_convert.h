// The server's conversions between wire messages and core's types (STYLE.md §4):
// requests in, results out. client/proto_convert.h holds the other direction.
#ifndef WEIGHTSTORE_SERVER_PROTO_CONVERT_H_
#define WEIGHTSTORE_SERVER_PROTO_CONVERT_H_

#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/catalog/manifest.h"
#include "core/catalog/pull.h"
#include "core/catalog/registry.h"
#include "core/element_patch.h"
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

// Returns InvalidArgument naming the field for an unknown adapter or dtype, or
// for more rules, slices or slice dimensions than `limits` allow (checked
// before anything is converted).
absl::Status FromProto(const pb::Selection& in, const SelectionLimits& limits, SelectionRequest* out);
// A served checkpoint's version as every transport lists it.
void ToProto(const CheckpointVersion& version, pb::CheckpointInfo* out);
// How `out`'s checkpoint stands against the origin it follows, when
// `following` lists it (a node with --follow); nothing otherwise.
void AddFollowing(const PullStats& following, pb::CheckpointInfo* out);
// The tensor as served: name, dtype, shape, source name, and its slice if any.
void ToProto(const SnapshotTensor& tensor, pb::TensorInfo* out);
void ToProto(const ApplyResult& in, pb::ApplyResult* out);
// The header of an element patch sent for a tensor (its body travels apart).
void ToProto(const ElementPatch& patch, pb::TensorPatch* out);

// A PushTensor's header, parsed: its spec and CRC32C, and for a tensor pushed
// as an element patch, the patch's header (no body), its byte count, and the
// digests of its base and of the result.
struct PushedTensor {
  TensorSpec spec;
  uint32_t crc32c = 0;
  std::optional<ElementPatch> patch;
  uint64_t patch_bytes = 0;
  TensorDigest base_digest, digest;
};
// InvalidArgument naming the push's `checkpoint` and the tensor for an unknown
// dtype or patch encoding, a rank past kMaxRank, or a patch without both
// digests. Sizes are the push session's to check.
absl::StatusOr<PushedTensor> FromProto(const pb::PushTensor& in, absl::string_view checkpoint);

}  // namespace weightstore

#endif  // WEIGHTSTORE_SERVER_PROTO_CONVERT_H_
