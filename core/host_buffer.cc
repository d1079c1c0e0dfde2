#include "core/host_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "core/status_util.h"

namespace weightstore {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// True when a virtio balloon device offers free page reporting (feature bit
// 5, VIRTIO_BALLOON_F_REPORTING): the guest then hands free blocks of huge
// page size back to the host, which must back each again at its first touch.
bool FreePageReporting() {
  std::error_code ec;
  for (const auto& device : std::filesystem::directory_iterator("/sys/bus/virtio/drivers/virtio_balloon", ec)) {
    if (device.path().filename().string().rfind("virtio", 0) != 0) continue;
    std::ifstream features(device.path() / "features");
    std::string bits;
    if (features >> bits && bits.size() > 5 && bits[5] == '1') return true;
  }
  return false;
}

// Read once. WEIGHTSTORE_HUGE_PAGES=1 or 0 sets it; otherwise huge pages are
// advised unless the machine reports its free pages to a hypervisor.
bool AdviseHugePages() {
  static const bool advise = [] {
    const char* value = std::getenv("WEIGHTSTORE_HUGE_PAGES");
    if (value != nullptr && std::string_view(value) == "0") return false;
    if (value != nullptr && std::string_view(value) == "1") return true;
    return !FreePageReporting();
  }();
  return advise;
}

// Linux's value where the C library's headers predate it (glibc 2.36 has it).
#ifdef MADV_POPULATE_WRITE
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;
#endif

}  // namespace

void PrefaultForWriting(std::span<std::byte> range) {
  constexpr size_t kWorthACall = size_t{64} << 10;
  // WEIGHTSTORE_PREFAULT=0 turns it off (to measure it), as does a kernel
  // without the advice (before 5.14) or a sandbox that refuses madvise.
  static std::atomic<bool> off{[] {
    const char* value = std::getenv("WEIGHTSTORE_PREFAULT");
    return value != nullptr && std::string_view(value) == "0";
  }()};
  if (range.size() < kWorthACall || off.load(std::memory_order_relaxed)) return;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(range.data());
  const uintptr_t start = begin / page * page;
  const uintptr_t end = (begin + range.size() + page - 1) / page * page;
  const int saved_errno = errno;  // advice only: the caller's errno is kept
  // Memory written before (a model's parameters) is skipped, judged by the
  // first page wholly inside the range (a page shared with what lies before
  // it, such as an allocator's header or the previous piece, says nothing):
  // populating present pages walks each of them, which costs about as much
  // as writing them.
  const uintptr_t probe = (begin + page - 1) / page * page;
  unsigned char present = 0;
  if (::mincore(reinterpret_cast<void*>(probe), page, &present) == 0 && (present & 1) != 0) {
    errno = saved_errno;
    return;
  }
  if (::madvise(reinterpret_cast<void*>(start), end - start, kPopulateWrite) != 0) {
    if (errno == ENOSYS || errno == EPERM) {  // a seccomp filter: no call will do better
      off.store(true, std::memory_order_relaxed);
    } else if (errno == EINVAL) {
      // EINVAL is also a range the kernel will not populate (a device or
      // PFN mapping, a read-only one), so only an unknown advice turns it
      // off: probed once.
      static const bool known = [] {
        void* p = ::mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return true;
        const bool ok = ::madvise(p, page, kPopulateWrite) == 0;
        ::munmap(p, page);
        return ok;
      }();
      if (!known) off.store(true, std::memory_order_relaxed);
    }
  }
  errno = saved_errno;
}

// Every HostBuffer's owner is released by this deleter: what SoleWritable
// recognizes.
struct HostBuffer::Release {
  size_t mapped_length = 0;  // 0: from the heap
  void operator()(void* p) const {
    if (mapped_length > 0) {
      ::munmap(p, mapped_length);
    } else {
      std::free(p);
    }
  }
};

std::span<std::byte> HostBuffer::SoleWritable(const SharedBytes& bytes) {
  if (bytes.empty() || bytes.owner().use_count() != 1 || std::get_deleter<Release>(bytes.owner()) == nullptr) {
    return {};
  }
  return std::span<std::byte>(const_cast<std::byte*>(bytes.data()), bytes.size());
}

absl::StatusOr<HostBuffer> HostBuffer::Allocate(size_t size) {
  HostBuffer buffer;
  if (size < kHugePage) {
    void* p = std::aligned_alloc(64, (size + 63) / 64 * 64 + 64);
    if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", size, " bytes"));
    buffer.owner_ = std::shared_ptr<void>(p, Release{});
    buffer.span_ = std::span<std::byte>(static_cast<std::byte*>(p), size);
    return buffer;
  }
  // No address space holds this much: refused before the rounding below
  // wraps (a size a peer sent, near 2^64, must not become a small mapping).
  if (size > (size_t{1} << 56)) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", size, " bytes: more than 2^56"));
  }
  // Over-allocate by one huge page and trim, so the buffer starts 2 MiB-aligned.
  const size_t rounded = (size + kHugePage - 1) / kHugePage * kHugePage;
  const size_t length = rounded + kHugePage;
  void* raw = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return StatusFromErrno(errno, absl::StrCat("cannot allocate ", size, " bytes"));
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) ::munmap(raw, aligned - start);
  const uintptr_t end = start + length, used_end = aligned + rounded;
  if (end > used_end) ::munmap(reinterpret_cast<void*>(used_end), end - used_end);
  if (AdviseHugePages()) ::madvise(reinterpret_cast<void*>(aligned), rounded, MADV_HUGEPAGE);
  void* base = reinterpret_cast<void*>(aligned);
  buffer.owner_ = std::shared_ptr<void>(base, Release{rounded});
  buffer.span_ = std::span<std::byte>(static_cast<std::byte*>(base), size);
  return buffer;
}

SharedBytes HostBuffer::Freeze() && {
  SharedBytes bytes(std::move(owner_), span_);
  span_ = {};
  return bytes;
}

}  // namespace weightstore
