#include "origin/node_cache_partial.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/crc32c.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"
#include "origin/node_cache_internal.h"

namespace weightstore::origin::node_cache_internal {

namespace {

constexpr size_t kVerifyBlock = size_t{8} << 20;

}  // namespace

absl::Status WholeFileCheck::Advance(uint64_t upto) {
  std::string block(std::min<uint64_t>(kVerifyBlock, upto > hashed_ ? upto - hashed_ : 0), '\0');
  while (hashed_ < upto) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(block.size(), upto - hashed_));
    const ssize_t got = ::pread(fd_, block.data(), n, static_cast<off_t>(hashed_));
    if (got <= 0) return absl::DataLossError(Errno("cannot read back", file_.path));
    const absl::string_view bytes(block.data(), static_cast<size_t>(got));
    if (!file_.crc32c.empty()) crc_ = Crc32cExtend(crc_, bytes);
    if (ctx_ != nullptr) EVP_DigestUpdate(ctx_.get(), bytes.data(), bytes.size());
    hashed_ += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status WholeFileCheck::Finish() {
  WEIGHTSTORE_RETURN_IF_ERROR(Advance(file_.size));
  const std::string what = absl::StrCat("'", file_.path, "'");
  if (!file_.crc32c.empty()) {
    const std::string got = absl::StrFormat("%08x", crc_);
    if (got != absl::AsciiStrToLower(file_.crc32c)) {
      return absl::DataLossError(absl::StrCat(what, ": CRC32C of the bytes received is ", got, ", the origin states ",
                                              absl::CHexEscape(file_.crc32c.substr(0, 16))));
    }
  }
  if (!md5_.empty()) {
    if (md5_failed_) return absl::InternalError("cannot compute an MD5 digest");
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int length = 0;
    EVP_DigestFinal_ex(ctx_.get(), digest, &length);
    const std::string got = absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(digest), length));
    if (got != md5_) {
      return absl::DataLossError(
          absl::StrCat(what, ": MD5 of the bytes received is ", got, ", the origin's ETag states ", md5_));
    }
  }
  return absl::OkStatus();
}

bool Progress::Matches(const OriginCheckpoint& c) const {
  if (name != c.name || version != c.version || files.size() != c.files.size()) return false;
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i].path != c.files[i].path || files[i].size != c.files[i].size || files[i].etag != c.files[i].etag) {
      return false;
    }
  }
  return true;
}

std::string Progress::ToJson() const {
  nlohmann::json j;
  j["name"] = name;
  j["version"] = version;
  for (size_t i = 0; i < files.size(); ++i) {
    j["files"].push_back(
        {{"path", files[i].path}, {"size", files[i].size}, {"etag", files[i].etag}, {"done", done[i]}});
  }
  return j.dump();
}

std::optional<Progress> Progress::FromJson(const std::string& text, uint64_t part_bytes) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("files") || !j["files"].is_array()) return std::nullopt;
  Progress p;
  try {
    p.name = j.at("name").get<std::string>();
    p.version = j.at("version").get<std::string>();
    for (const auto& f : j["files"]) {
      OriginFile file;
      file.path = f.at("path").get<std::string>();
      file.size = f.at("size").get<uint64_t>();
      file.etag = f.at("etag").get<std::string>();
      std::vector<uint64_t> done = f.at("done").get<std::vector<uint64_t>>();
      const uint64_t parts = (file.size + part_bytes - 1) / part_bytes;
      if (done.size() != parts) return std::nullopt;
      for (uint64_t k = 0; k < parts; ++k) {
        if (done[k] > std::min(part_bytes, file.size - k * part_bytes)) return std::nullopt;
      }
      p.files.push_back(std::move(file));
      p.done.push_back(std::move(done));
    }
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
  return p;
}

}  // namespace weightstore::origin::node_cache_internal
