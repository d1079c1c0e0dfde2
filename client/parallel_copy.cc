#include "client/parallel_copy.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "client/usable_cores.h"
#include "core/crc32c.h"
#include "core/host_buffer.h"
#include "core/mapped_file.h"
#include "core/parallel_for.h"
#include "core/status_macros.h"

namespace weightstore::client {

unsigned CopyThreads() {
  static const unsigned threads = [] {
    int n = std::min(UsableCores(), 8);
    if (const char* env = std::getenv("WEIGHTSTORE_COPY_THREADS"); env != nullptr) {
      int asked = 0;
      if (absl::SimpleAtoi(env, &asked) && asked >= 1 && asked <= 64) n = asked;
    }
    return static_cast<unsigned>(std::max(n, 1));
  }();
  return threads;
}

absl::Status CopyInPieces(uint64_t size, uint64_t piece,
                          const std::function<absl::Status(uint64_t offset, uint64_t length)>& copy) {
  piece = std::max<uint64_t>(piece, 1);
  const uint64_t pieces = size / piece + (size % piece != 0 ? 1 : 0);
  const unsigned threads = pieces >= 2 ? CopyThreads() : 1;
  return ParallelFor(static_cast<size_t>(pieces), threads, [&](size_t i) {
    const uint64_t at = static_cast<uint64_t>(i) * piece;
    return copy(at, std::min(piece, size - at));
  });
}

void ParallelMemcpy(std::span<std::byte> out, const std::byte* from, bool release_from) {
  if (out.empty()) return;
  (void)CopyInPieces(out.size(), kCopyPieceBytes, [&](uint64_t at, uint64_t length) {
    PrefaultForWriting(out.subspan(at, length));
    std::memcpy(out.data() + at, from + at, length);
    if (release_from) ReleaseCopiedPages({from + at, length});
    return absl::OkStatus();
  });
}

uint32_t CopyWithCrc32c(std::span<std::byte> out, const std::byte* from, bool release_from) {
  // Checksummed a slice at a time, right after its copy, while it is in L2.
  constexpr uint64_t kSlice = uint64_t{256} << 10;
  const uint64_t size = out.size();
  if (size == 0) return 0;
  std::vector<uint32_t> crcs(size / kCopyPieceBytes + (size % kCopyPieceBytes != 0 ? 1 : 0));
  (void)CopyInPieces(size, kCopyPieceBytes, [&](uint64_t at, uint64_t length) {
    uint32_t crc = 0;
    PrefaultForWriting(out.subspan(at, length));
    for (uint64_t done = 0; done < length;) {
      const uint64_t n = std::min(kSlice, length - done);
      std::memcpy(out.data() + at + done, from + at + done, n);
      crc = Crc32cExtend(crc, absl::string_view(reinterpret_cast<const char*>(out.data() + at + done), n));
      done += n;
    }
    crcs[at / kCopyPieceBytes] = crc;
    if (release_from) ReleaseCopiedPages({from + at, length});
    return absl::OkStatus();
  });
  uint32_t crc = crcs[0];
  for (size_t i = 1; i < crcs.size(); ++i) {
    crc = Crc32cConcat(crc, crcs[i], std::min(kCopyPieceBytes, size - i * kCopyPieceBytes));
  }
  return crc;
}

absl::StatusOr<uint32_t> ParallelPread(std::span<std::byte> out, int fd, uint64_t offset, absl::string_view what,
                                       bool checksum) {
  constexpr uint64_t kSlice = uint64_t{256} << 10;
  const uint64_t size = out.size();
  if (size == 0) return 0;
  std::vector<uint32_t> crcs(size / kCopyPieceBytes + (size % kCopyPieceBytes != 0 ? 1 : 0));
  WEIGHTSTORE_RETURN_IF_ERROR(CopyInPieces(size, kCopyPieceBytes, [&](uint64_t at, uint64_t length) -> absl::Status {
    uint32_t crc = 0;
    PrefaultForWriting(out.subspan(at, length));
    for (uint64_t done = 0; done < length;) {
      const uint64_t n = std::min(kSlice, length - done);
      std::byte* to = out.data() + at + done;
      WEIGHTSTORE_RETURN_IF_ERROR(PreadFully(fd, offset + at + done, to, n, what));
      if (checksum) crc = Crc32cExtend(crc, absl::string_view(reinterpret_cast<const char*>(to), n));
      done += n;
    }
    crcs[at / kCopyPieceBytes] = crc;
    return absl::OkStatus();
  }));
  if (!checksum) return 0;
  uint32_t crc = crcs[0];
  for (size_t i = 1; i < crcs.size(); ++i) {
    crc = Crc32cConcat(crc, crcs[i], std::min(kCopyPieceBytes, size - i * kCopyPieceBytes));
  }
  return crc;
}

void ReleaseCopiedPages(std::span<const std::byte> source) {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t start = reinterpret_cast<uintptr_t>(source.data());
  const uintptr_t first = (start + page - 1) / page * page;
  const uintptr_t end = (start + source.size()) / page * page;
  // Advice only: a failure leaves the pages mapped, which costs memory, not
  // correctness.
  if (end > first) (void)::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

}  // namespace weightstore::client
