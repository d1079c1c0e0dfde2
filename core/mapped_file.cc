#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
  // With a file_mapping, the fd belongs to it; otherwise to us.
  const bool owned_by_boost = mapping_ != nullptr && mapping_->file.get_mapping_handle().handle >= 0;
  if (!owned_by_boost && fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::FromDescriptor(int fd, std::string path) {
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = std::move(path);
  file->fd_ = fd;  // closed by ~MappedFile from here on
  struct stat st;
  if (::fstat(fd, &st) != 0) return StatusFromErrno(errno, absl::StrCat("cannot stat '", file->path_, "'"));
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", file->path_, "' is not a regular file or memfd"));
  }
  file->size_ = static_cast<uint64_t>(st.st_size);
  file->device_ = st.st_dev;
  file->inode_ = st.st_ino;
  file->mtime_ns_ = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  if (file->size_ == 0) return std::shared_ptr<const MappedFile>(std::move(file));
  try {
    auto mapping = std::make_unique<Mapping>();
    mapping->region = bip::mapped_region(DescriptorMappable(fd), bip::read_only, 0, file->size_);
    file->data_ = static_cast<const std::byte*>(mapping->region.get_address());
    file->mapping_ = std::move(mapping);
    file->mapped_ = true;
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

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(
    const std::string& path, const MappedFileOptions& options) {
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
    if (::fstat(mapped_fd, &mapped_st) != 0 || mapped_st.st_ino != st.st_ino ||
        mapped_st.st_dev != st.st_dev || static_cast<uint64_t>(mapped_st.st_size) != file->size_) {
      ::close(fd);
      return absl::AbortedError(absl::StrCat("'", path, "' changed while it was being opened"));
    }
    ::close(fd);
    file->fd_ = mapped_fd;
    file->data_ = static_cast<const std::byte*>(mapping->region.get_address());
    file->mapping_ = std::move(mapping);
    file->mapped_ = true;
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

absl::Status PreadFully(int fd, uint64_t offset, std::byte* out, uint64_t length,
                        absl::string_view path_for_errors) {
  uint64_t done = 0;
  while (done < length) {
    ssize_t n = ::pread(fd, out + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return StatusFromErrno(errno, absl::StrCat("cannot read '", path_for_errors, "'"));
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat("'", path_for_errors, "' ended at byte ",
                                              offset + done, ", expected ", offset + length));
    }
    done += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace weightstore
