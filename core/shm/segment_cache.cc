#include "core/shm/segment_cache.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "core/shm/sealed_memfd.h"

namespace weightstore {

SegmentCache::Reservation::Reservation(Reservation&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

SegmentCache::Reservation& SegmentCache::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (cache_ != nullptr) cache_->Release(bytes_);
    cache_ = std::exchange(other.cache_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

SegmentCache::Reservation::~Reservation() {
  if (cache_ != nullptr) cache_->Release(bytes_);
}

namespace {

// What a segment of `size` bytes under `key` costs the budget.
uint64_t Charge(uint64_t size, const std::string& key) {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t pages = size / page + (size % page != 0 || size == 0 ? 1 : 0);
  return pages * page + 3 * key.size();
}

}  // namespace

bool SegmentCache::MakeRoom(uint64_t bytes, bool new_segment) {
  if (bytes > budget_) return false;
  while ((used_ + bytes > budget_ || (new_segment && lru_.size() >= max_segments_)) && !lru_.empty()) {
    const Held& oldest = lru_.back();
    used_ -= oldest.charge;
    segment_bytes_ -= oldest.size;
    lru_pos_.erase(oldest.key);
    slots_.erase(oldest.key);
    lru_.pop_back();
    ++evictions_;
  }
  return used_ + bytes <= budget_;
}

void SegmentCache::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ -= bytes;
  reserved_bytes_ -= bytes;
}

absl::StatusOr<SegmentCache::Reservation> SegmentCache::Reserve(uint64_t bytes, absl::string_view what) {
  absl::MutexLock lock(&mu_);
  if (!MakeRoom(bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " needs ", bytes, " bytes of shared memory; the budget is ",
                                                     budget_, " bytes and ", used_, " are in use"));
  }
  used_ += bytes;
  reserved_bytes_ += bytes;
  Reservation r;
  r.cache_ = this;
  r.bytes_ = bytes;
  return r;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> SegmentCache::GetOrCreate(
    const std::string& key, uint64_t size, absl::string_view what,
    const std::function<absl::Status(SegmentWriter&)>& fill) {
  std::shared_ptr<Slot> slot;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Slot>& s = slots_[key];
    if (s == nullptr) s = std::make_shared<Slot>();
    slot = s;
  }
  absl::MutexLock slot_lock(&slot->mu);
  if (slot->segment != nullptr) {
    absl::MutexLock lock(&mu_);
    ++hits_;
    if (auto it = lru_pos_.find(key); it != lru_pos_.end()) lru_.splice(lru_.begin(), lru_, it->second);
    return slot->segment;
  }
  auto forget = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto it = slots_.find(key); it != slots_.end() && it->second == slot) slots_.erase(it);
  };
  const uint64_t charge = Charge(size, key);
  {
    absl::MutexLock lock(&mu_);
    ++misses_;
    if (!MakeRoom(charge, /*new_segment=*/true)) {
      forget();
      return absl::ResourceExhaustedError(absl::StrCat(what, " needs ", size, " bytes of shared memory; the budget is ",
                                                       budget_, " bytes and ", used_, " are in use"));
    }
    used_ += charge;  // held while building
  }
  absl::StatusOr<std::shared_ptr<const MappedFile>> segment =
      CreateSealedMemfd(absl::StrCat("weightstore:", what), size, fill);
  absl::MutexLock lock(&mu_);
  if (!segment.ok()) {
    used_ -= charge;
    forget();
    return segment.status();
  }
  slot->segment = *segment;
  segment_bytes_ += size;
  lru_.push_front({key, size, charge});  // a slot being built is never evicted
  lru_pos_[key] = lru_.begin();
  return slot->segment;
}

void SegmentCache::Clear() {
  absl::MutexLock lock(&mu_);
  for (const Held& held : lru_) {
    slots_.erase(held.key);
    used_ -= held.charge;
    segment_bytes_ -= held.size;
    ++evictions_;
  }
  lru_.clear();
  lru_pos_.clear();
}

SegmentCache::Stats SegmentCache::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{budget_, segment_bytes_, reserved_bytes_, lru_.size(), hits_, misses_, evictions_};
}

}  // namespace weightstore
