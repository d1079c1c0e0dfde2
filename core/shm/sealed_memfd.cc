#include "core/shm/sealed_memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_util.h"

namespace weightstore {
namespace {

// Closes a descriptor unless released.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

int RequiredSeals() { return F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL; }

int CreateSealableMemfd(const std::string& name) {
  constexpr size_t kNameMax = 249;  // MFD_NAME_MAX_LEN
  const std::string cut = name.substr(0, std::min(name.size(), name.find('\0')));
  return ::memfd_create(cut.substr(0, kNameMax).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
}

namespace {

// Adds the seals. F_SEAL_WRITE fails with EBUSY while a page still has an
// extra reference after the kernel's own short wait (page migration or
// compaction, another CPU's LRU batch); it failed so once in CI, under load.
// Such references are transient: the seals are tried again after a pause
// (20 ms, doubling), five times in all, before the error.
absl::Status AddSeals(int fd, const std::string& name) {
  for (int attempt = 0;; ++attempt) {
    if (::fcntl(fd, F_ADD_SEALS, RequiredSeals()) == 0) return absl::OkStatus();
    if (errno != EBUSY || attempt == 4) break;
    ::usleep(20000u << attempt);
  }
  return StatusFromErrno(errno, absl::StrCat("cannot seal memfd '", name, "'"));
}

// Creates and sizes a memfd, runs `fill` on its writable descriptor, seals it
// and returns it mapped read-only.
absl::StatusOr<std::shared_ptr<const MappedFile>> CreateAndSeal(const std::string& name, uint64_t size,
                                                                const std::function<absl::Status(int fd)>& fill,
                                                                std::string path) {
  int fd = CreateSealableMemfd(name);
  if (fd < 0) return StatusFromErrno(errno, absl::StrCat("memfd_create '", name, "'"));
  FdCloser closer(fd);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return StatusFromErrno(errno, absl::StrCat("cannot size memfd '", name, "' to ", size, " bytes"));
  }
  if (size > 0) {
    if (absl::Status filled = fill(fd); !filled.ok()) return filled;
  }
  if (absl::Status sealed = AddSeals(fd, name); !sealed.ok()) return sealed;
  // Hand out (and map) a read-only descriptor; the writable one is closed.
  absl::StatusOr<int> readonly = ReopenReadOnly(fd, name);
  if (!readonly.ok()) return readonly.status();
  return MappedFile::FromDescriptor(*readonly, path.empty() ? absl::StrCat("memfd:", name) : std::move(path));
}

}  // namespace

absl::StatusOr<std::shared_ptr<const MappedFile>> CreateSealedMemfd(
    const std::string& name, uint64_t size, const std::function<absl::Status(std::span<std::byte>)>& fill,
    std::string path) {
  return CreateAndSeal(
      name, size,
      [&](int fd) -> absl::Status {
        // MAP_POPULATE allocates every page in one call: far cheaper than a fault per page.
        void* addr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (addr == MAP_FAILED) return StatusFromErrno(errno, absl::StrCat("cannot map memfd '", name, "'"));
        // Back the segment with huge pages where the kernel allows it (shmem_enabled).
        ::madvise(addr, size, MADV_HUGEPAGE);
        absl::Status filled = fill(std::span<std::byte>(static_cast<std::byte*>(addr), size));
        ::munmap(addr, size);  // F_SEAL_WRITE fails while a writable mapping exists
        return filled;
      },
      std::move(path));
}

absl::StatusOr<std::shared_ptr<const MappedFile>> CreateSealedMemfd(
    const std::string& name, uint64_t size, const std::function<absl::Status(SegmentWriter&)>& fill, std::string path) {
  return CreateAndSeal(
      name, size,
      [&](int fd) {
        SegmentWriter writer(fd, size, name);
        return fill(writer);
      },
      std::move(path));
}

absl::Status SegmentWriter::Write(uint64_t offset, std::span<const std::byte> bytes) {
  if (offset > size_ || bytes.size() > size_ - offset) {
    return absl::InternalError(absl::StrCat("a write of ", bytes.size(), " bytes at ", offset, " passes the end of '",
                                            name_, "' (", size_, " bytes)"));
  }
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return StatusFromErrno(n < 0 ? errno : ENOSPC, absl::StrCat("cannot fill memfd '", name_, "'"));
    bytes = bytes.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status CheckSealed(int fd, absl::string_view what) {
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, " is not a sealable memfd (", strerror(errno), ")"));
  }
  std::vector<std::string> missing;
  if (!(seals & F_SEAL_SHRINK)) missing.push_back("SHRINK");
  if (!(seals & F_SEAL_GROW)) missing.push_back("GROW");
  if (!(seals & F_SEAL_WRITE)) missing.push_back("WRITE");
  if (!(seals & F_SEAL_SEAL)) missing.push_back("SEAL");
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, " is missing seals ", absl::StrJoin(missing, ", ")));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ReopenReadOnly(int fd, absl::string_view what) {
  std::string proc = absl::StrCat("/proc/self/fd/", fd);
  int readonly = ::open(proc.c_str(), O_RDONLY | O_CLOEXEC);
  if (readonly < 0) return StatusFromErrno(errno, absl::StrCat("cannot reopen ", what, " read-only"));
  return readonly;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> PreloadFile(const std::string& path) {
  int src = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (src < 0) return StatusFromErrno(errno, absl::StrCat("cannot open '", path, "'"));
  FdCloser closer(src);
  struct stat st;
  if (::fstat(src, &st) != 0) return StatusFromErrno(errno, absl::StrCat("cannot stat '", path, "'"));
  if (!S_ISREG(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat("'", path, "' is not a regular file"));
  ::posix_fadvise(src, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::string base = path.substr(path.find_last_of('/') + 1);
  return CreateSealedMemfd(
      absl::StrCat("weightstore-preload:", base), static_cast<uint64_t>(st.st_size),
      [&](std::span<std::byte> out) { return PreadFully(src, 0, out.data(), out.size(), path); }, path);
}

}  // namespace weightstore
