#include "server/fetch_stream.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/crc32c.h"
#include "core/element_patch.h"
#include "core/select/served.h"
#include "core/select/snapshot.h"
#include "core/status_macros.h"
#include "proto/codec/chunk_codec.h"
#include "proto/codec/data_lane.h"
#include "server/data_lane.h"
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
    if (lane_) {  // the ticket: the lane does the rest
      if (!ok) Cancel();
      LaneEvent(std::nullopt);
      return;
    }
    if (!ok) {
      Done(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
      return;
    }
    watch_.Progress(last_write_bytes_);
    Next();
  }
  void OnCancel() override { Cancel(); }
  void Cancel() {
    cancelled_ = true;
    {
      absl::MutexLock lock(&lane_mu_);
      cancel_seen_ = true;
      if (lane_ticket_.has_value()) serving_.lane->Withdraw(*lane_ticket_);
    }
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
    // A delta goes on the stream: it is small, and may wait on compositions.
    lane_wanted_ = serving_.lane != nullptr && request_.data_lane() && request_.since_version().empty();
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
    if (TryLane()) return;
    v1::TensorChunk chunk;
    SharedBytes payload;
    absl::StatusOr<Step> step = Prepare(&chunk, &payload);
    if (!step.ok()) {
      Done(serving_.client_status(step.status()));
      return;
    }
    if (*step == Step::kComposing) return;  // Next() again once composed
    if (*step == Step::kEnd) {
      Done(grpc::Status::OK);
      return;
    }
    buffer_ =
        serving_.options->zero_copy ? wire::EncodeChunk(chunk, payload) : wire::EncodeChunkCopying(chunk, payload);
    last_write_bytes_ = buffer_.Length();
    StartWrite(&buffer_);
  }

  enum class Step { kChunk, kEnd, kComposing };

  // The stream's next chunk (`chunk` without its data, `payload`), its end,
  // or kComposing when a composition worker took the current tensor's patch.
  absl::StatusOr<Step> Prepare(v1::TensorChunk* out, SharedBytes* out_payload) {
    v1::TensorChunk& chunk = *out;
    const Snapshot& snapshot = *resolved_.snapshot;
    if (offset_ == 0) {  // a delta leaves out what the client holds
      while (index_ < end_ && resolved_.Unchanged(snapshot.tensors()[index_])) ++index_;
    }
    if (index_ >= end_) {
      if (sent_any_) return Step::kEnd;
      // An empty selection still tells the client its version.
      SetStreamFields(&chunk);
      chunk.set_last(true);
      sent_any_ = true;
      *out_payload = SharedBytes();
      return Step::kChunk;
    }
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
          return Step::kComposing;
        }  // else no worker took it: the tensor goes whole
      }
      bytes_ = SharedBytes();
      if (patch_) {
        bytes_ = patch_->body;
      } else if (plan_.is_byte_range()) {
        WEIGHTSTORE_ASSIGN_OR_RETURN(bytes_, ReadServedView(snapshot, plan_));
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
      WEIGHTSTORE_ASSIGN_OR_RETURN(payload, Produce(snapshot, n));
    }
    if (!cached_crc_) crc_ = Crc32cExtend(crc_, payload.view());
    const bool last = offset_ + n == size;
    chunk.set_tensor_index(index_);
    chunk.set_offset(offset_);
    if (last) {
      // The checksum vouches for what was read: not if the file changed under it.
      WEIGHTSTORE_RETURN_IF_ERROR(resolved_.version->CheckUnchanged());
      const uint32_t crc = cached_crc_.value_or(crc_);
      chunk.set_last(true);
      chunk.set_crc32c(crc);
      if (!cached_crc_ && !patch_) (void)resolved_.version->checksums().Store(plan_.key, crc);
    }
    sent_any_ = true;
    sent_bytes_ += n;
    if (last) {
      ++index_;
      offset_ = 0;
      bytes_ = SharedBytes();
    } else {
      offset_ += n;
    }
    *out_payload = std::move(payload);
    return Step::kChunk;
  }

  // With the lane asked for and offered: writes the stream's one message, its
  // ticket, and returns true. The lane's connection then carries every chunk
  // (RunLane, on a thread of its own), and the stream ends once both the
  // ticket's write and the lane are done (LaneEvent): whichever comes second
  // finishes it, so neither side outlives the other's callback.
  bool TryLane() {
    if (!lane_wanted_) return false;
    lane_wanted_ = false;
    std::optional<std::string> peer = wire::GrpcPeerIp(ctx_->peer());
    if (!peer) return false;  // not over TCP: the stream carries the bytes
    absl::StatusOr<std::string> proof = wire::RandomLaneSecret();
    if (!proof.ok()) return false;
    // What the writer thread reads is set before the lane can call back.
    const uint32_t stream_chunk_bytes = chunk_bytes_;
    chunk_bytes_ = request_.chunk_bytes() == 0 ? static_cast<uint32_t>(wire::kMaxLaneDataBytes) : chunk_bytes_;
    lane_proof_ = *std::move(proof);
    sent_any_ = true;  // the ticket's message carries the stream's fields
    lane_ = true;
    watch_.Busy();  // until the connection comes, within the ticket's life
    absl::StatusOr<std::string> ticket =
        serving_.lane->Offer(*peer, [this](absl::StatusOr<UniqueFd> fd) { LaneAttached(std::move(fd)); });
    if (!ticket.ok()) {  // the lane has stopped: the stream carries the bytes
      chunk_bytes_ = stream_chunk_bytes;
      sent_any_ = lane_ = false;
      watch_.Resume();
      return false;
    }
    v1::TensorChunk chunk;
    SetStreamFields(&chunk);
    chunk.mutable_lane()->set_port(static_cast<uint32_t>(serving_.lane->port()));
    chunk.mutable_lane()->set_ticket(*ticket);
    chunk.mutable_lane()->set_proof(lane_proof_);
    buffer_ = wire::EncodeChunk(chunk, SharedBytes());
    last_write_bytes_ = buffer_.Length();
    {
      absl::MutexLock lock(&lane_mu_);
      lane_ticket_ = *ticket;
    }
    if (cancelled_) serving_.lane->Withdraw(*ticket);  // cancelled before the ticket was kept
    StartWrite(&buffer_);
    return true;
  }

  // The lane's connection, or why none came: on the lane's thread, which
  // must not block, so the chunks go out on a thread of this stream's own.
  void LaneAttached(absl::StatusOr<UniqueFd> fd) {
    if (!fd.ok()) {
      LaneEvent(fd.status());
      return;
    }
    try {
      std::thread([this, lane = serving_.lane, fd = *std::move(fd)]() mutable {
        watch_.Resume();
        bool peer_closed = false;
        absl::Status status = RunLane(fd.get(), &peer_closed);
        fd.reset();  // the client reads the end frame, then the stream's status
        if (peer_closed) {
          // A client that cancels closes its lane as its call's cancel goes
          // out; the two race here. Counted as what it was, not a broken lane.
          // Not watched meanwhile: the stall watchdog's cancel is not the
          // client's, and a lane cut on the way must end Unavailable, which
          // the client resumes.
          watch_.Busy();
          if (CancelArrives(absl::Seconds(1))) status = absl::CancelledError("the client cancelled its fetch");
        }
        LaneEvent(status);
        // `this` may be gone now; `lane` is this thread's own reference.
      }).detach();
    } catch (const std::system_error& e) {
      LaneEvent(absl::ResourceExhaustedError(absl::StrCat("no thread for the data lane: ", e.what())));
    }
  }

  // The proof that the daemon took the connection, every chunk, then the
  // end frame, over the lane's connection `fd`. `peer_closed`: a write failed
  // because the other end closed or reset the connection.
  absl::Status RunLane(int fd, bool* peer_closed) {
    auto sent = [&](absl::Status written) {
      *peer_closed = absl::IsUnavailable(written);  // LaneWriteAll: the connection broke
      return written;
    };
    wire::LaneWait wait;
    wait.stop = [this] { return cancelled_.load(); };
    wait.idle = std::chrono::minutes(10);  // the stall watchdog cancels sooner
    {
      const std::span<const std::byte> parts[] = {std::as_bytes(std::span(wire::kLaneHello)),
                                                  std::as_bytes(std::span(lane_proof_))};
      WEIGHTSTORE_RETURN_IF_ERROR(sent(wire::LaneWriteAll(fd, parts, wait)));
    }
    std::string meta;
    while (true) {
      if (cancelled_) return absl::CancelledError("cancelled");
      v1::TensorChunk chunk;
      SharedBytes payload;
      WEIGHTSTORE_ASSIGN_OR_RETURN(Step step, Prepare(&chunk, &payload));
      if (step == Step::kComposing) return absl::InternalError("a data lane's stream composed a patch");
      if (step == Step::kEnd) {
        const auto end = wire::EncodeLaneFrameHeader({});
        const std::span<const std::byte> parts[] = {end};
        return sent(wire::LaneWriteAll(fd, parts, wait));
      }
      meta.clear();
      chunk.AppendToString(&meta);
      const auto header = wire::EncodeLaneFrameHeader({static_cast<uint32_t>(meta.size()), payload.size()});
      const std::span<const std::byte> parts[] = {header, std::as_bytes(std::span(meta)), payload.span()};
      WEIGHTSTORE_RETURN_IF_ERROR(
          sent(wire::LaneWriteAll(fd, parts, wait, [this](uint64_t n) { watch_.Progress(n); })));
    }
  }

  // True once the call is cancelled, waiting up to `patience` for it.
  bool CancelArrives(absl::Duration patience) {
    absl::MutexLock lock(&lane_mu_);
    return lane_mu_.AwaitWithTimeout(absl::Condition(&cancel_seen_), patience);
  }

  // One of a lane stream's two ends: the ticket's write, or the lane's
  // outcome. The second finishes the stream, with the lane's outcome.
  void LaneEvent(std::optional<absl::Status> lane_outcome) {
    if (lane_outcome.has_value()) lane_status_ = *std::move(lane_outcome);
    if (lane_events_.fetch_add(1) + 1 < 2) return;
    Done(lane_status_.ok() ? grpc::Status::OK : serving_.client_status(lane_status_));
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
  // The data lane, when the request asked for it and the daemon has one.
  bool lane_wanted_ = false;  // until TryLane decides
  bool lane_ = false;         // the stream's one message is the ticket
  absl::Mutex lane_mu_;
  std::optional<std::string> lane_ticket_ ABSL_GUARDED_BY(lane_mu_);
  bool cancel_seen_ ABSL_GUARDED_BY(lane_mu_) = false;  // Cancel() ran
  std::string lane_proof_;                              // sent back on the lane: DataLane.proof
  std::atomic<int> lane_events_{0};                     // LaneEvent
  absl::Status lane_status_;                            // the lane's outcome, set before its event
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* StreamTensors(const Serving& serving, grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request) {
  return new FetchReactor(serving, ctx, request);
}

}  // namespace weightstore::server
