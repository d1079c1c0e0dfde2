#include "core/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status_util.h"

namespace weightstore {
namespace {

std::atomic<uint64_t> temp_counter{0};

absl::Status SyncFolder(const std::string& folder) {
  int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return StatusFromErrno(errno, absl::StrCat("cannot open folder '", folder, "'"));
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  if (rc != 0) return StatusFromErrno(saved, absl::StrCat("cannot sync folder '", folder, "'"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<AtomicFile>> AtomicFile::Create(const std::string& path, bool overwrite) {
  std::filesystem::path target(path);
  if (target.filename().empty()) return absl::InvalidArgumentError(absl::StrCat("'", path, "' names no file"));
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat("'", path, "' is a folder"));
    if (!overwrite) {
      return absl::AlreadyExistsError(absl::StrCat("'", path, "' already exists (use --overwrite to replace it)"));
    }
  }
  std::unique_ptr<AtomicFile> file(new AtomicFile());
  file->path_ = path;
  file->overwrite_ = overwrite;
  std::filesystem::path folder = target.parent_path();
  file->temp_path_ = (folder / absl::StrCat(".", target.filename().string(), ".", ::getpid(), "-",
                                            temp_counter.fetch_add(1), ".tmp"))
                         .string();
  file->fd_ = ::open(file->temp_path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (file->fd_ < 0) {
    return StatusFromErrno(errno, absl::StrCat("cannot create a temporary file beside '", path, "'"));
  }
  return file;
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_path_.empty()) ::unlink(temp_path_.c_str());
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

absl::Status AtomicFile::Flush() {
  if (fd_ < 0) return absl::FailedPreconditionError("already committed");
  if (::fsync(fd_) != 0) return StatusFromErrno(errno, absl::StrCat("cannot sync '", path_, "'"));
  return absl::OkStatus();
}

absl::Status AtomicFile::Commit() {
  if (committed_) return absl::FailedPreconditionError("already committed");
  if (::fsync(fd_) != 0) return StatusFromErrno(errno, absl::StrCat("cannot sync '", path_, "'"));
  if (::close(fd_) != 0) {
    fd_ = -1;
    return StatusFromErrno(errno, absl::StrCat("cannot close '", path_, "'"));
  }
  fd_ = -1;
  if (overwrite_) {
    if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
      return StatusFromErrno(errno, absl::StrCat("cannot rename onto '", path_, "'"));
    }
  } else {
    // link() fails with EEXIST instead of replacing a file that appeared meanwhile.
    if (::link(temp_path_.c_str(), path_.c_str()) != 0) {
      if (errno == EEXIST) {
        return absl::AlreadyExistsError(absl::StrCat("'", path_, "' already exists (use --overwrite to replace it)"));
      }
      return StatusFromErrno(errno, absl::StrCat("cannot create '", path_, "'"));
    }
    ::unlink(temp_path_.c_str());
  }
  committed_ = true;
  std::string folder = std::filesystem::path(path_).parent_path().string();
  return SyncFolder(folder.empty() ? "." : folder);
}

}  // namespace weightstore
