// MappedFile: a read-only view of a whole file, memory-mapped with
// Boost.Interprocess, or read with pread when the file is small.
//
// Move-only owner of the mapping; share it through std::shared_ptr so that byte
// ranges (SharedBytes) handed out by bytes() keep it alive. Thread-safe: immutable
// after Open(), but for faulted().
//
// A mapped file changed in place by someone else (weightstore itself only ever
// replaces files by rename) changes under its readers, and reading a page a
// truncation removed raises SIGBUS. With InstallMappedFileGuard(), such a read
// gets zeros instead and marks the file faulted(); ChangedOnDisk() tells a
// rewrite. Readers check both before trusting what they read.
#ifndef WEIGHTSTORE_CORE_MAPPED_FILE_H_
#define WEIGHTSTORE_CORE_MAPPED_FILE_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/shared_bytes.h"

namespace weightstore {

struct MappedFileOptions {
  // Files smaller than this are read into memory with pread instead of mapped.
  // Default: 256 KiB (tensorstore's kMMapThreshold).
  uint64_t mmap_threshold = 256 * 1024;
};

struct MappedFileGuardSlot;  // mapped_file.cc

class MappedFile : public std::enable_shared_from_this<MappedFile> {
 public:
  // Opens and maps `path` read-only. Returns NotFound if it does not exist,
  // FailedPrecondition if it is not a regular file, Internal on I/O failure.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Open(const std::string& path,
                                                                const MappedFileOptions& options = {});
  // Maps the open descriptor `fd` read-only and shared (always mapped, whatever
  // its size), taking ownership of it; `path` names it in errors. Used for sealed
  // memfds and for descriptors received over a socket. Closes `fd` on error.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> FromDescriptor(int fd, std::string path);
  // As above, mapping only bytes [offset, offset + length) of the file:
  // bytes() and size() are that window. InvalidArgument unless `offset` is a
  // multiple of the page size and the window lies inside the file. With
  // `copy_on_write`, the mapping is private and writable: a write through it
  // (by code given its address, as Python's tensors are) copies the page for
  // this process and never reaches the file; without, such a write faults.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> FromDescriptor(int fd, std::string path, uint64_t offset,
                                                                          uint64_t length, bool copy_on_write = false);

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  // Where bytes() starts in the file: 0 unless a window was mapped.
  uint64_t offset() const { return offset_; }
  bool is_mapped() const { return mapped_; }
  // The open file descriptor (valid while this object lives).
  int fd() const { return fd_; }
  // Device and inode of the opened file: identify a version across renames.
  dev_t device() const { return device_; }
  ino_t inode() const { return inode_; }
  int64_t mtime_ns() const { return mtime_ns_; }

  // Returns the whole file; subspans share ownership of this MappedFile.
  SharedBytes bytes() const;
  // True when `bytes` lie inside this file's bytes(); `offset` then receives
  // where they start.
  bool Contains(const SharedBytes& bytes, uint64_t* offset) const;

  // Hints that [offset, offset + length) will be read soon (madvise WILLNEED).
  void WillNeed(uint64_t offset, uint64_t length) const;

  // True once a read of the mapping hit a page the file no longer has (it was
  // truncated): that page reads as zeros now. Needs InstallMappedFileGuard().
  bool faulted() const;
  // True when the mapped file's size, modification time or change time differs
  // from when it was opened: someone wrote to it in place (ctime cannot be put
  // back, as `touch -r` puts back mtime). Always false for files read into
  // memory (they are a private copy) and for sealed memfds.
  bool ChangedOnDisk() const;
  // Its owner has just renamed the file into place, which moves the change
  // time: takes the file's change time now as the one it was opened with,
  // unless its size or modification time moved too (then it stays changed).
  void Renamed() const;

 private:
  MappedFile() = default;

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t offset_ = 0;
  bool mapped_ = false;
  dev_t device_ = 0;
  ino_t inode_ = 0;
  int64_t mtime_ns_ = 0;
  mutable std::atomic<int64_t> ctime_ns_{0};  // moved by Renamed()
  const std::byte* data_ = nullptr;
  std::vector<std::byte> buffer_;  // small files
  struct Mapping;
  std::unique_ptr<Mapping> mapping_;      // large files
  MappedFileGuardSlot* guard_ = nullptr;  // while mapped
  void Guard();
};

// Installs the process's SIGBUS handler for MappedFile mappings (see the class
// comment). Faults elsewhere go to the handler it replaces. Idempotent; call it
// early in a process that serves files others may change (the daemon does).
void InstallMappedFileGuard();

// Reads `length` bytes at `offset` of an open file descriptor, retrying short reads.
// Returns DataLoss if the file ends early.
absl::Status PreadFully(int fd, uint64_t offset, std::byte* out, uint64_t length, absl::string_view path_for_errors);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_MAPPED_FILE_H_
