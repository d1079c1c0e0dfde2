// AtomicFile: writes a file so that it is either complete or absent.
//
// Data goes to a temporary sibling "<dir>/.<name>.<pid>-<n>.tmp" opened with
// O_EXCL; Commit() fsyncs it, renames it over the target (or, without overwrite,
// links it in place so an existing file is never replaced) and fsyncs the folder.
// Destroying an uncommitted AtomicFile removes the temporary. Thread-compatible.
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

  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  const std::string& path() const { return path_; }
  // The temporary file being written (valid until Commit or destruction).
  const std::string& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return written_; }

  // Appends `data`. Returns ResourceExhausted when the disk is full.
  absl::Status Append(absl::string_view data);
  // Sets the file's size (new bytes are zero); for writers that fill a planned
  // layout through fd() instead of appending.
  absl::Status Resize(uint64_t size);
  int fd() const { return fd_; }
  // Appends `n` zero bytes.
  absl::Status AppendZeros(uint64_t n);
  // Makes what was appended durable in the temporary file (fsync).
  absl::Status Flush();
  // Makes the file durable and visible at path().
  absl::Status Commit();

 private:
  AtomicFile() = default;

  std::string path_;
  std::string temp_path_;
  bool overwrite_ = false;
  bool committed_ = false;
  int fd_ = -1;
  uint64_t written_ = 0;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_ATOMIC_FILE_H_
