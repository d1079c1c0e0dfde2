// Sealed memfds: anonymous, immutable shared memory that can be handed to other
// processes as a descriptor (reliability-and-ecosystem.md §5.1).
//
// A segment is written once through a private writable mapping, unmapped, then
// sealed against writes, growth, shrinking and further sealing. From then on
// nobody, the daemon included, can change its bytes; its pages are freed when
// the last descriptor and mapping are gone, so no name can leak and a crash
// leaves nothing behind.
#ifndef WEIGHTSTORE_CORE_SHM_SEALED_MEMFD_H_
#define WEIGHTSTORE_CORE_SHM_SEALED_MEMFD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "core/mapped_file.h"

namespace weightstore {

// The seals every segment carries: F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
// F_SEAL_SEAL.
int RequiredSeals();

// Creates a memfd of `size` bytes named `name` (shown in /proc/PID/maps),
// lets `fill` write it, seals it and returns it mapped read-only, with path()
// `path` ("memfd:<name>" when empty). `fill` must write every byte it cares
// about (the rest are zero). Returns the error of `fill`, or ResourceExhausted
// if the memory cannot be had.
absl::StatusOr<std::shared_ptr<const MappedFile>> CreateSealedMemfd(
    const std::string& name, uint64_t size, const std::function<absl::Status(std::span<std::byte>)>& fill,
    std::string path = "");

// Writes a memfd being filled, by pwrite: no page of it is mapped while it is
// filled, so nothing faults, and the kernel allocates pages as it copies (the
// fastest way to fill shared memory; shm_bench measures it). Write() may be
// called from several threads at once for disjoint ranges.
class SegmentWriter {
 public:
  SegmentWriter(int fd, uint64_t size, std::string name) : fd_(fd), size_(size), name_(std::move(name)) {}
  // Writes `bytes` at `offset`. Returns InternalError if they do not fit the
  // segment, ResourceExhausted (or the errno's status) if memory runs out.
  absl::Status Write(uint64_t offset, std::span<const std::byte> bytes);
  uint64_t size() const { return size_; }

 private:
  int fd_;
  uint64_t size_;
  std::string name_;
};

// As above, but `fill` writes the segment through a SegmentWriter instead of a
// mapping.
absl::StatusOr<std::shared_ptr<const MappedFile>> CreateSealedMemfd(
    const std::string& name, uint64_t size, const std::function<absl::Status(SegmentWriter&)>& fill,
    std::string path = "");

// memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING), with `name` cut to the
// kernel's 249 bytes (a longer one fails). The caller owns the result; -1
// and errno on failure.
int CreateSealableMemfd(const std::string& name);

// Returns OK if `fd` is a memfd carrying every RequiredSeals(); otherwise
// FailedPrecondition naming `what` and the missing seals.
absl::Status CheckSealed(int fd, absl::string_view what);

// Opens a new read-only descriptor for the same memfd or file as `fd` (through
// /proc/self/fd), so that what is handed out cannot write even before sealing.
// The caller owns the result.
absl::StatusOr<int> ReopenReadOnly(int fd, absl::string_view what);

// Copies the file at `path` into a sealed memfd (for models on network storage,
// where mmap page faults are slow). The result's path() is `path`.
absl::StatusOr<std::shared_ptr<const MappedFile>> PreloadFile(const std::string& path);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_SHM_SEALED_MEMFD_H_
