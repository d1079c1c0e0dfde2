#include "core/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <boost/interprocess/file_mapping.hpp>
#include <boost/interprocess/mapped_region.hpp>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status_util.h"

namespace weightstore {

namespace bip = boost::interprocess;

struct MappedFile::Mapping {
  bip::file_mapping file;  // empty for FromDescriptor()
  bip::mapped_region region;
};

// One mapping's range for the SIGBUS handler, which reads these with atomic
// loads only (no locks): begin == 0 means free.
struct MappedFileGuardSlot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<bool> faulted{false};
  std::atomic<bool> taken{false};
};

namespace {

// Slots in chunks that are never freed, so the handler can walk them at any time.
struct GuardChunk {
  static constexpr size_t kSlots = 1024;
  MappedFileGuardSlot slots[kSlots];
  std::atomic<GuardChunk*> next{nullptr};
};
GuardChunk g_guard_chunks;
std::atomic<long> g_page_size{0};
struct sigaction g_previous_sigbus;
std::atomic<bool> g_guard_installed{false};

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  const long page = g_page_size.load(std::memory_order_relaxed);
  for (GuardChunk* chunk = &g_guard_chunks; chunk != nullptr; chunk = chunk->next.load(std::memory_order_acquire)) {
    for (MappedFileGuardSlot& slot : chunk->slots) {
      const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
      if (begin == 0 || address < begin || address >= slot.end.load(std::memory_order_acquire)) continue;
      // A page the file lost: read zeros from now on, and say so.
      void* at = reinterpret_cast<void*>(address & ~static_cast<uintptr_t>(page - 1));
      if (::mmap(at, static_cast<size_t>(page), PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) !=
          MAP_FAILED) {
        slot.faulted.store(true, std::memory_order_release);
        return;
      }
      break;
    }
  }
  // Not a mapping of ours: whoever handled SIGBUS before, or the default action.
  if ((g_previous_sigbus.sa_flags & SA_SIGINFO) != 0 && g_previous_sigbus.sa_sigaction != nullptr) {
    g_previous_sigbus.sa_sigaction(signal, info, context);
    return;
  }
  if (g_previous_sigbus.sa_handler != SIG_DFL && g_previous_sigbus.sa_handler != SIG_IGN &&
      g_previous_sigbus.sa_handler != nullptr) {
    g_previous_sigbus.sa_handler(signal);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);
  ::raise(SIGBUS);
}

}  // namespace

void InstallMappedFileGuard() {
  if (g_guard_installed.exchange(true)) return;
  g_page_size = ::sysconf(_SC_PAGESIZE);
  struct sigaction action {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, &g_previous_sigbus);
}

void MappedFile::Guard() {
  const auto begin = reinterpret_cast<uintptr_t>(data_), end = begin + size_;
  for (GuardChunk* chunk = &g_guard_chunks;;) {
    for (MappedFileGuardSlot& slot : chunk->slots) {
      bool expected = false;
      if (!slot.taken.compare_exchange_strong(expected, true)) continue;
      slot.faulted.store(false);
      slot.end.store(end, std::memory_order_release);
      slot.begin.store(begin, std::memory_order_release);
      guard_ = &slot;
      return;
    }
    GuardChunk* next = chunk->next.load(std::memory_order_acquire);
    if (next == nullptr) {
      auto* fresh = new GuardChunk();  // never freed: the handler may be walking
      if (!chunk->next.compare_exchange_strong(next, fresh)) delete fresh;
      next = chunk->next.load(std::memory_order_acquire);
    }
    chunk = next;
  }
}

bool MappedFile::faulted() const { return guard_ != nullptr && guard_->faulted.load(std::memory_order_acquire); }

bool MappedFile::ChangedOnDisk() const {
  if (!mapped_ || mapping_ == nullptr || mapping_->file.get_mapping_handle().handle < 0) return false;
  struct stat st;
  if (::fstat(fd_, &st) != 0) return true;
  const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  const int64_t ctime = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  // A file replaced by a rename (how new versions are published) loses its
  // last link, which changes its ctime but not its bytes: only size and mtime
  // tell then.
  if (st.st_nlink == 0) return static_cast<uint64_t>(st.st_size) != size_ || mtime != mtime_ns_;
  return static_cast<uint64_t>(st.st_size) != size_ || mtime != mtime_ns_ ||
         ctime != ctime_ns_.load(std::memory_order_relaxed);
}

void MappedFile::Renamed() const {
  if (!mapped_) return;
  struct stat st;
  if (::fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) != size_ ||
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec != mtime_ns_) {
    return;
  }
  ctime_ns_.store(static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec, std::memory_order_relaxed);
}

namespace {

// Lets bip::mapped_region map a descriptor it did not open (a memfd).
class DescriptorMappable {
 public:
  explicit DescriptorMappable(int fd) : fd_(fd) {}
  bip::mapping_handle_t get_mapping_handle() const { return bip::ipcdetail::mapping_handle_from_file_handle(fd_); }
  bip::mode_t get_mode() const { return bip::read_only; }

 private:
  int fd_;
};

}  // namespace

MappedFile::~MappedFile() {
  if (guard_ != nullptr) {  // before the mapping goes
    guard_->begin.store(0, std::memory_order_release);
    guard_->end.store(0, std::memory_order_release);
    guard_->taken.store(false, std::memory_order_release);
  }
  // With a file_mapping, the fd belongs to it; otherwise to us.
  const bool owned_by_boost = mapping_ != nullptr && mapping_->file.get_mapping_handle().handle >= 0;
  if (!owned_by_boost && fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::FromDescriptor(int fd, std::string path) {
  return FromDescriptor(fd, std::move(path), 0, UINT64_MAX);
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::FromDescriptor(int fd, std::string path, uint64_t offset,
                                                                             uint64_t length, bool copy_on_write) {
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = std::move(path);
  file->fd_ = fd;  // closed by ~MappedFile from here on
  struct stat st;
  if (::fstat(fd, &st) != 0) return StatusFromErrno(errno, absl::StrCat("cannot stat '", file->path_, "'"));
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", file->path_, "' is not a regular file or memfd"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (length == UINT64_MAX && offset == 0) length = file_size;  // the whole file
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  if (offset % page != 0 || offset > file_size || length > file_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", offset, ", +", length,
                                                   ") are not a page-aligned window of '", file->path_, "' (",
                                                   file_size, " bytes)"));
  }
  file->size_ = length;
  file->offset_ = offset;
  file->device_ = st.st_dev;
  file->inode_ = st.st_ino;
  file->mtime_ns_ = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  file->ctime_ns_ = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  if (file->size_ == 0) return std::shared_ptr<const MappedFile>(std::move(file));
  try {
    auto mapping = std::make_unique<Mapping>();
    mapping->region = bip::mapped_region(DescriptorMappable(fd), copy_on_write ? bip::copy_on_write : bip::read_only,
                                         static_cast<bip::offset_t>(offset), file->size_);
    file->data_ = static_cast<const std::byte*>(mapping->region.get_address());
    file->mapping_ = std::move(mapping);
    file->mapped_ = true;
    file->Guard();
  } catch (const bip::interprocess_exception& e) {
    return InterprocessErrorToStatus(e, absl::StrCat("cannot map '", file->path_, "'"));
  }
  return std::shared_ptr<const MappedFile>(std::move(file));
}

bool MappedFile::Contains(const SharedBytes& bytes, uint64_t* offset) const {
  auto begin = reinterpret_cast<uintptr_t>(data_), at = reinterpret_cast<uintptr_t>(bytes.data());
  if (data_ == nullptr || at < begin || at + bytes.size() > begin + size_) return false;
  *offset = at - begin;
  return true;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(const std::string& path,
                                                                   const MappedFileOptions& options) {
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return StatusFromErrno(errno, absl::StrCat("cannot open '", path, "'"));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    absl::Status status = StatusFromErrno(errno, absl::StrCat("cannot stat '", path, "'"));
    ::close(fd);
    return status;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' is not a regular file"));
  }
  file->size_ = static_cast<uint64_t>(st.st_size);
  file->device_ = st.st_dev;
  file->inode_ = st.st_ino;
  file->mtime_ns_ = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  file->ctime_ns_ = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;

  if (file->size_ < options.mmap_threshold || file->size_ == 0) {
    file->fd_ = fd;
    file->buffer_.resize(file->size_);
    absl::Status status = PreadFully(fd, 0, file->buffer_.data(), file->size_, path);
    if (!status.ok()) return status;
    file->data_ = file->buffer_.data();
    return std::shared_ptr<const MappedFile>(std::move(file));
  }

  // Map through Boost.Interprocess. It opens its own descriptor, which we keep as
  // fd(); ours is closed once the mapping exists, so both name the same inode only
  // if the file was not replaced in between: check that.
  try {
    auto mapping = std::make_unique<Mapping>();
    mapping->file = bip::file_mapping(path.c_str(), bip::read_only);
    mapping->region = bip::mapped_region(mapping->file, bip::read_only, 0, file->size_);
    int mapped_fd = mapping->file.get_mapping_handle().handle;
    struct stat mapped_st;
    if (::fstat(mapped_fd, &mapped_st) != 0 || mapped_st.st_ino != st.st_ino || mapped_st.st_dev != st.st_dev ||
        static_cast<uint64_t>(mapped_st.st_size) != file->size_) {
      ::close(fd);
      return absl::AbortedError(absl::StrCat("'", path, "' changed while it was being opened"));
    }
    ::close(fd);
    file->fd_ = mapped_fd;
    file->data_ = static_cast<const std::byte*>(mapping->region.get_address());
    file->mapping_ = std::move(mapping);
    file->mapped_ = true;
    file->Guard();
  } catch (const bip::interprocess_exception& e) {
    ::close(fd);
    return InterprocessErrorToStatus(e, absl::StrCat("cannot map '", path, "'"));
  }
  return std::shared_ptr<const MappedFile>(std::move(file));
}

SharedBytes MappedFile::bytes() const {
  return SharedBytes(shared_from_this(), std::span<const std::byte>(data_, size_));
}

void MappedFile::WillNeed(uint64_t offset, uint64_t length) const {
  if (!mapped_ || length == 0 || offset >= size_) return;
  const long page = ::sysconf(_SC_PAGESIZE);
  uint64_t begin = offset - offset % static_cast<uint64_t>(page);
  uint64_t end = std::min(size_, offset + length);
  ::madvise(const_cast<std::byte*>(data_) + begin, end - begin, MADV_WILLNEED);
}

absl::Status PreadFully(int fd, uint64_t offset, std::byte* out, uint64_t length, absl::string_view path_for_errors) {
  uint64_t done = 0;
  while (done < length) {
    ssize_t n = ::pread(fd, out + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return StatusFromErrno(errno, absl::StrCat("cannot read '", path_for_errors, "'"));
    }
    if (n == 0) {
      return absl::DataLossError(
          absl::StrCat("'", path_for_errors, "' ended at byte ", offset + done, ", expected ", offset + length));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace weightstore
