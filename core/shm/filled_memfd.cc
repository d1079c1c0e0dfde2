#include "core/shm/filled_memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "core/status_util.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010  // Linux 5.1
#endif

namespace weightstore {

int FilledSeals() { return F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL; }

absl::Status CheckFilledSeals(int fd, absl::string_view what) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, " is not a sealable memfd (", strerror(errno), ")"));
  }
  std::vector<std::string> missing;
  if (!(seals & F_SEAL_SHRINK)) missing.push_back("SHRINK");
  if (!(seals & F_SEAL_GROW)) missing.push_back("GROW");
  if (!(seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))) missing.push_back("FUTURE_WRITE");
  if (!(seals & F_SEAL_SEAL)) missing.push_back("SEAL");
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, " is missing seals ", absl::StrJoin(missing, ", ")));
  }
  return absl::OkStatus();
}

namespace {

// Linux 5.18 made a private writable mapping of an F_SEAL_FUTURE_WRITE memfd
// copy-on-write across fork (05d351102dbe); before, a forked child and its
// parent shared their private writes.
bool KernelCopiesPrivateWritesOnFork() {
  static const bool fixed = [] {
    struct utsname u;
    int major = 0, minor = 0;
    return ::uname(&u) == 0 && std::sscanf(u.release, "%d.%d", &major, &minor) == 2 &&
           (major > 5 || (major == 5 && minor >= 18));
  }();
  return fixed;
}

}  // namespace

absl::StatusOr<std::shared_ptr<FilledMemfd>> FilledMemfd::Create(const std::string& name, uint64_t size,
                                                                 std::string path) {
  if (!KernelCopiesPrivateWritesOnFork()) {
    return absl::UnimplementedError("memfds sealed against future writes need Linux 5.18 or later here");
  }
  UniqueFd fd(CreateSealableMemfd(name));
  if (!fd.valid()) return StatusFromErrno(errno, absl::StrCat("memfd_create '", name, "'"));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    return StatusFromErrno(errno, absl::StrCat("cannot size memfd '", name, "' to ", size, " bytes"));
  }
  // At least one byte mapped, so that an empty segment still has an address.
  const size_t mapped = size == 0 ? 1 : size;
  void* addr = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd.get(), 0);
  if (addr == MAP_FAILED) return StatusFromErrno(errno, absl::StrCat("cannot map memfd '", name, "'"));
  auto unmap = [&] { ::munmap(addr, mapped); };
  if (::fcntl(fd.get(), F_ADD_SEALS, FilledSeals()) != 0) {
    const int error = errno;
    unmap();
    if (error == EINVAL || error == EPERM) {  // no such seal (before 5.1), or a sandbox refusing it
      return absl::UnimplementedError(
          absl::StrCat("memfd '", name, "' cannot be sealed against future writes (", strerror(error), ")"));
    }
    return StatusFromErrno(error, absl::StrCat("cannot seal memfd '", name, "'"));
  }
  absl::StatusOr<int> readonly = ReopenReadOnly(fd.get(), name);
  if (!readonly.ok()) {
    unmap();
    return readonly.status();
  }
  absl::StatusOr<std::shared_ptr<const MappedFile>> view =
      MappedFile::FromDescriptor(*readonly, path.empty() ? absl::StrCat("memfd:", name) : std::move(path));
  if (!view.ok()) {
    unmap();
    return view.status();
  }
  // The writable descriptor closes here; the writable mapping stays.
  return std::shared_ptr<FilledMemfd>(new FilledMemfd(size, static_cast<std::byte*>(addr), *std::move(view)));
}

FilledMemfd::~FilledMemfd() { ::munmap(writable_, size_ == 0 ? 1 : size_); }

absl::StatusOr<std::vector<FilledMemfd::Range>> FilledMemfd::Claim(std::span<const Range> wanted) {
  Intervals want;
  for (const Range& r : wanted) {
    if (r.offset > size_ || r.length > size_ - r.offset) {
      return absl::InvalidArgumentError(absl::StrCat("bytes [", r.offset, ", +", r.length, ") pass the end of '",
                                                     view_->path(), "' (", size_, " bytes)"));
    }
    if (r.length > 0) want.add(Intervals::interval_type(r.offset, r.offset + r.length));
  }
  absl::MutexLock lock(&mu_);
  want -= filled_;
  want -= filling_;
  std::vector<Range> mine;
  for (const auto& piece : want) {
    mine.push_back({piece.lower(), piece.upper() - piece.lower()});
    filling_.add(piece);
  }
  return mine;
}

std::span<std::byte> FilledMemfd::Writable(const Range& range) const {
  return std::span<std::byte>(writable_ + range.offset, range.length);
}

void FilledMemfd::Finish(std::span<const Range> claimed, bool written) {
  absl::MutexLock lock(&mu_);
  for (const Range& r : claimed) {
    if (r.length == 0) continue;
    const auto piece = Intervals::interval_type(r.offset, r.offset + r.length);
    filling_.subtract(piece);
    if (written) filled_.add(piece);
  }
}

FilledMemfd::Wait FilledMemfd::WaitFilled(std::span<const Range> wanted, const std::function<bool()>& cancelled) {
  Intervals want;
  for (const Range& r : wanted) {
    if (r.length > 0) want.add(Intervals::interval_type(r.offset, r.offset + r.length));
  }
  bool given_up = false;
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Intervals missing = want;
    missing -= filled_;
    if (missing.empty()) return true;
    // Settled too, badly, once part of it is no one's to fill.
    Intervals orphaned = missing;
    orphaned -= filling_;
    given_up = !orphaned.empty();
    return given_up;
  };
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&settled), absl::Milliseconds(100))) {
    if (cancelled && cancelled()) return Wait::kCancelled;
  }
  return given_up ? Wait::kGivenUp : Wait::kFilled;
}

namespace {

// The whole pages under `ranges`.
boost::icl::interval_set<uint64_t> Pages(std::span<const FilledMemfd::Range> ranges) {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  boost::icl::interval_set<uint64_t> pages;
  for (const FilledMemfd::Range& r : ranges) {
    if (r.length == 0) continue;
    pages.add(boost::icl::interval<uint64_t>::right_open(r.offset / page * page,
                                                         (r.offset + r.length + page - 1) / page * page));
  }
  return pages;
}

}  // namespace

uint64_t FilledMemfd::UnchargedBytes(std::span<const Range> ranges) const {
  Intervals pages = Pages(ranges);
  absl::MutexLock lock(&mu_);
  pages -= charged_;
  return boost::icl::length(pages);
}

void FilledMemfd::MarkCharged(std::span<const Range> ranges) {
  const Intervals pages = Pages(ranges);
  absl::MutexLock lock(&mu_);
  charged_ += pages;
}

uint64_t FilledMemfd::filled_bytes() const {
  absl::MutexLock lock(&mu_);
  return boost::icl::length(filled_);
}

}  // namespace weightstore
