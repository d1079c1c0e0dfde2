#include "core/atomic_file.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/status_util.h"

namespace weightstore {
namespace {

std::atomic<uint64_t> temp_counter{0};

}  // namespace

absl::StatusOr<std::unique_ptr<AtomicFile>> AtomicFile::Create(const std::string& path, bool overwrite) {
  std::filesystem::path target(path);
  if (target.filename().empty()) return absl::InvalidArgumentError(absl::StrCat("'", path, "' names no file"));
  const std::filesystem::path folder = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  int folder_fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder_fd < 0) return StatusFromErrno(errno, absl::StrCat("cannot open folder '", folder.string(), "'"));
  auto file = CreateAt(folder_fd, target.filename().string(), path, overwrite);
  ::close(folder_fd);
  return file;
}

absl::StatusOr<std::unique_ptr<AtomicFile>> AtomicFile::CreateAt(int folder_fd, const std::string& name,
                                                                 const std::string& path, bool overwrite) {
  struct stat st;
  if (::fstatat(folder_fd, name.c_str(), &st, 0) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat("'", path, "' is a folder"));
    if (!overwrite) {
      return absl::AlreadyExistsError(absl::StrCat("'", path, "' already exists (use --overwrite to replace it)"));
    }
  }
  std::unique_ptr<AtomicFile> file(new AtomicFile());
  file->path_ = path;
  file->name_ = name;
  file->overwrite_ = overwrite;
  file->folder_fd_ = ::fcntl(folder_fd, F_DUPFD_CLOEXEC, 0);
  if (file->folder_fd_ < 0) return StatusFromErrno(errno, absl::StrCat("cannot hold the folder of '", path, "'"));
  file->temp_name_ = absl::StrCat(".", name, ".", ::getpid(), "-", temp_counter.fetch_add(1), ".tmp");
  const size_t slash = path.rfind('/');
  file->temp_path_ = slash == std::string::npos
                         ? file->temp_name_
                         : absl::StrCat(absl::string_view(path).substr(0, slash + 1), file->temp_name_);
  file->fd_ = ::openat(file->folder_fd_, file->temp_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (file->fd_ < 0) {
    return StatusFromErrno(errno, absl::StrCat("cannot create a temporary file beside '", path, "'"));
  }
  // Held until the descriptor closes: the temporary's writer is alive.
  (void)::flock(file->fd_, LOCK_EX | LOCK_NB);
  return file;
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_name_.empty()) ::unlinkat(folder_fd_, temp_name_.c_str(), 0);
  if (folder_fd_ >= 0) ::close(folder_fd_);
}

absl::Status AtomicFile::Append(absl::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd_, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return StatusFromErrno(errno, absl::StrCat("cannot write '", path_, "'"));
    }
    data.remove_prefix(static_cast<size_t>(n));
    written_ += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::AppendZeros(uint64_t n) {
  static const char kZeros[4096] = {};
  while (n > 0) {
    uint64_t chunk = std::min<uint64_t>(n, sizeof kZeros);
    absl::Status status = Append(absl::string_view(kZeros, chunk));
    if (!status.ok()) return status;
    n -= chunk;
  }
  return absl::OkStatus();
}

absl::Status AtomicFile::Resize(uint64_t size) {
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
    return StatusFromErrno(errno, absl::StrCat("cannot size '", path_, "' to ", size, " bytes"));
  }
  written_ = size;
  return absl::OkStatus();
}

absl::StatusOr<AtomicFile::CloneResult> AtomicFile::CloneFrom(int from, uint64_t size, bool copy) {
  if (fd_ < 0) return absl::FailedPreconditionError("already committed");
  if (written_ != 0) return absl::FailedPreconditionError(absl::StrCat("'", path_, "' is not empty"));
  auto source_size = [&](int fd) -> absl::StatusOr<uint64_t> {
    struct stat st;
    if (::fstat(fd, &st) != 0) return StatusFromErrno(errno, absl::StrCat("cannot clone into '", path_, "'"));
    return static_cast<uint64_t>(st.st_size);
  };
  auto unsupported = [&]() -> absl::StatusOr<CloneResult> {
    if (::ftruncate(fd_, 0) != 0) return StatusFromErrno(errno, absl::StrCat("cannot empty '", path_, "'"));
    return CloneResult::kUnsupported;
  };
  auto short_source = [&](uint64_t at) {
    return absl::DataLossError(
        absl::StrCat("cannot copy into '", path_, "': its source is ", at, " bytes, not ", size));
  };
  WEIGHTSTORE_ASSIGN_OR_RETURN(const uint64_t before, source_size(from));
  if (before != size) return short_source(before);
  if (::ioctl(fd_, FICLONE, from) == 0) {
    // The extents shared are the source's as it was then: its size again.
    WEIGHTSTORE_ASSIGN_OR_RETURN(const uint64_t cloned, source_size(fd_));
    if (cloned != size) {
      (void)unsupported();
      return short_source(cloned);
    }
    written_ = size;
    return CloneResult::kCloned;
  }
  if (!copy) return unsupported();
  loff_t in = 0, out = 0;
  while (static_cast<uint64_t>(out) < size) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(size - out, uint64_t{1} << 30));
    const ssize_t n = ::copy_file_range(from, &in, fd_, &out, chunk, 0);
    if (n > 0) continue;
    const int error = n == 0 ? 0 : errno;
    if (error == EINTR) continue;
    if (out == 0 && (error == EXDEV || error == EOPNOTSUPP || error == ENOSYS || error == EINVAL)) {
      return unsupported();
    }
    (void)unsupported();
    if (error == 0) return short_source(static_cast<uint64_t>(in));
    return StatusFromErrno(error, absl::StrCat("cannot copy into '", path_, "'"));
  }
  written_ = size;
  return CloneResult::kCopied;
}

absl::Status AtomicFile::Flush() {
  if (fd_ < 0) return absl::FailedPreconditionError("already committed");
  if (::fsync(fd_) != 0) return StatusFromErrno(errno, absl::StrCat("cannot sync '", path_, "'"));
  return absl::OkStatus();
}

absl::Status AtomicFile::Commit() {
  if (committed_) return absl::FailedPreconditionError("already committed");
  if (::fsync(fd_) != 0) return StatusFromErrno(errno, absl::StrCat("cannot sync '", path_, "'"));
  if (overwrite_) {
    if (::renameat(folder_fd_, temp_name_.c_str(), folder_fd_, name_.c_str()) != 0) {
      return StatusFromErrno(errno, absl::StrCat("cannot rename onto '", path_, "'"));
    }
  } else {
    // link() fails with EEXIST instead of replacing a file that appeared meanwhile.
    if (::linkat(folder_fd_, temp_name_.c_str(), folder_fd_, name_.c_str(), 0) != 0) {
      if (errno == EEXIST) {
        return absl::AlreadyExistsError(absl::StrCat("'", path_, "' already exists (use --overwrite to replace it)"));
      }
      return StatusFromErrno(errno, absl::StrCat("cannot create '", path_, "'"));
    }
    ::unlinkat(folder_fd_, temp_name_.c_str(), 0);
  }
  committed_ = true;
  const int closed = ::close(fd_);
  fd_ = -1;
  if (closed != 0) return StatusFromErrno(errno, absl::StrCat("cannot close '", path_, "'"));
  if (::fsync(folder_fd_) != 0) return StatusFromErrno(errno, absl::StrCat("cannot sync the folder of '", path_, "'"));
  return absl::OkStatus();
}

bool IsAtomicFileTemporary(absl::string_view filename) {
  // ".<name>.<pid>-<n>.tmp"
  if (filename.size() < 9 || filename.front() != '.' || !absl::EndsWith(filename, ".tmp")) return false;
  absl::string_view stem = filename.substr(0, filename.size() - 4);
  const size_t dot = stem.rfind('.');
  if (dot == absl::string_view::npos || dot == 0) return false;
  absl::string_view counter = stem.substr(dot + 1);
  const size_t dash = counter.find('-');
  if (dash == absl::string_view::npos || dash == 0 || dash + 1 == counter.size()) return false;
  return std::all_of(counter.begin(), counter.end(), [](char c) { return c == '-' || (c >= '0' && c <= '9'); });
}

bool IsAbandonedTemporary(int folder_fd, const std::string& name, int64_t min_age_seconds) {
  const int fd = ::openat(folder_fd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  struct stat st;
  // The fine clock: time() reads a coarse one, which can lag a file's mtime
  // (taken from the fine clock on kernels with multigrain timestamps, 6.13+)
  // by a tick, and a file written just now then looks written in the future.
  struct timespec now;
  ::clock_gettime(CLOCK_REALTIME, &now);
  bool abandoned = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0 &&
                   now.tv_sec - st.st_mtim.tv_sec >= min_age_seconds;
  ::close(fd);
  return abandoned;
}

}  // namespace weightstore
