#include "core/shm/segment_cache.h"

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

bool SegmentCache::MakeRoom(uint64_t bytes) {
  if (bytes > budget_) return false;
  while (used_ + bytes > budget_ && !lru_.empty()) {
    auto [key, size] = lru_.back();
    lru_.pop_back();
    lru_pos_.erase(key);
    slots_.erase(key);
    used_ -= size;
    segment_bytes_ -= size;
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
  {
    absl::MutexLock lock(&mu_);
    ++misses_;
    if (!MakeRoom(size)) {
      forget();
      return absl::ResourceExhaustedError(absl::StrCat(what, " needs ", size, " bytes of shared memory; the budget is ",
                                                       budget_, " bytes and ", used_, " are in use"));
    }
    used_ += size;  // held while building
  }
  absl::StatusOr<std::shared_ptr<const MappedFile>> segment =
      CreateSealedMemfd(absl::StrCat("weightstore:", what), size, fill);
  absl::MutexLock lock(&mu_);
  if (!segment.ok()) {
    used_ -= size;
    forget();
    return segment.status();
  }
  slot->segment = *segment;
  segment_bytes_ += size;
  lru_.emplace_front(key, size);  // a slot being built is never evicted
  lru_pos_[key] = lru_.begin();
  return slot->segment;
}

void SegmentCache::Clear() {
  absl::MutexLock lock(&mu_);
  for (const auto& [key, size] : lru_) {
    slots_.erase(key);
    used_ -= size;
    segment_bytes_ -= size;
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
