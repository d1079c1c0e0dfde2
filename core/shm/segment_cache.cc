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
  // Nothing is evicted for a request that cannot fit even then.
  uint64_t evictable = 0, unleased = 0;
  for (const Held& held : lru_) {
    if (held.leases > 0) continue;
    evictable += held.charge;
    ++unleased;
  }
  if (used_ - evictable + bytes > budget_ || (new_segment && lru_.size() - unleased >= max_segments_)) return false;
  auto it = lru_.end();
  while ((used_ + bytes > budget_ || (new_segment && lru_.size() >= max_segments_)) && it != lru_.begin()) {
    --it;
    if (it->leases > 0) continue;  // being filled for a request
    used_ -= it->charge;
    segment_bytes_ -= it->size;
    lru_pos_.erase(it->key);
    slots_.erase(it->key);
    it = lru_.erase(it);
    ++evictions_;
  }
  return used_ + bytes <= budget_ && !(new_segment && lru_.size() >= max_segments_);
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

std::shared_ptr<SegmentCache::Slot> SegmentCache::SlotFor(const std::string& key) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Slot>& slot = slots_[key];
  if (slot == nullptr) slot = std::make_shared<Slot>();
  return slot;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> SegmentCache::GetOrCreate(
    const std::string& key, uint64_t size, absl::string_view what,
    const std::function<absl::Status(SegmentWriter&)>& fill) {
  const std::shared_ptr<Slot> slot = SlotFor(key);
  absl::MutexLock slot_lock(&slot->mu);
  if (slot->filled != nullptr) {
    return absl::InternalError(absl::StrCat("the segment key of ", what, " names a filled segment"));
  }
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

SegmentCache::FilledLease::FilledLease(FilledLease&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)), key_(std::move(other.key_)), segment_(std::move(other.segment_)) {}

SegmentCache::FilledLease& SegmentCache::FilledLease::operator=(FilledLease&& other) noexcept {
  if (this != &other) {
    Unpin();
    cache_ = std::exchange(other.cache_, nullptr);
    key_ = std::move(other.key_);
    segment_ = std::move(other.segment_);
  }
  return *this;
}

SegmentCache::FilledLease::~FilledLease() { Unpin(); }

void SegmentCache::FilledLease::Unpin() {
  if (cache_ == nullptr) return;
  absl::MutexLock lock(&cache_->mu_);
  if (auto it = cache_->lru_pos_.find(key_); it != cache_->lru_pos_.end() && it->second->filled == segment_.get()) {
    --it->second->leases;
  }
  cache_ = nullptr;
}

absl::StatusOr<SegmentCache::FilledLease> SegmentCache::GetOrCreateFilled(const std::string& key, uint64_t size,
                                                                          absl::string_view what) {
  FilledLease lease;
  lease.key_ = key;
  for (;;) {
    const std::shared_ptr<Slot> slot = SlotFor(key);
    absl::MutexLock slot_lock(&slot->mu);
    if (slot->segment != nullptr) {
      return absl::InternalError(absl::StrCat("the segment key of ", what, " names a derived segment"));
    }
    if (slot->filled == nullptr) return CreateFilled(slot, key, size, what, std::move(lease));
    absl::MutexLock lock(&mu_);
    auto it = lru_pos_.find(key);
    if (it != lru_pos_.end() && it->second->filled == slot->filled.get()) {  // held
      ++hits_;
      ++it->second->leases;
      lru_.splice(lru_.begin(), lru_, it->second);
      lease.cache_ = this;
      lease.segment_ = slot->filled;
      return lease;
    }
    // Evicted after it was looked up (and so gone from slots_): look again.
  }
}

absl::StatusOr<SegmentCache::FilledLease> SegmentCache::CreateFilled(const std::shared_ptr<Slot>& slot,
                                                                     const std::string& key, uint64_t size,
                                                                     absl::string_view what, FilledLease lease) {
  auto forget = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (auto it = slots_.find(key); it != slots_.end() && it->second == slot) slots_.erase(it);
  };
  const uint64_t charge = Charge(0, key);
  {
    absl::MutexLock lock(&mu_);
    ++misses_;
    if (!MakeRoom(charge, /*new_segment=*/true)) {
      forget();
      return absl::ResourceExhaustedError(absl::StrCat(what, " cannot be held: the shared-memory budget is ", budget_,
                                                       " bytes, ", used_, " are in use, and at most ", max_segments_,
                                                       " segments are held"));
    }
    used_ += charge;  // held while building
  }
  absl::StatusOr<std::shared_ptr<FilledMemfd>> filled =
      FilledMemfd::Create(absl::StrCat("weightstore:", what), size, "");
  absl::MutexLock lock(&mu_);
  if (!filled.ok()) {
    used_ -= charge;
    forget();
    return filled.status();
  }
  slot->filled = *filled;
  Held held{key, 0, charge};
  held.filled = slot->filled.get();
  held.leases = 1;
  lru_.push_front(std::move(held));
  lru_pos_[key] = lru_.begin();
  lease.cache_ = this;
  lease.segment_ = slot->filled;
  return lease;
}

absl::Status SegmentCache::Grow(const FilledLease& lease, uint64_t bytes, absl::string_view what) {
  absl::MutexLock lock(&mu_);
  auto it = lru_pos_.find(lease.key_);
  if (lease.cache_ != this || it == lru_pos_.end() || it->second->filled != lease.segment_.get()) {
    return absl::AbortedError(absl::StrCat(what, ": its segment was dropped from the cache; ask again"));
  }
  if (!MakeRoom(bytes)) {  // never evicts this one: it is leased
    return absl::ResourceExhaustedError(absl::StrCat(what, " needs ", bytes,
                                                     " more bytes of shared memory; the budget is ", budget_,
                                                     " bytes and ", used_, " are in use"));
  }
  used_ += bytes;
  segment_bytes_ += bytes;
  it->second->size += bytes;
  it->second->charge += bytes;
  return absl::OkStatus();
}

void SegmentCache::Clear() {
  absl::MutexLock lock(&mu_);
  for (auto it = lru_.begin(); it != lru_.end();) {
    if (it->leases > 0) {  // being filled: it goes once released, as any other
      ++it;
      continue;
    }
    slots_.erase(it->key);
    lru_pos_.erase(it->key);
    used_ -= it->charge;
    segment_bytes_ -= it->size;
    ++evictions_;
    it = lru_.erase(it);
  }
}

SegmentCache::Stats SegmentCache::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{budget_, segment_bytes_, reserved_bytes_, lru_.size(), hits_, misses_, evictions_};
}

}  // namespace weightstore
