// PushSession: a new version of a served checkpoint in the making, from its
// current version (the base) and the tensors that changed. Pushed bytes go to
// a temporary file beside the checkpoint (an AtomicFile temporary that is
// never committed: a killed daemon's is cleaned up by a rescan); when the push
// finishes (CheckpointRegistry::FinishPush), the whole checkpoint is written
// in the base's format, atomically, from the base's bytes and the pushed ones,
// and published as a new version. Of a sharded SafeTensors checkpoint, only
// the shards holding a pushed tensor are written, and renamed into place as
// one step (a crash between the renames is finished by the next scan).
#ifndef WEIGHTSTORE_CORE_CATALOG_PUSH_H_
#define WEIGHTSTORE_CORE_CATALOG_PUSH_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "core/atomic_file.h"
#include "core/catalog/manifest.h"
#include "core/element_patch.h"
#include "core/format.h"
#include "core/tensor.h"

namespace weightstore {

class CheckpointVersion;

struct PushOptions {
  // The version the push was made against: it must still be the current one
  // when the push finishes (else Aborted, and nothing is published).
  std::string base_version;
  // Tensors of the base left out of the new version. One also pushed (with
  // allow_new_tensors) is redefined: another dtype or shape, in its place.
  std::vector<std::string> remove;
  // Tensors the base does not have may be pushed (they go last, in push
  // order). Default: false, every pushed tensor must replace one of the
  // base's, with its dtype and shape.
  bool allow_new_tensors = false;

  // A follower's push (origin/follower.h), making a copy of a version an
  // upstream daemon published. Each is checked when the push begins
  // (InvalidArgument) or before anything is published (DataLoss):
  // - version_id: the id the new version takes instead of its content's
  //   (ValidVersionId). Empty: the content's, as a rescan would name it.
  std::string version_id;
  // - metadata: the new version's, instead of the base's.
  std::optional<Metadata> metadata;
  // - expected: every tensor the new version must have, by name (dtype, shape
  //   and digest), no more and no fewer, each once; the new file holds them
  //   in this order (the upstream's). Needs digests
  //   (RegistryOptions::tensor_digests).
  std::optional<std::vector<ManifestTensor>> expected;
};

class PushSession {
 public:
  // Starts a pushed tensor, whose `spec.byte_size()` bytes follow through
  // Append, with CRC32C `crc32c` (none: the caller checked the bytes' transfer
  // itself, as a follower's fetch does). InvalidArgument naming the tensor unless it
  // replaces a base tensor of the same dtype and shape (or is new, when
  // allowed), is not removed and was not pushed before; ResourceExhausted past
  // the push's byte or tensor bounds.
  absl::Status BeginTensor(const TensorSpec& spec, std::optional<uint32_t> crc32c);
  // Starts a tensor pushed as an element patch of the base's
  // (core/element_patch.h): `patch` is its header (no body), whose
  // `patch_bytes` bytes follow through Append, with CRC32C `crc32c` (none: not
  // checked here, as for BeginTensor). The
  // tensor must replace a base tensor of its dtype and shape whose digest is
  // `base_digest` (else Aborted: the patch was made against other bytes), and
  // the patched tensor must have digest `digest` (checked when it ends).
  // Bounded before anything is allocated: the patch is smaller than the
  // tensor and at most RegistryOptions::max_push_patch_bytes. The patch is
  // checked in full when its bytes are in, and the base streamed through it
  // into the staging file: refused, naming the tensor, with nothing published.
  absl::Status BeginPatchedTensor(const TensorSpec& spec, std::optional<uint32_t> crc32c, const ElementPatch& patch,
                                  uint64_t patch_bytes, const TensorDigest& base_digest, const TensorDigest& digest);
  // Appends bytes of the current tensor (or its patch); InvalidArgument past
  // its size.
  absl::Status Append(absl::string_view data);

  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }
  size_t tensors() const { return pushed_.size(); }

 private:
  friend class CheckpointRegistry;
  // Ends the current tensor: all its bytes, and its checksum; a patch is
  // then applied.
  absl::Status EndTensor();
  // Checks `spec` (new, removed, pushed twice, another dtype or shape, the
  // bounds) and records it as the tensor being pushed.
  absl::Status StartTensor(const TensorSpec& spec, std::optional<uint32_t> crc32c);

  struct Pushed {
    TensorSpec spec;
    uint64_t offset = 0;  // in the staging file
    TensorDigest digest;
    // Came as a patch of the base's tensor: the patch is staged at `offset`
    // (its header here, its body read back from the staging file), and
    // applied to the base's bytes as the new file is written.
    std::optional<ElementPatch> patch;
    uint64_t patch_bytes = 0;
  };
  // (No default member initializers: clang decides std::optional<Current>
  // is not default-constructible while the enclosing class is incomplete.)
  struct Current {
    size_t index;  // into pushed_
    uint64_t received;
    uint32_t crc;
    std::optional<uint32_t> expected_crc;  // none: not checked here
    DigestBuilder digest;
  };
  // The patch of the current tensor, when it came as one.
  struct Patch {
    ElementPatch header;
    std::vector<std::byte> body;  // patch_bytes, reserved up front
    uint64_t patch_bytes;
    TensorDigest expected;
  };
  std::string name_;
  std::shared_ptr<const CheckpointVersion> base_;
  bool sharded_ = false;  // the base is a SafeTensors index: only the shards of pushed tensors are written
  PushOptions options_;
  absl::flat_hash_set<std::string> removed_;
  uint64_t max_bytes_ = 0, bytes_ = 0, max_patch_bytes_ = 0;
  size_t max_tensors_ = 0, max_name_bytes_ = 0;
  size_t new_tensors_ = 0;  // pushed tensors the base does not have
  std::unique_ptr<AtomicFile> staging_;
  std::vector<Pushed> pushed_;
  absl::flat_hash_map<std::string, size_t> by_name_;
  std::optional<Current> current_;
  std::optional<Patch> patch_;

  // EndTensor of a patched tensor `t`: checks the patch and the digest of
  // the base streamed through it, then stages the patch (not the tensor:
  // FinishPush applies it) and frees its memory.
  absl::Status EndPatchedTensor(Pushed& t);
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_PUSH_H_
