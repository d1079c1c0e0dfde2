#include "server/fetch_stream.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/element_patch.h"
#include "core/select/served.h"
#include "core/select/snapshot.h"
#include "core/status_macros.h"
#include "proto/codec/chunk_codec.h"
#include "server/observability.h"
#include "server/proto_convert.h"
#include "server/resolve.h"

namespace weightstore::server {

namespace {

// Streams one FetchTensors response, one chunk in flight at a time: gRPC's flow
// control paces it, so a client that stops reading holds at most one chunk.
class FetchReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchReactor(const Serving& serving, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request)
      : serving_(serving) {
    absl::Status status = Start(ctx, request);
    // A checkpoint the daemon lacks is pulled first (read-through), on the
    // pull's own thread: this one returns to gRPC. Meanwhile the stream holds
    // a waiting slot, not a serving one, and takes that once the pull is done.
    const bool waits = status.ok() && serving_.puller != nullptr && serving_.registry->Get(request_.name()) == nullptr;
    if (status.ok()) status = waits ? AdmitWaiting(ctx) : AdmitServing(ctx);
    if (!status.ok()) {
      Done(serving_.client_status(status));
      return;
    }
    if (serving_.puller == nullptr) {
      Begin();
      return;
    }
    // Present a moment ago, it may be evicted before the pull asks: a serving
    // slot held meanwhile is kept from the stall watchdog.
    watch_.Busy();
    pull_ticket_ = serving_.puller->PullAsync(request_.name(), [this, ctx](absl::StatusOr<PullResult> pulled) {
      waiting_.Release();
      watch_.Resume();
      absl::Status admitted = pulled.ok() ? (slot_ ? absl::OkStatus() : AdmitServing(ctx)) : pulled.status();
      if (!admitted.ok()) {
        Done(serving_.client_status(admitted));
        return;
      }
      Begin();
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Done(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    watch_.Progress(last_write_bytes_);
    Next();
  }
  void OnCancel() override {
    cancelled_ = true;
    // Waiting on a pull: stop waiting (a stale ticket does nothing).
    if (serving_.puller != nullptr) serving_.puller->Abandon(request_.name(), pull_ticket_);
  }
  void OnDone() override { delete this; }  // the slots go with their tickets

 private:
  absl::Status Start(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw) {
    ctx_ = ctx;
    if (absl::Status s = serving_.admit(*ctx, Scope::kRead); !s.ok()) return s;
    if (!wire::ParseMessage(*raw, &request_)) return absl::InvalidArgumentError("request is not a FetchTensorsRequest");
    Annotate(ctx, request_.name());
    return absl::OkStatus();
  }
  // A serving slot, watched: a stream whose client stops reading is
  // cancelled by the stall watchdog, and its slot (and its share of its
  // client's) freed as it ends.
  absl::Status AdmitServing(grpc::CallbackServerContext* ctx) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(slot_, serving_.streams->Admit(ctx->peer()));
    watch_ = serving_.stalls->Watch(ctx->peer(), *serving_.stream_limits, [ctx] { ctx->TryCancel(); });
    return absl::OkStatus();
  }
  // A waiting slot, kept from the stall watchdog: the pull is watched, not
  // the stream, which moves nothing until the checkpoint is here.
  absl::Status AdmitWaiting(grpc::CallbackServerContext* ctx) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(waiting_, serving_.pull_waits->Admit(ctx->peer()));
    return absl::OkStatus();
  }

  // Resolves the request and starts writing, or finishes with its error: at
  // once for a plain selection, on a selection worker for a costly one.
  // Meanwhile the stream is kept from the stall watchdog: its selection is
  // bounded by its own budgets.
  void Begin() {
    watch_.Busy();
    serving_.resolve_async(*ctx_, request_.name(), request_.selection(), request_.version(), request_.since_version(),
                           [this](absl::StatusOr<Resolved> resolved) {
                             watch_.Resume();
                             absl::Status status = resolved.ok() ? Accept(*std::move(resolved)) : resolved.status();
                             if (!status.ok()) {
                               Done(serving_.client_status(status));
                               return;
                             }
                             Next();
                           });
  }

  // Takes the resolved request: the range of tensors to send, the chunk size.
  absl::Status Accept(Resolved resolved) {
    resolved_ = std::move(resolved);
    chunk_bytes_ = request_.chunk_bytes() == 0 ? serving_.options->chunk_bytes
                                               : std::min<uint32_t>(request_.chunk_bytes(), 4 << 20);
    // A multiple of 64 bytes, so a chunk of a transformed tensor ends on a
    // served unit whatever its dtype (the largest: four F6 cast to F64, 32).
    chunk_bytes_ = std::max<uint32_t>(chunk_bytes_, 4096) & ~uint32_t{63};
    index_ = request_.start_index();
    end_ = request_.end_index() == 0 ? resolved_.snapshot->size()
                                     : std::min<uint64_t>(request_.end_index(), resolved_.snapshot->size());
    if (index_ > end_) {
      return absl::OutOfRangeError(absl::StrCat("start_index ", index_, " is past end_index ", end_, " (",
                                                resolved_.snapshot->size(), " selected tensors)"));
    }
    if (request_.patches()) {
      PatchesFound found = FindPatches(*serving_.registry, resolved_);
      patches_ = std::move(found.chain);
      patch_reason_ = std::move(found.reason);
    }
    return absl::OkStatus();
  }

  // Writes the next chunk, or finishes.
  void Next() {
    if (cancelled_) {
      Done(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
      return;
    }
    const Snapshot& snapshot = *resolved_.snapshot;
    if (offset_ == 0) {  // a delta leaves out what the client holds
      while (index_ < end_ && resolved_.Unchanged(snapshot.tensors()[index_])) ++index_;
    }
    if (index_ >= end_) {
      if (!sent_any_) {  // an empty selection still tells the client its version
        v1::TensorChunk chunk;
        SetStreamFields(&chunk);
        chunk.set_last(true);
        buffer_ = wire::EncodeChunk(chunk, SharedBytes());
        sent_any_ = true;
        last_write_bytes_ = buffer_.Length();
        StartWrite(&buffer_);
        return;
      }
      Done(grpc::Status::OK);
      return;
    }
    v1::TensorChunk chunk;
    if (offset_ == 0) {
      // Byte ranges go out as slices of the mapping; the others are produced
      // a chunk at a time, so a stream never holds a whole one.
      plan_ = PlanServedTensor(snapshot, snapshot.tensors()[index_]);
      patch_ = std::nullopt;
      if (composed_) {
        patch_ = *std::move(composed_);
        composed_.reset();
      } else if (!TryServedPatch(patches_.get(), snapshot, plan_, &patch_)) {
        if (serving_.compositions == nullptr) {
          patch_ = ServedPatch(patches_.get(), snapshot, plan_);
        } else if (ComposeElsewhere()) {
          return;  // Next() again once composed
        }          // else no worker took it: the tensor goes whole
      }
      bytes_ = SharedBytes();
      if (patch_) {
        bytes_ = patch_->body;
      } else if (plan_.is_byte_range()) {
        absl::StatusOr<SharedBytes> view = ReadServedView(snapshot, plan_);
        if (!view.ok()) {
          Done(serving_.client_status(view.status()));
          return;
        }
        bytes_ = *std::move(view);
      }
      cached_crc_ = patch_ ? std::nullopt : resolved_.version->checksums().Find(plan_.key);
      crc_ = 0;
      resolved_.Describe(*plan_.tensor, chunk.mutable_info());
      if (patch_) ToProto(*patch_, chunk.mutable_info()->mutable_patch());
      if (!sent_any_) SetStreamFields(&chunk);
    }
    const bool whole_bytes = patch_.has_value() || plan_.is_byte_range();
    const uint64_t size = patch_ ? patch_->body.size() : plan_.byte_size;
    // A produced tensor goes in whole served units (an F6 unit is 3 bytes),
    // a transposed one in whole served rows when a row fits in a chunk:
    // those are made by tiles, other ranges an element at a time.
    uint64_t step = chunk_bytes_;
    if (!whole_bytes) {
      const uint64_t pieces = ServedPieceBytes(plan_, chunk_bytes_);
      if (pieces <= chunk_bytes_ || !plan_.transpose) step = pieces;
    }
    const uint64_t n = std::min<uint64_t>(step, size - offset_);
    SharedBytes payload;
    if (whole_bytes) {
      payload = bytes_.Subspan(offset_, n);
    } else {
      absl::StatusOr<SharedBytes> produced = Produce(snapshot, n);
      if (!produced.ok()) {
        Done(serving_.client_status(produced.status()));
        return;
      }
      payload = *std::move(produced);
    }
    if (!cached_crc_) crc_ = Crc32cExtend(crc_, payload.view());
    const bool last = offset_ + n == size;
    chunk.set_tensor_index(index_);
    chunk.set_offset(offset_);
    if (last) {
      // The checksum vouches for what was read: not if the file changed under it.
      if (absl::Status unchanged = resolved_.version->CheckUnchanged(); !unchanged.ok()) {
        Done(serving_.client_status(unchanged));
        return;
      }
      const uint32_t crc = cached_crc_.value_or(crc_);
      chunk.set_last(true);
      chunk.set_crc32c(crc);
      if (!cached_crc_ && !patch_) (void)resolved_.version->checksums().Store(plan_.key, crc);
    }
    buffer_ =
        serving_.options->zero_copy ? wire::EncodeChunk(chunk, payload) : wire::EncodeChunkCopying(chunk, payload);
    sent_any_ = true;
    sent_bytes_ += n;
    last_write_bytes_ = buffer_.Length();
    if (last) {
      ++index_;
      offset_ = 0;
      bytes_ = SharedBytes();
    } else {
      offset_ += n;
    }
    StartWrite(&buffer_);
  }

  // Has a composition worker make the current tensor's patch, and Next()
  // again from there: a stream waiting for a composition (its own, or
  // another stream's of the same tensor) holds no gRPC thread, and is kept
  // from the stall watchdog meanwhile. False when no worker takes it (the
  // queue is full): the tensor then goes whole.
  bool ComposeElsewhere() {
    watch_.Busy();
    absl::Status queued = serving_.compositions->Post([this](absl::Status runnable) {
      watch_.Resume();
      if (!runnable.ok()) {
        Done(serving_.client_status(runnable));
        return;
      }
      composed_.emplace(cancelled_ ? std::nullopt : ServedPatch(patches_.get(), *resolved_.snapshot, plan_));
      Next();
    });
    if (queued.ok()) return true;
    watch_.Resume();
    return false;
  }

  // What a stream's first chunk carries: its version, and how a since_version
  // was used.
  void SetStreamFields(v1::TensorChunk* chunk) const {
    chunk->set_version(resolved_.version->version());
    if (!resolved_.since_version.empty()) {
      *chunk->mutable_delta() = resolved_.DeltaInfo(request_.start_index(), end_);
      chunk->mutable_delta()->set_patch_reason(patch_reason_);
    }
  }

  // The next `n` bytes of a transformed tensor, in one of two chunk buffers
  // that take turns: gRPC has let go of a buffer by the time it is reused (one
  // write is in flight at a time), else a new one is made.
  absl::StatusOr<SharedBytes> Produce(const Snapshot& snapshot, uint64_t n) {
    std::shared_ptr<std::vector<std::byte>>& buffer = buffers_[next_buffer_];
    next_buffer_ ^= 1;
    if (buffer == nullptr || buffer.use_count() > 1) buffer = std::make_shared<std::vector<std::byte>>();
    buffer->resize(n);
    absl::Status status = MaterializeServed(snapshot, plan_, offset_, *buffer);
    if (!status.ok()) return status;
    return SharedBytes(buffer, *buffer);
  }

  // Finishes, telling the request log how many tensor bytes were sent.
  void Done(const grpc::Status& status) {
    if (ctx_ != nullptr) ctx_->AddTrailingMetadata(kBytesTrailer, std::to_string(sent_bytes_));
    // Free before the client can see the status: one that starts its next
    // stream when this one ends must find the slot free (OnDone runs later).
    watch_.Unwatch();
    slot_.Release();
    waiting_.Release();
    Finish(status);
  }

  const Serving& serving_;
  grpc::CallbackServerContext* ctx_ = nullptr;
  uint64_t sent_bytes_ = 0;
  GateTicket slot_;               // a serving slot, once admitted to serve
  StallWatchdog::Watched watch_;  // while it holds slot_
  GateTicket waiting_;            // a waiting slot, while it waits on a pull
  uint64_t pull_ticket_ = 0;      // from the puller, while the checkpoint is pulled
  uint64_t last_write_bytes_ = 0;
  std::atomic<bool> cancelled_{false};
  v1::FetchTensorsRequest request_;
  Resolved resolved_;
  uint32_t chunk_bytes_ = 1 << 20;
  uint64_t index_ = 0, end_ = 0, offset_ = 0;
  ServedTensorPlan plan_;                      // of the current tensor
  SharedBytes bytes_;                          // the current tensor (or its patch), when it is a byte range
  std::shared_ptr<const PatchChain> patches_;  // with request_.patches, from the since version
  std::string patch_reason_;                   // why there are none
  std::optional<ElementPatch> patch_;          // the current tensor's, when it goes as one
  // The current tensor's patch, once a composition worker decided it.
  std::optional<std::optional<ElementPatch>> composed_;
  std::shared_ptr<std::vector<std::byte>> buffers_[2];
  int next_buffer_ = 0;
  uint32_t crc_ = 0;
  std::optional<uint32_t> cached_crc_;
  bool sent_any_ = false;
  grpc::ByteBuffer buffer_;
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* StreamTensors(const Serving& serving, grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request) {
  return new FetchReactor(serving, ctx, request);
}

}  // namespace weightstore::server
