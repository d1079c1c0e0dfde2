// A node cache pull's partial files (origin/node_cache_transfer.cc): how far
// the pull got, and the check of each file whole. Not for use outside origin/.
#ifndef WEIGHTSTORE_ORIGIN_NODE_CACHE_PARTIAL_H_
#define WEIGHTSTORE_ORIGIN_NODE_CACHE_PARTIAL_H_

#include <openssl/evp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "origin/origin.h"

namespace weightstore::origin::node_cache_internal {

// Checks a file whole against what the origin stated of it: its CRC32C and
// its MD5 (OriginFile::crc32c, ::md5). Fed in order (Advance), while the file is
// still being pulled, so most of the hashing overlaps the transfer.
class WholeFileCheck {
 public:
  WholeFileCheck(const OriginFile& file, int fd) : file_(file), fd_(fd), md5_(file.md5) {
    if (!md5_.empty()) {
      ctx_.reset(EVP_MD_CTX_new());
      if (ctx_ == nullptr || EVP_DigestInit_ex(ctx_.get(), EVP_md5(), nullptr) != 1) md5_failed_ = true;
    }
  }
  // False when the origin stated nothing to check against.
  bool needed() const { return !file_.crc32c.empty() || !md5_.empty(); }
  uint64_t hashed() const { return hashed_; }

  // Hashes the file's bytes [hashed(), upto), reading them back from disk.
  absl::Status Advance(uint64_t upto);

  // Hashes what is left and compares. DataLoss naming the file on a mismatch.
  absl::Status Finish();

 private:
  struct FreeContext {
    void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
  };
  const OriginFile& file_;
  const int fd_;
  const std::string md5_;
  std::unique_ptr<EVP_MD_CTX, FreeContext> ctx_;
  bool md5_failed_ = false;
  uint32_t crc_ = 0;
  uint64_t hashed_ = 0;
};

// How far a pull got: bytes written and verified from the start of each part
// of each file, persisted so a later pull of the same version resumes.
struct Progress {
  std::string name, version;
  std::vector<OriginFile> files;
  std::vector<std::vector<uint64_t>> done;  // [file][part]

  bool Matches(const OriginCheckpoint& c) const;
  std::string ToJson() const;
  static std::optional<Progress> FromJson(const std::string& text, uint64_t part_bytes);
};

}  // namespace weightstore::origin::node_cache_internal

#endif  // WEIGHTSTORE_ORIGIN_NODE_CACHE_PARTIAL_H_
