#include "client/parallel_copy.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>
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

absl::Status RunCopyJobs(std::span<const CopyJob> jobs) {
  // Every piece, as (job, offset), in the jobs' order.
  std::vector<std::pair<size_t, uint64_t>> pieces;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const uint64_t piece = std::max<uint64_t>(jobs[j].piece, 1);
    for (uint64_t at = 0; at < jobs[j].size; at += piece) pieces.emplace_back(j, at);
  }
  const unsigned threads = pieces.size() >= 2 ? CopyThreads() : 1;
  return ParallelFor(pieces.size(), threads, [&](size_t i) {
    const auto [j, at] = pieces[i];
    return jobs[j].copy(at, std::min(std::max<uint64_t>(jobs[j].piece, 1), jobs[j].size - at));
  });
}

absl::Status CopyInPieces(uint64_t size, uint64_t piece,
                          const std::function<absl::Status(uint64_t offset, uint64_t length)>& copy) {
  const CopyJob job{size, piece, copy};
  return RunCopyJobs(std::span(&job, 1));
}

absl::StatusOr<uint32_t> CopyPiece(std::span<std::byte> out, const CopySource& source, uint64_t at, bool checksum) {
  constexpr uint64_t kSlice = uint64_t{256} << 10;
  PrefaultForWriting(out);
  // Unchecked, the piece goes in one call; checked, a slice at a time.
  const uint64_t slice = checksum ? kSlice : std::max<uint64_t>(out.size(), 1);
  uint32_t crc = 0;
  for (uint64_t done = 0; done < out.size();) {
    const uint64_t n = std::min<uint64_t>(slice, out.size() - done);
    std::byte* to = out.data() + done;
    if (source.fd >= 0) {
      WEIGHTSTORE_RETURN_IF_ERROR(PreadFully(source.fd, source.offset + at + done, to, n, source.what));
    } else {
      std::memcpy(to, source.from + at + done, n);
    }
    if (checksum) crc = Crc32cExtend(crc, absl::string_view(reinterpret_cast<const char*>(to), n));
    done += n;
  }
  if (source.fd < 0 && source.release_from) ReleaseCopiedPages({source.from + at, out.size()});
  return crc;
}

namespace {

// CopyPiece over the whole of `out` on CopyThreads() threads; the pieces'
// CRC32Cs concatenated (0 without `checksum`).
absl::StatusOr<uint32_t> CopyAll(std::span<std::byte> out, const CopySource& source, bool checksum) {
  const uint64_t size = out.size();
  if (size == 0) return 0;
  std::vector<uint32_t> crcs(size / kCopyPieceBytes + (size % kCopyPieceBytes != 0 ? 1 : 0));
  WEIGHTSTORE_RETURN_IF_ERROR(CopyInPieces(size, kCopyPieceBytes, [&](uint64_t at, uint64_t length) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(crcs[at / kCopyPieceBytes], CopyPiece(out.subspan(at, length), source, at, checksum));
    return absl::OkStatus();
  }));
  if (!checksum) return 0;
  uint32_t crc = crcs[0];
  for (size_t i = 1; i < crcs.size(); ++i) {
    crc = Crc32cConcat(crc, crcs[i], std::min(kCopyPieceBytes, size - i * kCopyPieceBytes));
  }
  return crc;
}

}  // namespace

void ParallelMemcpy(std::span<std::byte> out, const std::byte* from, bool release_from) {
  (void)CopyAll(out, {.from = from, .release_from = release_from}, /*checksum=*/false);
}

uint32_t CopyWithCrc32c(std::span<std::byte> out, const std::byte* from, bool release_from) {
  return CopyAll(out, {.from = from, .release_from = release_from}, /*checksum=*/true).value_or(0);
}

absl::StatusOr<uint32_t> ParallelPread(std::span<std::byte> out, int fd, uint64_t offset, absl::string_view what,
                                       bool checksum) {
  return CopyAll(out, {.fd = fd, .offset = offset, .what = what}, checksum);
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
