// AtomicFile: writes a file so that it is either complete or absent.
//
// Data goes to a temporary sibling ".<name>.<pid>-<n>.tmp", created with O_EXCL
// in the folder the file will live in, which is held open: everything after
// Create() happens relative to that folder, so swapping a path component for a
// symlink meanwhile cannot move the file elsewhere. Commit() fsyncs it,
// renames it over the target (or, without overwrite, links it in place so an
// existing file is never replaced) and fsyncs the folder. Destroying an
// uncommitted AtomicFile removes the temporary. The temporary is flock()ed
// while it exists: IsAbandonedTemporary() tells one left by a killed writer
// from one being written. Thread-compatible.
#ifndef WEIGHTSTORE_CORE_ATOMIC_FILE_H_
#define WEIGHTSTORE_CORE_ATOMIC_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightstore {

class AtomicFile {
 public:
  // Creates the temporary sibling of `path`. With overwrite false, returns
  // AlreadyExists if `path` exists now (it is checked again at Commit()).
  static absl::StatusOr<std::unique_ptr<AtomicFile>> Create(const std::string& path, bool overwrite);
  // As Create, for the file `name` inside the open folder `folder_fd` (which
  // is duplicated; the caller keeps its own). `path` names the file in
  // messages. REQUIRES: `name` has no '/'.
  static absl::StatusOr<std::unique_ptr<AtomicFile>> CreateAt(int folder_fd, const std::string& name,
                                                              const std::string& path, bool overwrite);

  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  const std::string& path() const { return path_; }
  // The temporary file being written, for messages (valid until Commit or
  // destruction); fd() is the file itself.
  const std::string& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return written_; }

  // Appends `data`. Returns ResourceExhausted when the disk is full.
  absl::Status Append(absl::string_view data);
  // Sets the file's size (new bytes are zero); for writers that fill a planned
  // layout through fd() instead of appending.
  absl::Status Resize(uint64_t size);
  int fd() const { return fd_; }
  // Makes the temporary, while nothing was written to it, a copy of the open
  // file `from`, which must be `size` bytes: sharing its extents where the
  // filesystem can (FICLONE: XFS, btrfs), else, if `copy` allows, copied
  // inside the kernel (copy_file_range), so the bytes never cross into this
  // process. Returns how: kCloned, kCopied, or kUnsupported with the
  // temporary still empty (different filesystems, a kernel without either,
  // or a copy not allowed). DataLoss if `from` is not `size` bytes. After a
  // clone or copy, write through fd() at offsets (pwrite), not Append.
  enum class CloneResult { kCloned, kCopied, kUnsupported };
  absl::StatusOr<CloneResult> CloneFrom(int from, uint64_t size, bool copy = true);
  // Appends `n` zero bytes.
  absl::Status AppendZeros(uint64_t n);
  // Makes what was appended durable in the temporary file (fsync).
  absl::Status Flush();
  // Makes the file durable and visible at path().
  absl::Status Commit();

 private:
  AtomicFile() = default;

  std::string path_;
  std::string name_;       // of the target, inside the folder
  std::string temp_name_;  // of the temporary, inside the folder
  std::string temp_path_;
  bool overwrite_ = false;
  bool committed_ = false;
  int folder_fd_ = -1;
  int fd_ = -1;
  uint64_t written_ = 0;
};

// True when `filename` has the form of an AtomicFile temporary.
bool IsAtomicFileTemporary(absl::string_view filename);

// True when the temporary `name` in `folder_fd` was left by a writer that is
// gone: nobody holds its lock, and it was last written `min_age_seconds` or
// more ago. False for a temporary being written, and on any doubt.
bool IsAbandonedTemporary(int folder_fd, const std::string& name, int64_t min_age_seconds);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_ATOMIC_FILE_H_
