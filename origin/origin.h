// Origin: where a node's checkpoints come from when it does not have them (an
// S3-compatible bucket, an upstream weightstored). One interface for all of
// them: find the stored files of a checkpoint by name, and read a byte range of
// one. The node cache (origin/node_cache.h) is written against it.
#ifndef WEIGHTSTORE_ORIGIN_ORIGIN_H_
#define WEIGHTSTORE_ORIGIN_ORIGIN_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore::origin {

// One stored file of a checkpoint at the origin.
struct OriginFile {
  // Where the node places it, relative to its models folder: the checkpoint's
  // name plus the file's extension ("llama/7b.safetensors"), or a shard beside
  // its index ("x/model-00001-of-00002.safetensors"). A relative path of
  // letters, digits, '-', '_', '.' and '/', checked by the origin.
  std::string path;
  // The checkpoint it belongs to (its served name), and the origin's key for
  // it (an object key, a stored file's path).
  std::string checkpoint;
  std::string key;
  uint64_t size = 0;
  // What identifies this content at the origin: an S3 ETag (quoted, as sent),
  // an upstream daemon's version id. A read is refused (Aborted) once the
  // object no longer has it, so one pull never mixes two versions.
  std::string etag;
  // CRC32C of the whole file when the origin knows it (8 hex digits), else
  // empty.
  std::string crc32c;
  // MD5 of the whole file when the origin vouches for one (32 lowercase hex
  // digits: an S3 single-part ETag, unless the object is encrypted with KMS or
  // a customer key, whose ETags are no digest of the bytes), else empty.
  std::string md5;
  // The S3 object version (x-amz-version-id) whose ETag was listed, when the
  // bucket keeps versions, else empty. Reads ask for that version, so an
  // object overwritten mid-pull does not end the pull: the pull finishes the
  // version it began, and the next poll sees the new one.
  std::string object_version;
  // A file beside the checkpoint that serving it reads, not one of its
  // weights: a quantization config (QuantizationConfig::kFileNames) that an
  // upstream daemon lists for a checkpoint kept apart. Placed with it in its
  // folder; a following step keeps it as pulled.
  bool beside = false;
};

// What a pull transfers: every file of one checkpoint, the one its name is
// served from (an index, a single file) last, and the files beside it
// (OriginFile::beside) before that.
struct OriginCheckpoint {
  std::string name;
  // The origin's id of this content (an upstream daemon's version, or a hash
  // of the objects' ETags): a resumed pull continues only for the same one.
  std::string version;
  std::vector<OriginFile> files;
  // True when the origin does not keep it in files at its name (an upstream
  // daemon's hub snapshot: its shard names are other repos' too): the node
  // then places it in a folder of its own, as it does a name no file name
  // serves ("acme/tiny@v1.0").
  bool apart = false;
  uint64_t total_bytes() const {
    uint64_t n = 0;
    for (const OriginFile& f : files) n += f.size;
    return n;
  }
};

// Receives a range's bytes in order, as they arrive. A non-OK return stops the
// read with that status.
using ByteSink = std::function<absl::Status(absl::string_view bytes)>;

// Thread-safe: a pull reads several ranges at once.
//
// Errors: NotFound for a checkpoint or object the origin does not have,
// Unavailable when it cannot be reached (retrying may help),
// Unauthenticated / PermissionDenied for refused credentials, Aborted when an
// object changed (its etag) mid-pull, DataLoss for bytes that fail a check.
class Origin {
 public:
  virtual ~Origin() = default;

  // How logs and metrics name it: "s3://bucket/prefix", "grpc://host:port".
  // Never a secret.
  virtual std::string Describe() const = 0;

  // The stored files of checkpoint `name` (a served name: "llama/7b"). Tries
  // the formats the registry serves, and for a sharded SafeTensors index
  // returns its shards as well. A checkpoint of more than max_files() files
  // is FailedPrecondition, refused before any of them is asked about.
  virtual absl::StatusOr<OriginCheckpoint> Find(const std::string& name) = 0;

  // The origin's version id of checkpoint `name` now (Find's
  // OriginCheckpoint::version), as cheaply as the origin can tell: what a
  // node following it polls. Errors as Find's. Default: Find's.
  virtual absl::StatusOr<std::string> Version(const std::string& name);

  // The most files one checkpoint may have, set once before the first Find
  // (the node cache's bound). Default: 4096.
  void set_max_files(size_t n) { max_files_ = n; }
  size_t max_files() const { return max_files_; }

  // Reads `length` bytes of `file` from `offset` into `sink`. Fails with
  // DataLoss when fewer bytes arrive, Aborted when the file's etag changed.
  virtual absl::Status Read(const OriginFile& file, uint64_t offset, uint64_t length, const ByteSink& sink) = 0;

  // How many ranges a pull should read at once from this origin.
  virtual int parallel_reads() const { return 4; }

  // True when Read checks every byte against a checksum the origin computed
  // before the sink sees it (an upstream daemon's per-chunk CRC32C): a file
  // read whole in one pull then needs no second read to be verified.
  virtual bool verifies_reads() const { return false; }

  // Ends the reads in progress (Cancelled, or Unavailable) and fails new ones:
  // shutdown, with a read that may be stalled on the network.
  virtual void Cancel() {}

 private:
  size_t max_files_ = 4096;
};

// Lowercase hex SHA-256 of `data` (version ids, folder names of partial pulls).
std::string Sha256Hex(absl::string_view data);

}  // namespace weightstore::origin

#endif  // WEIGHTSTORE_ORIGIN_ORIGIN_H_
