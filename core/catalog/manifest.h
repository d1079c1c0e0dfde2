// Tensor digests and checkpoint manifests: what weight updates compare.
//
// A TensorDigest is the XXH3-128 of a tensor's logical bytes as stored: row-major
// and little-endian, in the file's dtype, before any selection, cast, slice or
// transpose (strided PyTorch views are gathered first). A manifest holds, for
// one checkpoint version, every tensor's name, dtype, shape and digest; it is
// computed once when the version is opened and is small enough to keep after
// the version itself is gone, so a later version can be compared with it.
//
// Two tensors with equal names, dtypes, shapes and digests are taken to hold
// equal bytes, and so serve equal bytes under equal requests. XXH3-128 is not
// a cryptographic hash: it guards against accidents (a collision between two
// versions of a tensor is ~2^-128 per pair), not against a writer crafting
// collisions, who could as well write the bytes they want served.
#ifndef WEIGHTSTORE_CORE_CATALOG_MANIFEST_H_
#define WEIGHTSTORE_CORE_CATALOG_MANIFEST_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "core/checkpoint.h"
#include "core/dtype.h"

namespace weightstore {

struct TensorDigest {
  uint64_t high = 0, low = 0;

  // 32 lowercase hex digits, high half first (XXH3's canonical order).
  std::string Hex() const;
  // Parses Hex()'s form; nullopt for anything else.
  static std::optional<TensorDigest> FromHex(absl::string_view hex);

  friend bool operator==(const TensorDigest&, const TensorDigest&) = default;
};

// The digest of `bytes`.
TensorDigest DigestBytes(std::span<const std::byte> bytes);

// The digest of bytes that arrive in pieces: equal to DigestBytes of them all.
class DigestBuilder {
 public:
  DigestBuilder();
  ~DigestBuilder();
  DigestBuilder(DigestBuilder&&) noexcept;
  DigestBuilder& operator=(DigestBuilder&&) noexcept;
  void Update(absl::string_view bytes);
  TensorDigest Finish() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

struct ManifestTensor {
  std::string name;  // in the checkpoint file
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  TensorDigest digest;

  // Same name, dtype, shape and digest: the same bytes.
  bool SameContentAs(const ManifestTensor& other) const {
    return dtype == other.dtype && shape == other.shape && digest == other.digest;
  }
};

// Immutable once built; thread-safe.
class CheckpointManifest {
 public:
  CheckpointManifest(std::string version, std::vector<ManifestTensor> tensors);

  const std::string& version() const { return version_; }
  // In the checkpoint's entry order: tensors()[i] describes entries()[i].
  const std::vector<ManifestTensor>& tensors() const { return tensors_; }
  // The tensor named `name` in the file, or nullptr.
  const ManifestTensor* Find(absl::string_view name) const;
  // Bytes this manifest holds in memory, about (for bounding what is kept).
  uint64_t memory_bytes() const { return memory_bytes_; }

 private:
  std::string version_;
  std::vector<ManifestTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> by_name_;
  uint64_t memory_bytes_ = 0;
};

// The id of a version named by its content: 32 lowercase hex digits of the
// XXH3-128 of, in order, each tensor's name, dtype, shape and digest (entry
// order), the metadata (key order), and `quantization` when not empty (what
// the quantization config beside the checkpoint makes of its tensors, which
// changes what shards serve), each length-prefixed. Equal for equal contents
// whatever file, path, time or daemon holds them; independent of the file's
// format. A file id (FileVersion) is 16 digits, so the two never meet.
std::string ContentVersion(const std::vector<ManifestTensor>& tensors, const Metadata& metadata,
                           absl::string_view quantization = "");

// The manifest of `checkpoint` under `version` (empty: its ContentVersion), taking each tensor's digest
// from `known` (by name) where its dtype and shape match there, and computing
// the others: for a file written from tensors whose digests are known.
absl::StatusOr<std::shared_ptr<const CheckpointManifest>> ComputeManifest(const Checkpoint& checkpoint,
                                                                          std::string version,
                                                                          const CheckpointManifest& known);

// Reads every tensor of `checkpoint` once and digests it, naming the manifest
// `version`, or by its content when empty (ContentVersion). DataLoss naming
// the tensor if its bytes cannot be read.
absl::StatusOr<std::shared_ptr<const CheckpointManifest>> ComputeManifest(const Checkpoint& checkpoint,
                                                                          std::string version);

// A SafeTensors file may state its tensors' digests in its __metadata__,
// under this key: a JSON object of each tensor's name to its digest's Hex().
// A node following S3 compares them with the digests of the tensors it holds,
// and fetches only the byte ranges of those that changed
// (origin/node_cache_ranges.cc). Python's weightstore.digests_metadata()
// writes it.
inline constexpr char kDigestsMetadataKey[] = "weightstore.digests";
// That JSON, of `tensors` (name, digest), in their order.
std::string DigestsMetadataJson(const std::vector<std::pair<std::string, TensorDigest>>& tensors);
// Parses it: InvalidArgument saying what is wrong when it is not one object
// of at most `max_entries` distinct names to 32 lowercase hex digits.
absl::StatusOr<absl::flat_hash_map<std::string, TensorDigest>> ParseDigestsMetadata(absl::string_view json,
                                                                                    size_t max_entries);

// How `current` differs from `base`, by file name, each list in `current`'s
// order (removed: in `base`'s).
struct ManifestDiff {
  std::vector<std::string> changed;  // in both, with other bytes, dtype or shape
  std::vector<std::string> added;    // only in current
  std::vector<std::string> removed;  // only in base
  size_t unchanged = 0;
};
ManifestDiff DiffManifests(const CheckpointManifest& base, const CheckpointManifest& current);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_MANIFEST_H_
