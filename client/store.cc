#include "client/store.h"

#include <malloc.h>

#include <iterator>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status_macros.h"

namespace weightstore::client {

absl::StatusOr<std::span<std::byte>> CollectingSink::Begin(const TensorSpec& spec) {
  if (cancel_ != nullptr && cancel_->load()) {
    return absl::CancelledError(absl::StrCat("the fetch was cancelled before tensor '", spec.name, "'"));
  }
  // The tensor begun last, again (its transfer restarted, as a patch or
  // whole): what it had is abandoned. Only while it is the one open: a
  // store that begins tensors ahead never restarts one, and the buffers it
  // holds for the others must stay.
  const bool again = open_.size() == 1 && open_.back().first == spec.name;
  if (open_.size() > 1 && open_.back().first == spec.name) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' begun twice in a row"));
  }
  if (current_patch_ && !again) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' begun while a patch is open"));
  }
  if (!again && open_.size() >= kOpenAhead) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' begun past OpenAhead()"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(spec.byte_size()));
  if (again) open_.pop_back();
  current_patch_.reset();
  open_.emplace_back(spec.name, std::move(buffer));
  return open_.back().second.span();
}

absl::Status CollectingSink::End(const TensorSpec& spec) {
  if (open_.empty() || current_patch_ || open_.front().first != spec.name) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' ended but not begun first"));
  }
  tensors_.push_back(SharedTensor{spec, std::move(open_.front().second).Freeze()});
  open_.pop_front();
  return absl::OkStatus();
}

absl::StatusOr<std::span<std::byte>> CollectingSink::BeginPatch(const TensorSpec& spec, const ElementPatch& header,
                                                                uint64_t bytes, const std::string& digest) {
  if (!take_patches_) {
    return absl::DataLossError(
        absl::StrCat("tensor '", spec.name, "' came as an element patch, which the fetch did not ask for"));
  }
  if (cancel_ != nullptr && cancel_->load()) {
    return absl::CancelledError(absl::StrCat("the fetch was cancelled before tensor '", spec.name, "'"));
  }
  // Only with nothing else open; or the tensor begun last, again.
  const bool again = open_.size() == 1 && open_.back().first == spec.name;
  if (!open_.empty() && !again) {
    return absl::FailedPreconditionError(absl::StrCat("the patch of '", spec.name, "' begun while a tensor is open"));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(bytes));
  open_.clear();
  open_.emplace_back(spec.name, std::move(buffer));
  current_patch_ = ReceivedPatch{spec, digest, header};
  return open_.back().second.span();
}

absl::Status CollectingSink::EndPatch(const TensorSpec& spec) {
  if (open_.size() != 1 || !current_patch_ || open_.front().first != spec.name) {
    return absl::FailedPreconditionError(absl::StrCat("the patch of '", spec.name, "' ended but not begun first"));
  }
  current_patch_->patch.body = std::move(open_.front().second).Freeze();
  open_.clear();
  patches_.push_back(*std::move(current_patch_));
  current_patch_.reset();
  return absl::OkStatus();
}

bool PlacingSink::Overlaps(std::span<const std::byte> place, const std::byte* skip) const {
  const std::byte *begin = place.data(), *end = place.data() + place.size();
  // The open places do not overlap one another: from the one that starts
  // last before `place` on, while they start inside it.
  auto i = open_places_.lower_bound(begin);
  if (i != open_places_.begin()) --i;
  for (; i != open_places_.end() && i->first < end; ++i) {
    if (i->first != skip && i->second > begin) return true;
  }
  for (const auto& [b, e] : deferred_places_) {
    if (b < end && begin < e) return true;
  }
  return false;
}

absl::StatusOr<std::span<std::byte>> PlacingSink::Begin(const TensorSpec& spec) {
  auto it = places_.find(spec.name);
  const bool fits = it != places_.end() && it->second.dtype == spec.dtype && it->second.shape == spec.shape &&
                    it->second.bytes.size() == spec.byte_size() &&
                    (it->second.bytes.data() != nullptr || spec.byte_size() == 0);
  const std::span<std::byte> place = fits ? it->second.bytes : std::span<std::byte>();
  // The tensor begun last, again (its transfer restarted): it gives up what
  // it had once the checks below pass.
  const bool again = open_.size() == 1 && open_.back().name == spec.name;  // as CollectingSink's
  if (open_.size() > 1 && open_.back().name == spec.name) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' begun twice in a row"));
  }
  if (!again && open_.size() >= OpenAhead()) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' begun past OpenAhead()"));
  }
  // A place that overlaps one still open (tied parameters: two names, one
  // memory) is never written from two threads at once: that tensor goes to
  // rest_, for the caller to copy after, and so does any later one over it.
  const std::byte* own = again && open_.back().placed ? open_.back().place.data() : nullptr;
  const bool deferred = fits && !place.empty() && Overlaps(place, own);
  const bool placed = fits && !deferred;
  if (again && open_.back().placed != placed) {  // rest_ would keep a buffer no End takes
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' restarted, and placed otherwise"));
  }
  std::span<std::byte> out = place;
  if (!placed) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(out, rest_.Begin(spec));
  } else if (cancel_ != nullptr && cancel_->load()) {
    return absl::CancelledError(absl::StrCat("the fetch was cancelled before tensor '", spec.name, "'"));
  }
  // Checked: the state changes from here on.
  if (again) {
    if (open_.back().placed && !open_.back().place.empty()) open_places_.erase(open_.back().place.data());
    open_.pop_back();
  }
  if (deferred) deferred_places_.emplace_back(place.data(), place.data() + place.size());
  open_.push_back({spec.name, placed, placed ? place : std::span<std::byte>()});
  if (placed && !place.empty()) open_places_.emplace(place.data(), place.data() + place.size());
  written_any_ = written_any_ || placed;
  return out;
}

absl::Status PlacingSink::End(const TensorSpec& spec) {
  if (open_.empty() || open_.front().name != spec.name) {
    return absl::FailedPreconditionError(absl::StrCat("tensor '", spec.name, "' ended but not begun first"));
  }
  const OpenTensor ended = std::move(open_.front());
  open_.pop_front();
  if (!ended.placed) return rest_.End(spec);
  if (!ended.place.empty()) open_places_.erase(ended.place.data());
  placed_.push_back(spec.name);
  return absl::OkStatus();
}

absl::Status PlacingSink::CheckDelivered(const TensorListing& listing) {
  absl::flat_hash_map<absl::string_view, const TensorSpec*> due;
  for (const TensorDescription& t : listing.tensors) {
    if (!t.unchanged) due.emplace(t.spec.name, &t.spec);
  }
  auto take = [&](const TensorSpec& got) -> absl::Status {
    auto it = due.find(got.name);
    if (it == due.end()) {
      return absl::DataLossError(
          absl::StrCat("the fetch sent tensor '", got.name, "', which its listing does not name, or twice"));
    }
    const TensorSpec& want = *it->second;
    if (want.dtype != got.dtype || want.shape != got.shape) {
      return absl::DataLossError(absl::StrCat("tensor '", got.name, "' came as ", DTypeName(got.dtype), " [",
                                              absl::StrJoin(got.shape, ","), "], listed as ", DTypeName(want.dtype),
                                              " [", absl::StrJoin(want.shape, ","), "]"));
    }
    due.erase(it);
    return absl::OkStatus();
  };
  for (const std::string& name : placed_) {
    const Place& place = places_.at(name);
    WEIGHTSTORE_RETURN_IF_ERROR(take({name, place.dtype, place.shape}));
  }
  for (const SharedTensor& t : rest_.tensors()) WEIGHTSTORE_RETURN_IF_ERROR(take(t.spec));
  for (const ReceivedPatch& p : rest_.patches()) WEIGHTSTORE_RETURN_IF_ERROR(take(p.spec));
  for (const TensorDescription& t : listing.tensors) {
    if (due.contains(t.spec.name)) {
      return absl::DataLossError(absl::StrCat("the fetch ended without tensor '", t.spec.name, "' (and ",
                                              due.size() - 1, " more) that its listing names"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::span<std::byte>> TensorSink::BeginPatch(const TensorSpec& spec, const ElementPatch&, uint64_t,
                                                            const std::string&) {
  return absl::UnimplementedError(absl::StrCat("this sink takes no element patches (tensor '", spec.name, "')"));
}

absl::Status TensorSink::EndPatch(const TensorSpec& spec) {
  return absl::UnimplementedError(absl::StrCat("this sink takes no element patches (tensor '", spec.name, "')"));
}

void TuneAllocatorForStreaming() {
  ::mallopt(M_MMAP_THRESHOLD, 256 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 1 << 30);
  ::mallopt(M_TOP_PAD, 64 << 20);
}

TensorDescription Describe(const SnapshotTensor& tensor) {
  TensorDescription d{tensor.spec, tensor.source->spec.name, std::nullopt};
  d.scale_of = tensor.scale_of;
  d.shares_scale_blocks = tensor.shares_scale_blocks;
  d.scale_block = tensor.scale_block;
  d.quantization = tensor.quantization;
  if (!tensor.slice.empty()) {
    d.unsliced_shape = tensor.unsliced_shape();
    d.slice = tensor.slice;
  }
  return d;
}

absl::StatusOr<MappedTensors> Store::MapTensors(const std::string& name, const Query&) {
  return absl::UnimplementedError(
      absl::StrCat("this store cannot map the tensors of '", name, "': only a daemon's socket maps (unix:PATH)"));
}

absl::Status Store::Watch(const WatchOptions&, const std::function<bool(const CheckpointEvent&)>&) {
  return absl::UnimplementedError("only a daemon's checkpoints can be watched: connect to it over gRPC");
}

absl::StatusOr<CheckpointSummary> Store::Push(const std::string&, const PushRequest&) {
  return absl::UnimplementedError("only a daemon's checkpoints can be pushed to: connect to it over gRPC");
}

absl::StatusOr<std::vector<SharedTensor>> Store::FetchAll(const std::string& name, const Query& query) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(Fetched fetched, FetchVersioned(name, query));
  return std::move(fetched.tensors);
}

absl::StatusOr<Store::Fetched> Store::FetchVersioned(const std::string& name, const Query& query) {
  CollectingSink sink(query.cancel);
  WEIGHTSTORE_RETURN_IF_ERROR(FetchTensors(name, query, &sink));
  return Fetched{sink.version(), std::move(sink.tensors())};
}

absl::StatusOr<SharedTensor> Store::FetchTensor(const std::string& name, const std::string& tensor, Query query) {
  query.selection.paths = {tensor};
  query.selection.include.clear();
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<SharedTensor> tensors, FetchAll(name, query));
  if (tensors.size() != 1) {
    return absl::NotFoundError(absl::StrCat("tensor '", tensor, "' is not in checkpoint '", name, "'"));
  }
  return std::move(tensors[0]);
}

}  // namespace weightstore::client
