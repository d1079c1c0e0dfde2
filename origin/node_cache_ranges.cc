// A follower's step of a single SafeTensors file from an origin that serves
// whole objects (S3), fetching only what changed: when the new version's
// header states every tensor's digest (kDigestsMetadataKey), the tensors whose
// name, dtype, shape and digest are one the node holds are copied from the
// file held, and only the other byte ranges (the header, the changed tensors)
// are read from the origin. The staged file then goes through the same checks
// and placement as a whole download's (NodeCache::Repull).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/catalog/manifest.h"
#include "core/formats/safetensors.h"
#include "core/mapped_file.h"
#include "core/status_macros.h"
#include "origin/node_cache.h"
#include "origin/node_cache_internal.h"
#include "origin/node_cache_partial.h"

namespace weightstore::origin {
namespace fs = std::filesystem;
using node_cache_internal::Errno;
using node_cache_internal::WholeFileCheck;

namespace {

// A header is read whole into memory; SafeTensors' own reader allows 100 MB.
constexpr uint64_t kMaxRangedHeaderBytes = uint64_t{100} << 20;
// The first read of a new version: its header's length and most headers.
constexpr uint64_t kFirstReadBytes = 64 << 10;
// Below this a file is fetched whole: ranges would save less than the reads
// they add.
constexpr uint64_t kMinRangedFileBytes = 1 << 20;
// Unchanged tensors between two changed ones are fetched with them when they
// come to less than this: one request instead of two.
constexpr uint64_t kMergeGapBytes = 1 << 20;
// What a request costs, counted in bytes against kMaxChangedShare, and the
// most requests a step makes (a header of many small tensors, every other one
// changed, would otherwise mean a request each).
constexpr uint64_t kRequestCostBytes = 64 << 10;
constexpr size_t kMaxFetchRanges = 1024;
// Worth it only when at most this share of the file changed; beyond it a
// whole download (which resumes) is no slower.
constexpr double kMaxChangedShare = 0.5;

struct Range {
  uint64_t begin = 0, end = 0;  // in the new file
  bool fetch = false;           // else copied from the held file
  uint64_t from = 0;            // where a copied range begins in the held file
};

absl::Status PwriteAll(int fd, uint64_t offset, absl::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return absl::ResourceExhaustedError(Errno("cannot write", path));
    bytes.remove_prefix(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// Copies [from, from + length) of `in` to `out` at `to`: in the kernel where
// it can (copy_file_range), else through a buffer.
absl::Status CopyRange(int in, uint64_t from, int out, uint64_t to, uint64_t length, const std::string& path,
                       const std::atomic<bool>& stopping) {
  auto stopped = [&] { return stopping.load() ? absl::UnavailableError("the daemon is stopping") : absl::OkStatus(); };
  while (length > 0) {
    WEIGHTSTORE_RETURN_IF_ERROR(stopped());
    loff_t off_in = static_cast<loff_t>(from), off_out = static_cast<loff_t>(to);
    const ssize_t n = ::copy_file_range(in, &off_in, out, &off_out, std::min<uint64_t>(length, 64u << 20), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EXDEV, ENOSYS, EOPNOTSUPP ...: by hand
    from += static_cast<uint64_t>(n);
    to += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  std::vector<char> buffer(std::min<uint64_t>(length, 4u << 20));
  while (length > 0) {
    WEIGHTSTORE_RETURN_IF_ERROR(stopped());
    const uint64_t n = std::min<uint64_t>(length, buffer.size());
    WEIGHTSTORE_RETURN_IF_ERROR(PreadFully(in, from, reinterpret_cast<std::byte*>(buffer.data()), n, path));
    WEIGHTSTORE_RETURN_IF_ERROR(PwriteAll(out, to, absl::string_view(buffer.data(), n), path));
    from += n;
    to += n;
    length -= n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> NodeCache::RangeStep(const std::string& name, const OriginCheckpoint& checkpoint,
                                          const CheckpointVersion& base, std::atomic<uint64_t>* pulled,
                                          Staged* staged) {
  if (checkpoint.files.size() != 1) return false;
  const OriginFile& file = checkpoint.files.front();
  if (!absl::EndsWith(file.path, ".safetensors") || file.size < kMinRangedFileBytes || base.manifest() == nullptr) {
    return false;
  }
  // Only where the origin vouches for the whole object (an MD5 ETag, a
  // full-object CRC32C): the tensors a header says are unchanged are copied,
  // not fetched, so only that check can tell a header that says so wrongly.
  if (!WholeFileCheck(file, -1).needed()) return false;
  const OpenOptions& open = registry_->options().open;
  const uint64_t max_header = std::min<uint64_t>(kMaxRangedHeaderBytes, open.max_header_bytes);

  // The new header: its first bytes in one read, which holds most headers
  // whole, and the rest of a longer one in a second.
  std::string prefix;
  auto append = [&prefix](absl::string_view bytes) {
    prefix.append(bytes.data(), bytes.size());
    return absl::OkStatus();
  };
  WEIGHTSTORE_RETURN_IF_ERROR(origin_->Read(file, 0, std::min<uint64_t>(file.size, kFirstReadBytes), append));
  pulled->fetch_add(prefix.size());
  bytes_pulled_.fetch_add(prefix.size());
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | static_cast<unsigned char>(prefix[i]);
  if (header_bytes > max_header || header_bytes > file.size - 8) return false;  // the download says why
  if (8 + header_bytes > prefix.size()) {
    const uint64_t had = prefix.size();
    WEIGHTSTORE_RETURN_IF_ERROR(origin_->Read(file, had, 8 + header_bytes - had, append));
    pulled->fetch_add(prefix.size() - had);
    bytes_pulled_.fetch_add(prefix.size() - had);
  }
  prefix.resize(8 + header_bytes);
  absl::StatusOr<SafeTensorsHeader> theirs = ParseSafeTensorsHeader(prefix, file.size, file.path, open);
  if (!theirs.ok()) return false;
  auto claimed = theirs->metadata.find(kDigestsMetadataKey);
  if (claimed == theirs->metadata.end()) return false;
  absl::StatusOr<absl::flat_hash_map<std::string, TensorDigest>> digests =
      ParseDigestsMetadata(claimed->second, 2 * theirs->tensors.size() + 16);  // tied weights' names too
  if (!digests.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the origin's '", file.path, "': ", digests.status().message()));
  }

  // The file held, and where its tensors lie.
  const std::string held_path = base.path();
  UniqueFd held(::open(held_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!held.valid()) return absl::InternalError(Errno("cannot open", held_path));
  char length_bytes[8];
  WEIGHTSTORE_RETURN_IF_ERROR(PreadFully(held.get(), 0, reinterpret_cast<std::byte*>(length_bytes), 8, held_path));
  uint64_t held_header_bytes = 0;
  for (int i = 7; i >= 0; --i)
    held_header_bytes = (held_header_bytes << 8) | static_cast<unsigned char>(length_bytes[i]);
  struct stat st;
  if (::fstat(held.get(), &st) != 0) return absl::InternalError(Errno("cannot stat", held_path));
  const uint64_t held_size = static_cast<uint64_t>(st.st_size);
  if (held_header_bytes > max_header || held_header_bytes > held_size - std::min<uint64_t>(held_size, 8)) {
    return false;
  }
  std::string held_prefix(8 + held_header_bytes, '\0');
  WEIGHTSTORE_RETURN_IF_ERROR(
      PreadFully(held.get(), 0, reinterpret_cast<std::byte*>(held_prefix.data()), held_prefix.size(), held_path));
  absl::StatusOr<SafeTensorsHeader> ours = ParseSafeTensorsHeader(held_prefix, held_size, held_path, open);
  if (!ours.ok()) return false;
  absl::flat_hash_map<std::string, const SafeTensorsHeader::Tensor*> held_by_name;
  for (const SafeTensorsHeader::Tensor& t : ours->tensors) held_by_name[t.spec.name] = &t;

  // Every byte of the new file: the header fetched already, each tensor
  // copied when what it claims is held, else fetched. Copied runs of less
  // than kMergeGapBytes between two fetched tensors are fetched with them,
  // so requests stay few; then adjacent fetches are one range.
  std::vector<const SafeTensorsHeader::Tensor*> in_order;
  for (const SafeTensorsHeader::Tensor& t : theirs->tensors) in_order.push_back(&t);
  std::sort(in_order.begin(), in_order.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  std::vector<Range> tensors;  // one per tensor of bytes, in file order
  for (const SafeTensorsHeader::Tensor* t : in_order) {
    auto digest = digests->find(t->spec.name);
    if (digest == digests->end()) {
      return absl::InvalidArgumentError(absl::StrCat("the origin's '", file.path, "' states no digest of tensor '",
                                                     absl::CHexEscape(t->spec.name.substr(0, 256)), "'"));
    }
    Range r{theirs->data_start + t->offset, theirs->data_start + t->offset + t->spec.byte_size(), true, 0};
    if (r.begin == r.end) continue;
    const ManifestTensor* known = base.manifest()->Find(t->spec.name);
    auto where = held_by_name.find(t->spec.name);
    if (known != nullptr && where != held_by_name.end() && known->dtype == t->spec.dtype &&
        known->shape == t->spec.shape && known->digest == digest->second &&
        where->second->spec.byte_size() == t->spec.byte_size()) {
      r.fetch = false;
      r.from = ours->data_start + where->second->offset;
    }
    tensors.push_back(r);
  }
  for (size_t i = 0; i < tensors.size();) {
    if (tensors[i].fetch) {
      ++i;
      continue;
    }
    size_t j = i;
    uint64_t run = 0;
    for (; j < tensors.size() && !tensors[j].fetch; ++j) run += tensors[j].end - tensors[j].begin;
    if (i > 0 && j < tensors.size() && run < kMergeGapBytes) {
      for (size_t k = i; k < j; ++k) tensors[k].fetch = true;
    }
    i = j;
  }
  std::vector<Range> ranges;
  uint64_t fetched_bytes = 0, copied_tensors = 0;
  size_t fetches = 0;
  for (const Range& r : tensors) {
    if (r.fetch) {
      fetched_bytes += r.end - r.begin;
    } else {
      ++copied_tensors;
    }
    if (!ranges.empty() && r.fetch && ranges.back().fetch && ranges.back().end == r.begin) {
      ranges.back().end = r.end;
    } else {
      ranges.push_back(r);
      fetches += r.fetch ? 1 : 0;
    }
  }
  if (fetches > kMaxFetchRanges || static_cast<double>(fetched_bytes + fetches * kRequestCostBytes) >
                                       kMaxChangedShare * static_cast<double>(file.size)) {
    return false;
  }

  // Staged beside a whole download's partial files, under a name of its own.
  const std::string folder = (fs::path(state_dir_) / "partial" / Sha256Hex(name)).string();
  const std::string path = (fs::path(folder) / "ranged").string();
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create '", folder, "': ", ec.message()));
  UniqueFd out(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!out.valid()) return absl::InternalError(Errno("cannot create", path));
  absl::Cleanup drop = [&] { fs::remove(path, ec); };
  if (::fallocate(out.get(), 0, 0, static_cast<off_t>(file.size)) != 0 && errno != EOPNOTSUPP) {
    return absl::ResourceExhaustedError(Errno("cannot reserve disk space for", path));
  }
  if (::ftruncate(out.get(), static_cast<off_t>(file.size)) != 0) {
    return absl::ResourceExhaustedError(Errno("cannot size", path));
  }
  WEIGHTSTORE_RETURN_IF_ERROR(PwriteAll(out.get(), 0, prefix, path));

  // The ranges, a few at a time; each fetched one is checked against the
  // digests it claims when it is one tensor's bytes.
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::Status first_error;
  auto work = [&] {
    for (size_t i = next++; i < ranges.size() && !failed.load(); i = next++) {
      const Range& r = ranges[i];
      absl::Status status;
      if (!r.fetch) {
        status = CopyRange(held.get(), r.from, out.get(), r.begin, r.end - r.begin, path, stopping_);
      } else {
        uint64_t cursor = r.begin;
        status = origin_->Read(file, r.begin, r.end - r.begin, [&](absl::string_view bytes) -> absl::Status {
          if (stopping_.load()) return absl::UnavailableError("the daemon is stopping");
          if (failed.load()) return absl::CancelledError("another range of the step failed");
          if (bytes.size() > r.end - cursor) return absl::DataLossError("more bytes than asked");
          WEIGHTSTORE_RETURN_IF_ERROR(PwriteAll(out.get(), cursor, bytes, path));
          cursor += bytes.size();
          pulled->fetch_add(bytes.size());
          bytes_pulled_.fetch_add(bytes.size());
          return absl::OkStatus();
        });
        if (status.ok() && cursor != r.end) status = absl::DataLossError("the origin sent fewer bytes than asked");
        // Cut short by the origin: retried as the step, not taken as the
        // header's fault (which a whole download would follow).
        if (absl::IsDataLoss(status)) status = absl::UnavailableError(status.message());
      }
      if (!status.ok()) {
        absl::MutexLock lock(&mu);
        if (!failed.exchange(true)) first_error = status;
        return;
      }
    }
  };
  std::vector<std::thread> threads;
  const size_t helpers =
      std::min<size_t>(std::max(origin_->parallel_reads(), 1), std::max<size_t>(ranges.size(), 1)) - 1;
  for (size_t i = 0; i < helpers; ++i) {
    try {
      threads.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (std::thread& t : threads) t.join();
  {
    absl::MutexLock lock(&mu);
    WEIGHTSTORE_RETURN_IF_ERROR(first_error);
  }

  // Checked whole where the origin vouches for the object (its MD5, its
  // CRC32C): a header that claims a tensor unchanged that is not is caught
  // only here. Then every tensor against the digest its header states (the
  // copied ones too: the file held could have changed since its digests).
  WholeFileCheck check(file, out.get());
  {
    absl::Status checked;
    for (uint64_t upto = 0; checked.ok() && upto < file.size;) {
      if (stopping_.load()) return absl::UnavailableError("the daemon is stopping");
      upto = std::min<uint64_t>(file.size, upto + (uint64_t{256} << 20));
      checked = check.Advance(upto);
    }
    if (checked.ok()) checked = check.Finish();
    if (!checked.ok()) {
      return absl::DataLossError(absl::StrCat(checked.message(), " (put together from the file held and the ",
                                              "changed ranges: its header's digests are not the tensors')"));
    }
  }
  std::vector<char> buffer;
  for (const SafeTensorsHeader::Tensor* t : in_order) {
    const uint64_t begin = theirs->data_start + t->offset, size = t->spec.byte_size();
    DigestBuilder digest;
    for (uint64_t at = 0; at < size;) {
      if (stopping_.load()) return absl::UnavailableError("the daemon is stopping");
      const uint64_t n = std::min<uint64_t>(size - at, 4u << 20);
      buffer.resize(n);
      WEIGHTSTORE_RETURN_IF_ERROR(
          PreadFully(out.get(), begin + at, reinterpret_cast<std::byte*>(buffer.data()), n, path));
      digest.Update(absl::string_view(buffer.data(), n));
      at += n;
    }
    if (!(digest.Finish() == digests->at(t->spec.name))) {
      return absl::DataLossError(absl::StrCat("the origin's '", file.path, "' states a digest of tensor '",
                                              absl::CHexEscape(t->spec.name.substr(0, 256)),
                                              "' that its bytes here do not have"));
    }
  }
  if (::fdatasync(out.get()) != 0) return absl::InternalError(Errno("cannot sync", path));
  std::fprintf(stderr,
               "weightstored: node cache: '%s': %llu of %llu bytes fetched (%zu of %zu tensors unchanged, copied from "
               "the file held)\n",
               name.c_str(), static_cast<unsigned long long>(fetched_bytes + prefix.size()),
               static_cast<unsigned long long>(file.size), static_cast<size_t>(copied_tensors), in_order.size());
  std::move(drop).Cancel();
  staged->folder = folder;
  staged->paths = {path};
  staged->fds.clear();
  staged->fds.push_back(std::move(out));
  return true;
}

}  // namespace weightstore::origin
