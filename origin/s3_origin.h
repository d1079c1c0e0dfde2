// S3Origin: checkpoints in an S3-compatible bucket (AWS S3, MinIO, s3rver, ...),
// read over HTTP(S) with libcurl and signed with AWS Signature V4.
//
// Layout: checkpoint "llama/7b" of origin "s3://bucket/prefix" is the object
// "prefix/llama/7b" plus one of the extensions the registry serves
// (.safetensors.index.json, .safetensors, .bpk, .pt, .pth; the first that
// exists wins); an index's shards are objects beside it.
//
// Thread-safe. Every reply body the server controls is bounded (a listing page,
// an index, an error body), and secrets appear in no message.
#ifndef WEIGHTSTORE_ORIGIN_S3_ORIGIN_H_
#define WEIGHTSTORE_ORIGIN_S3_ORIGIN_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "origin/origin.h"

namespace weightstore::origin {

struct S3Config {
  // Credentials. Secrets: never logged, never in Describe() or an error. With no
  // access key id the requests are anonymous (unsigned).
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // sent as x-amz-security-token when set
  // Letters, digits and '-'; part of every signature.
  std::string region = "us-east-1";
  // "" = AWS: https://BUCKET.s3.REGION.amazonaws.com/KEY (path-style on
  // s3.REGION.amazonaws.com for a bucket name with dots). Else an http(s) URL
  // such as "http://127.0.0.1:4568", addressed path-style: ENDPOINT/BUCKET/KEY.
  std::string endpoint;
  // Ranges a pull reads at once (parallel_reads()).
  int parallel_reads = 8;
  int connect_timeout_ms = 5000;
  // A transfer slower than low_speed_bytes_per_second for low_speed_seconds
  // fails Unavailable, so a server that trickles cannot hold a pull forever
  // (libcurl averages the speed over its last 5 seconds, so a stall after a
  // fast start is noticed up to 5 s later). Default: 16 KiB/s for 30 s.
  int low_speed_seconds = 30;
  int low_speed_bytes_per_second = 16 << 10;
  // Entries (objects and subfolders) a checkpoint's folder may hold; a listing
  // with more fails ResourceExhausted.
  uint64_t max_list_objects = 10000;
};

// Fills unset fields from the AWS SDK environment: the credentials
// (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, taken together
// and only when neither key is set), the region when it is empty or the default
// (AWS_REGION, then AWS_DEFAULT_REGION), the endpoint when empty
// (AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL).
void FillFromEnvironment(S3Config* config);

class S3Origin final : public Origin {
 public:
  // `url`: "s3://bucket" or "s3://bucket/prefix/" (the trailing '/' optional).
  // InvalidArgument naming the url for anything else (a bucket is 3-63 of
  // [a-z0-9.-], starting and ending with a letter or digit; a prefix is a
  // relative path as checkpoint names are, core/catalog/registry.h IsPlaceableName),
  // and for an invalid config (naming the field, never its value).
  static absl::StatusOr<std::unique_ptr<Origin>> Create(const std::string& url, S3Config config);

  ~S3Origin() override;
  S3Origin(const S3Origin&) = delete;
  S3Origin& operator=(const S3Origin&) = delete;

  // "s3://bucket/prefix", plus " at ENDPOINT" when one is set.
  std::string Describe() const override;

  // One ListObjectsV2 of the checkpoint's folder (all its pages), then for a
  // sharded index a GET of the index: its shards (sorted by name), then the
  // index. Each file's size and ETag come from the listing; version is the
  // SHA-256 (hex) of every file's key, size and ETag. NotFound naming the
  // checkpoint and the url when no object matches, or naming a shard the
  // listing lacks; InvalidArgument for a name that is not a placeable relative
  // path (IsPlaceableName); DataLoss for an index that is no
  // JSON object with a "weight_map" of plain file names.
  absl::StatusOr<OriginCheckpoint> Find(const std::string& name) override;
  // Find's version without its HEADs: one listing (and an index's GET).
  absl::StatusOr<std::string> Version(const std::string& name) override;

  // A GET of bytes [offset, offset + length) with If-Match: file.etag, streamed
  // into `sink` as it arrives; of version file.object_version when set, so
  // that an overwrite since the listing does not end the read. Aborted when
  // the object's ETag is no longer file.etag (a 412, or a reply with another
  // ETag from a server that ignores If-Match), or its pinned version is gone;
  // DataLoss unless exactly `length` bytes of that range arrive; a sink error
  // stops the transfer and is returned as is. A read of a version refused
  // as if versions cannot be read (403 AccessDenied: no s3:GetObjectVersion;
  // 400 InvalidArgument, 405, 501) is made again by ETag alone; once that
  // succeeds, this origin pins no more versions.
  absl::Status Read(const OriginFile& file, uint64_t offset, uint64_t length, const ByteSink& sink) override;

  int parallel_reads() const override { return config_.parallel_reads; }
  // Aborts the transfers in progress (within about a second: libcurl's
  // progress callback) and fails new ones, Cancelled.
  void Cancel() override { cancelled_ = true; }

 private:
  struct Reply;
  class Handle;

  S3Origin(std::string bucket, std::string prefix, S3Config config);

  // Find; `describe` asks for each file's checksums (a HEAD each).
  absl::StatusOr<OriginCheckpoint> FindFiles(const std::string& name, bool describe);
  // "s3://bucket/key", how errors name an object.
  std::string ObjectUrl(const std::string& key) const;
  // The HTTP(S) URL of the bucket ("" key) or of an object.
  std::string HttpUrl(const std::string& key) const;
  // Every object under `folder_prefix` (ending in '/', or "" for the bucket's
  // root), with key, size and etag.
  absl::Status List(const std::string& folder_prefix, std::vector<OriginFile>* objects);
  // Asks S3 what it vouches for of a listed object's bytes (a HEAD with
  // checksums enabled): fills file->crc32c from a full-object CRC32C checksum
  // and file->md5 from a single-part ETag of an object not encrypted with KMS
  // or a customer key, and file->object_version from a versioned bucket's
  // x-amz-version-id. Aborted if its ETag is no longer the listed one.
  absl::Status Describe(OriginFile* file);
  // Describe() of every file, parallel_reads at a time; the first error.
  absl::Status DescribeAll(std::vector<OriginFile>* files);
  // One GET or HEAD (or listing page): signs it, runs it on a pooled handle,
  // and maps transport and HTTP errors, naming `what`.
  absl::Status Perform(const std::string& url, const std::vector<std::string>& headers, const std::string& what,
                       Reply* reply, bool head = false);

  std::unique_ptr<Handle> AcquireHandle();
  void ReleaseHandle(std::unique_ptr<Handle> handle);

  const std::string bucket_;
  const std::string prefix_;  // "" or "a/b", no trailing '/'
  const S3Config config_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Handle>> idle_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> cancelled_{false};
  // Set once a read of a version (OriginFile::object_version) was refused as
  // if versions cannot be read and the same read by ETag succeeded: reads
  // then go by ETag alone.
  std::atomic<bool> versions_refused_{false};
};

}  // namespace weightstore::origin

#endif  // WEIGHTSTORE_ORIGIN_S3_ORIGIN_H_
