#include "client/parallel_copy.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "client/usable_cores.h"
#include "core/parallel_for.h"

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

void ParallelMemcpy(std::span<std::byte> out, const std::byte* from) {
  if (out.empty()) return;
  (void)CopyInPieces(out.size(), kCopyPieceBytes, [&](uint64_t at, uint64_t length) {
    std::memcpy(out.data() + at, from + at, length);
    return absl::OkStatus();
  });
}

}  // namespace weightstore::client
