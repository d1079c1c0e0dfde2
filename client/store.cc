#include "client/store.h"

#include <malloc.h>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace weightstore::client {

absl::StatusOr<std::span<std::byte>> CollectingSink::Begin(const TensorSpec& spec) {
  if (cancel_ != nullptr && cancel_->load()) {
    return absl::CancelledError(absl::StrCat("the fetch was cancelled before tensor '", spec.name, "'"));
  }
  if (current_patch_) return absl::FailedPreconditionError("Begin while a patch is open");
  if (open_.size() >= kOpenAhead) return absl::FailedPreconditionError("Begin past OpenAhead() tensors");
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(spec.byte_size()));
  open_.push_back(std::move(buffer));
  return open_.back().span();
}

absl::Status CollectingSink::End(const TensorSpec& spec) {
  if (open_.empty() || current_patch_) return absl::FailedPreconditionError("End without Begin");
  tensors_.push_back(SharedTensor{spec, std::move(open_.front()).Freeze()});
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
  if (!open_.empty()) return absl::FailedPreconditionError("BeginPatch while a tensor is open");
  WEIGHTSTORE_ASSIGN_OR_RETURN(HostBuffer buffer, HostBuffer::Allocate(bytes));
  open_.push_back(std::move(buffer));
  current_patch_ = ReceivedPatch{spec, digest, header};
  return open_.back().span();
}

absl::Status CollectingSink::EndPatch(const TensorSpec& spec) {
  if (open_.empty() || !current_patch_) return absl::FailedPreconditionError("EndPatch without BeginPatch");
  current_patch_->patch.body = std::move(open_.front()).Freeze();
  open_.pop_front();
  patches_.push_back(*std::move(current_patch_));
  current_patch_.reset();
  return absl::OkStatus();
}

absl::StatusOr<std::span<std::byte>> PlacingSink::Begin(const TensorSpec& spec) {
  if (open_placed_.size() >= OpenAhead()) return absl::FailedPreconditionError("Begin past OpenAhead() tensors");
  auto it = places_.find(spec.name);
  const bool placed = it != places_.end() && it->second.dtype == spec.dtype && it->second.shape == spec.shape &&
                      it->second.bytes.size() == spec.byte_size() &&
                      (it->second.bytes.data() != nullptr || spec.byte_size() == 0);
  if (!placed) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::span<std::byte> out, rest_.Begin(spec));
    open_placed_.push_back(false);
    return out;
  }
  if (cancel_ != nullptr && cancel_->load()) {
    return absl::CancelledError(absl::StrCat("the fetch was cancelled before tensor '", spec.name, "'"));
  }
  open_placed_.push_back(true);
  written_any_ = true;
  return it->second.bytes;
}

absl::Status PlacingSink::End(const TensorSpec& spec) {
  if (open_placed_.empty()) return absl::FailedPreconditionError("End without Begin");
  const bool placed = open_placed_.front();
  open_placed_.pop_front();
  if (!placed) return rest_.End(spec);
  placed_.push_back(spec.name);
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
