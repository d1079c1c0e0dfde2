#include "server/service.h"

#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/catalog/version_patches.h"
#include "core/crc32c.h"
#include "core/element_patch.h"
#include "core/select/served.h"
#include "core/select/snapshot.h"
#include "core/status_macros.h"
#include "proto/codec/chunk_codec.h"
#include "server/grpc_status.h"
#include "server/observability.h"
#include "server/proto_convert.h"
#include "server/resolve.h"
#include "server/stored_files.h"

namespace weightstore::server {

namespace {

// ServiceOptions::selection_threads, with 0 resolved to half the cores.
int SelectionThreads(const ServiceOptions& options) {
  if (options.selection_threads > 0) return options.selection_threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency() / 2));
}

}  // namespace

// The name comes from the request: gRPC aborts the process on a metadata value
// that is not printable ASCII, so it is encoded first (TrailerValue).
void Annotate(grpc::CallbackServerContext* ctx, const std::string& checkpoint) {
  if (!checkpoint.empty()) ctx->AddTrailingMetadata(kCheckpointTrailer, TrailerValue(checkpoint));
}

void ToProto(const CheckpointVersion& version, v1::CheckpointInfo* out) {
  const Checkpoint& c = *version.checkpoint();
  out->set_name(version.name());
  out->set_format(std::string(c.format().name));
  out->set_container(c.detail());
  out->set_path(version.relative_path());
  out->set_total_bytes(c.total_bytes());
  out->set_tensor_count(c.size());
  for (const auto& [k, v] : c.metadata()) (*out->mutable_metadata())[k] = v;
  out->set_version(version.version());
  out->set_loaded_at_unix_seconds(version.loaded_at_unix_seconds());
  if (c.quantization() != nullptr) out->set_quantization(c.quantization()->Describe());
}

// Streams one FetchTensors response, one chunk in flight at a time: gRPC's flow
// control paces it, so a client that stops reading holds at most one chunk.
class FetchReactor : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchReactor(WeightStoreService* service, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request)
      : service_(service) {
    absl::Status status = Start(ctx, request);
    // A checkpoint the daemon lacks is pulled first (read-through), on the
    // pull's own thread: this one returns to gRPC. Meanwhile the stream holds
    // a waiting slot, not a serving one, and takes that once the pull is done.
    const bool waits =
        status.ok() && service_->puller_ != nullptr && service_->registry_->Get(request_.name()) == nullptr;
    if (status.ok()) status = waits ? AdmitWaiting(ctx) : AdmitServing(ctx);
    if (!status.ok()) {
      Done(service_->ClientStatus(status));
      return;
    }
    if (service_->puller_ == nullptr) {
      Begin();
      return;
    }
    // Present a moment ago, it may be evicted before the pull asks: a serving
    // slot held meanwhile is kept from the stall watchdog.
    if (ticket_ != 0) service_->streams_.Busy(ticket_);
    pull_ticket_ = service_->puller_->PullAsync(request_.name(), [this, ctx](absl::StatusOr<PullResult> pulled) {
      if (wait_ticket_ != 0) service_->pull_waits_.Release(std::exchange(wait_ticket_, 0));
      if (ticket_ != 0) service_->streams_.Resume(ticket_);
      absl::Status admitted = pulled.ok() ? (ticket_ != 0 ? absl::OkStatus() : AdmitServing(ctx)) : pulled.status();
      if (!admitted.ok()) {
        Done(service_->ClientStatus(admitted));
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
    if (ticket_ != 0) service_->streams_.Progress(ticket_, last_write_bytes_);
    Next();
  }
  void OnCancel() override {
    cancelled_ = true;
    // Waiting on a pull: stop waiting (a stale ticket does nothing).
    if (service_->puller_ != nullptr) service_->puller_->Abandon(request_.name(), pull_ticket_);
  }
  void OnDone() override {
    if (ticket_ != 0) service_->streams_.Release(ticket_);
    if (wait_ticket_ != 0) service_->pull_waits_.Release(wait_ticket_);
    delete this;
  }

 private:
  absl::Status Start(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* raw) {
    ctx_ = ctx;
    if (absl::Status s = service_->Admit(*ctx, Scope::kRead); !s.ok()) return s;
    if (!wire::ParseMessage(*raw, &request_)) return absl::InvalidArgumentError("request is not a FetchTensorsRequest");
    Annotate(ctx, request_.name());
    return absl::OkStatus();
  }
  // A serving slot: a stream whose client stops reading is cancelled by the
  // governor, which frees its slot (and its share of its client's).
  absl::Status AdmitServing(grpc::CallbackServerContext* ctx) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(ticket_, service_->streams_.Admit(ctx->peer(), [ctx] { ctx->TryCancel(); }));
    return absl::OkStatus();
  }
  // A waiting slot, kept from the stall watchdog: the pull is watched, not
  // the stream, which moves nothing until the checkpoint is here.
  absl::Status AdmitWaiting(grpc::CallbackServerContext* ctx) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(wait_ticket_, service_->pull_waits_.Admit(ctx->peer(), [ctx] { ctx->TryCancel(); }));
    service_->pull_waits_.Busy(wait_ticket_);
    return absl::OkStatus();
  }

  // Resolves the request and starts writing, or finishes with its error: at
  // once for a plain selection, on a selection worker for a costly one.
  // Meanwhile the stream is kept from the stall watchdog: its selection is
  // bounded by its own budgets.
  void Begin() {
    if (ticket_ != 0) service_->streams_.Busy(ticket_);
    service_->ResolveAsync(*ctx_, request_.name(), request_.selection(), request_.version(), request_.since_version(),
                           [this](absl::StatusOr<Resolved> resolved) {
                             if (ticket_ != 0) service_->streams_.Resume(ticket_);
                             absl::Status status = resolved.ok() ? Accept(*std::move(resolved)) : resolved.status();
                             if (!status.ok()) {
                               Done(service_->ClientStatus(status));
                               return;
                             }
                             Next();
                           });
  }

  // Takes the resolved request: the range of tensors to send, the chunk size.
  absl::Status Accept(Resolved resolved) {
    resolved_ = std::move(resolved);
    chunk_bytes_ = request_.chunk_bytes() == 0 ? service_->options_.chunk_bytes
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
      PatchesFound found = FindPatches(*service_->registry_, resolved_);
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
      bytes_ = SharedBytes();
      patch_ = ServedPatch(patches_.get(), snapshot, plan_);
      if (patch_) {
        bytes_ = patch_->body;
      } else if (plan_.is_byte_range()) {
        absl::StatusOr<SharedBytes> view = ReadServedView(snapshot, plan_);
        if (!view.ok()) {
          Done(service_->ClientStatus(view.status()));
          return;
        }
        bytes_ = *std::move(view);
      }
      cached_crc_ = patch_ ? std::nullopt : resolved_.version->checksums().Find(plan_.key);
      crc_ = 0;
      ToProto(*plan_.tensor, chunk.mutable_info());
      if (const ManifestTensor* digest = resolved_.Digest(*plan_.tensor)) {
        chunk.mutable_info()->set_digest(digest->digest.Hex());
      }
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
        Done(service_->ClientStatus(produced.status()));
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
        Done(service_->ClientStatus(unchanged));
        return;
      }
      const uint32_t crc = cached_crc_.value_or(crc_);
      chunk.set_last(true);
      chunk.set_crc32c(crc);
      if (!cached_crc_ && !patch_) (void)resolved_.version->checksums().Store(plan_.key, crc);
    }
    buffer_ =
        service_->options_.zero_copy ? wire::EncodeChunk(chunk, payload) : wire::EncodeChunkCopying(chunk, payload);
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
    if (ticket_ != 0) service_->streams_.Release(std::exchange(ticket_, 0));
    if (wait_ticket_ != 0) service_->pull_waits_.Release(std::exchange(wait_ticket_, 0));
    Finish(status);
  }

  WeightStoreService* service_;
  grpc::CallbackServerContext* ctx_ = nullptr;
  uint64_t sent_bytes_ = 0;
  uint64_t ticket_ = 0;       // from the stream governor, once admitted to serve
  uint64_t wait_ticket_ = 0;  // from the waiting governor, while it waits on a pull
  uint64_t pull_ticket_ = 0;  // from the puller, while the checkpoint is pulled
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
  std::shared_ptr<std::vector<std::byte>> buffers_[2];
  int next_buffer_ = 0;
  uint32_t crc_ = 0;
  std::optional<uint32_t> cached_crc_;
  bool sent_any_ = false;
  grpc::ByteBuffer buffer_;
};

grpc::Status WeightStoreService::ClientStatus(const absl::Status& status) const {
  return ToGrpcStatus(WithoutPaths(status, options_.hidden_folders));
}

absl::Status WeightStoreService::Admit(const grpc::ServerContextBase& ctx, Scope scope) const {
  if (stopping_.load()) return absl::UnavailableError("the daemon is shutting down; retry on another replica");
  return auth_->Check(ctx, scope);
}

grpc::ServerUnaryReactor* WeightStoreService::Reply(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ClientStatus(status));
  return reactor;
}

WeightStoreService::WeightStoreService(CheckpointRegistry* registry, ServiceOptions options, const Authenticator* auth,
                                       Puller* puller)
    : registry_(registry),
      puller_(puller),
      options_(options),
      auth_(auth != nullptr ? auth : &no_auth_),
      streams_(options.streams),
      pull_waits_(options.pull_waits),
      selection_work_(options.selection_work),
      uploads_(options.uploads),
      background_(options.background_threads, options.max_background_queue, "checksum work"),
      selections_(SelectionThreads(options), options.selection_work.total, "selection work"),
      watches_(registry, auth_, options.watches, [this](const absl::Status& s) { return ClientStatus(s); }) {}

// The reactor of a unary call that may wait on a pull: a client that goes
// away meanwhile is let go at once (Puller::Abandon), rather than held until
// the pull ends.
class ReadThroughReactor : public grpc::ServerUnaryReactor {
 public:
  ReadThroughReactor(Puller* puller, std::string checkpoint) : puller_(puller), checkpoint_(std::move(checkpoint)) {}
  // Set by the handler, before gRPC can call OnCancel.
  void set_ticket(uint64_t ticket) { ticket_ = ticket; }
  void OnCancel() override {
    if (puller_ != nullptr) puller_->Abandon(checkpoint_, ticket_);
  }
  void OnDone() override { delete this; }

 private:
  Puller* const puller_;
  const std::string checkpoint_;
  uint64_t ticket_ = 0;
};

template <typename Body>
grpc::ServerUnaryReactor* WeightStoreService::UnaryReadingThrough(grpc::CallbackServerContext* ctx, Scope scope,
                                                                  const std::string& checkpoint, Body body,
                                                                  std::function<Work()> work) {
  absl::Status status = Admit(*ctx, scope);
  if (!status.ok()) return Reply(ctx, status);
  Annotate(ctx, checkpoint);
  auto* reactor = new ReadThroughReactor(puller_, checkpoint);
  auto run = [this, ctx, reactor, work, body = std::move(body)](absl::StatusOr<PullResult> pulled) mutable {
    if (!pulled.ok() || !work || work() == Work::kQuick) {
      reactor->Finish(ClientStatus(pulled.ok() ? body(*pulled) : pulled.status()));
      return;
    }
    // A costly selection holds a slot of selection_work_ from here until it
    // is answered, and runs on a selection worker.
    const bool selection = work() == Work::kSelection;
    uint64_t ticket = 0;
    if (selection) {
      absl::StatusOr<uint64_t> admitted = selection_work_.Admit(ctx->peer(), [] {});
      if (!admitted.ok()) {
        reactor->Finish(ClientStatus(admitted.status()));
        return;
      }
      ticket = *admitted;
      selection_work_.Busy(ticket);  // bounded by the selection's own budgets, not by bytes moved
    }
    absl::Status queued = (selection ? selections_ : background_)
                              .Post([this, ctx, reactor, body, ticket, pulled = *pulled](absl::Status runnable) {
                                if (runnable.ok() && Cancelled(ctx))
                                  runnable = absl::CancelledError("the client went away");
                                const grpc::Status status = ClientStatus(runnable.ok() ? body(pulled) : runnable);
                                if (ticket != 0) selection_work_.Release(ticket);
                                reactor->Finish(status);
                              });
    if (!queued.ok()) {
      if (ticket != 0) selection_work_.Release(ticket);
      reactor->Finish(ClientStatus(queued));
    }
  };
  if (puller_ == nullptr) {
    run(PullResult());
  } else {
    reactor->set_ticket(puller_->PullAsync(checkpoint, std::move(run)));
  }
  return reactor;
}

template <typename Body>
grpc::ServerUnaryReactor* WeightStoreService::Unary(grpc::CallbackServerContext* ctx, Scope scope,
                                                    absl::string_view checkpoint, Body body) {
  absl::Status status = Admit(*ctx, scope);
  if (status.ok()) {
    Annotate(ctx, std::string(checkpoint));
    status = body();
  }
  return Reply(ctx, status);
}

grpc::ServerUnaryReactor* WeightStoreService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                              const v1::ListCheckpointsRequest*,
                                                              v1::ListCheckpointsResponse* resp) {
  return Unary(ctx, Scope::kRead, "", [&] {
    for (const auto& version : registry_->List()) ToProto(*version, resp->add_checkpoints());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WeightStoreService::GetCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::GetCheckpointRequest* req,
                                                            v1::CheckpointInfo* resp) {
  return UnaryReadingThrough(ctx, Scope::kRead, req->name(), [this, req, resp](const PullResult&) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, registry_->Find(req->name()));
    ToProto(*version, resp);
    return absl::OkStatus();
  });
}

SelectionLimits WeightStoreService::LimitsFor(const grpc::CallbackServerContext& ctx) const {
  SelectionLimits limits = options_.selection_limits;
  limits.cancelled = [this, &ctx] { return ctx.IsCancelled() || selections_.stopping() || background_.stopping(); };
  return limits;
}

absl::StatusOr<Resolved> WeightStoreService::ResolveInSlot(const grpc::CallbackServerContext& ctx,
                                                           const std::string& name, const v1::Selection& selection,
                                                           const std::string& version,
                                                           const std::string& since_version) {
  uint64_t ticket = 0;
  if (IsCostlySelection(selection)) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(ticket, selection_work_.Admit(ctx.peer(), [] {}));
    selection_work_.Busy(ticket);
  }
  absl::StatusOr<Resolved> resolved = Resolve(*registry_, name, selection, version, LimitsFor(ctx), since_version);
  if (ticket != 0) selection_work_.Release(ticket);
  return resolved;
}

void WeightStoreService::ResolveAsync(const grpc::CallbackServerContext& ctx, const std::string& name,
                                      const v1::Selection& selection, const std::string& version,
                                      const std::string& since_version,
                                      std::function<void(absl::StatusOr<Resolved>)> done) {
  if (!IsCostlySelection(selection)) {
    done(Resolve(*registry_, name, selection, version, options_.selection_limits, since_version));
    return;
  }
  absl::StatusOr<uint64_t> ticket = selection_work_.Admit(ctx.peer(), [] {});
  if (!ticket.ok()) {
    done(ticket.status());
    return;
  }
  selection_work_.Busy(*ticket);  // bounded by the selection's own budgets, not by bytes moved
  // Shared so that a Post that refuses (and drops the job) leaves `done` here.
  auto shared_done = std::make_shared<std::function<void(absl::StatusOr<Resolved>)>>(std::move(done));
  absl::Status queued = selections_.Post(
      [this, &ctx, name, selection, version, since_version, ticket = *ticket, shared_done](absl::Status runnable) {
        if (runnable.ok() && ctx.IsCancelled()) runnable = absl::CancelledError("the client went away");
        absl::StatusOr<Resolved> resolved =
            runnable.ok() ? Resolve(*registry_, name, selection, version, LimitsFor(ctx), since_version)
                          : absl::StatusOr<Resolved>(runnable);
        selection_work_.Release(ticket);
        (*shared_done)(std::move(resolved));
      });
  if (!queued.ok()) {
    selection_work_.Release(*ticket);
    (*shared_done)(queued);
  }
}

grpc::ServerUnaryReactor* WeightStoreService::ListTensors(grpc::CallbackServerContext* ctx,
                                                          const v1::ListTensorsRequest* req,
                                                          v1::ListTensorsResponse* resp) {
  // Checksums read every selected byte: on a worker, not on gRPC's threads.
  return UnaryReadingThrough(
      ctx, Scope::kRead, req->name(),
      [this, ctx, req, resp](const PullResult&) -> absl::Status {
        // With checksums the body runs on background_ (kLong): a costly
        // selection takes its slot for the resolving only, not the reading.
        // Without, a costly one already holds its slot (kSelection).
        WEIGHTSTORE_ASSIGN_OR_RETURN(
            Resolved resolved, req->with_checksums() ? ResolveInSlot(*ctx, req->name(), req->selection(),
                                                                     req->version(), req->since_version())
                                                     : Resolve(*registry_, req->name(), req->selection(),
                                                               req->version(), LimitsFor(*ctx), req->since_version()));
        const Snapshot& snapshot = *resolved.snapshot;
        resp->set_name(req->name());
        resp->set_version(resolved.version->version());
        if (!resolved.since_version.empty()) {
          *resp->mutable_delta() = resolved.DeltaInfo(0, snapshot.size());
          if (req->patches()) resp->mutable_delta()->set_patch_reason(FindPatches(*registry_, resolved).reason);
        }
        for (const SnapshotTensor& t : snapshot.tensors()) {
          v1::TensorInfo* info = resp->add_tensors();
          ToProto(t, info);
          if (const ManifestTensor* digest = resolved.Digest(t)) info->set_digest(digest->digest.Hex());
          info->set_unchanged(resolved.Unchanged(t));
          if (!req->with_checksums()) continue;
          WEIGHTSTORE_ASSIGN_OR_RETURN(
              uint32_t crc, ServedChecksum(snapshot, PlanServedTensor(snapshot, t), resolved.version->checksums(),
                                           [this, ctx] { return Cancelled(ctx); }));
          info->set_crc32c(crc);
        }
        if (resolved.apply_result) ToProto(*resolved.apply_result, resp->mutable_apply_result());
        return absl::OkStatus();
      },
      [req] {
        if (req->with_checksums()) return Work::kLong;
        return IsCostlySelection(req->selection()) ? Work::kSelection : Work::kQuick;
      });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* WeightStoreService::FetchTensors(grpc::CallbackServerContext* ctx,
                                                                             const grpc::ByteBuffer* req) {
  return new FetchReactor(this, ctx, req);
}

grpc::ServerUnaryReactor* WeightStoreService::LoadCheckpoint(grpc::CallbackServerContext* ctx,
                                                             const v1::LoadCheckpointRequest* req,
                                                             v1::CheckpointInfo* resp) {
  return Unary(ctx, Scope::kAdmin, req->name().empty() ? req->path() : req->name(), [&]() -> absl::Status {
    if (req->path().empty()) return absl::InvalidArgumentError("path is empty");
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, registry_->Load(req->path(), req->name()));
    ToProto(*version, resp);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WeightStoreService::UnloadCheckpoint(grpc::CallbackServerContext* ctx,
                                                               const v1::UnloadCheckpointRequest* req,
                                                               v1::UnloadCheckpointResponse*) {
  return Unary(ctx, Scope::kAdmin, req->name(), [&] { return registry_->Unload(req->name()); });
}

grpc::ServerUnaryReactor* WeightStoreService::Rescan(grpc::CallbackServerContext* ctx, const v1::RescanRequest*,
                                                     v1::RescanResponse* resp) {
  return Unary(ctx, Scope::kAdmin, "", [&] {
    ScanReport report = registry_->Rescan();
    for (const auto& s : report.added) resp->add_added(s);
    for (const auto& s : report.replaced) resp->add_replaced(s);
    for (const auto& s : report.removed) resp->add_removed(s);
    for (const auto& e : report.errors) {
      std::fprintf(stderr, "weightstored: not serving %s\n", e.c_str());
      resp->add_not_served(std::string(WithoutPaths(absl::UnknownError(e), options_.hidden_folders).message()));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WeightStoreService::PullCheckpoint(grpc::CallbackServerContext* ctx,
                                                             const v1::PullCheckpointRequest* req,
                                                             v1::PullCheckpointResponse* resp) {
  if (puller_ == nullptr) {
    return Unary(ctx, Scope::kAdmin, req->name(), [] {
      return absl::FailedPreconditionError("this daemon has no origin to pull from (weightstored --origin)");
    });
  }
  return UnaryReadingThrough(ctx, Scope::kAdmin, req->name(),
                             [this, req, resp](const PullResult& pulled) -> absl::Status {
                               WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, registry_->Find(req->name()));
                               ToProto(*version, resp->mutable_checkpoint());
                               resp->set_already_present(pulled.already_present);
                               resp->set_joined(pulled.joined);
                               resp->set_bytes_pulled(pulled.bytes_pulled);
                               resp->set_seconds(pulled.seconds);
                               return absl::OkStatus();
                             });
}

grpc::ServerUnaryReactor* WeightStoreService::ListCheckpointFiles(grpc::CallbackServerContext* ctx,
                                                                  const v1::ListCheckpointFilesRequest* req,
                                                                  v1::ListCheckpointFilesResponse* resp) {
  // A tier reads through: a node's listing pulls what this daemon lacks.
  // The first listing of a version reads its files for their CRC32C: on a
  // worker, and once however many ask (ChecksumCache::FindOrCompute); later
  // ones answer at once.
  // The version found when choosing where to run is the one described: a
  // replacement in between must not be checksummed on gRPC's thread.
  auto found = std::make_shared<std::shared_ptr<const CheckpointVersion>>();
  return UnaryReadingThrough(
      ctx, Scope::kRead, req->name(),
      [this, ctx, req, resp, found](const PullResult&) -> absl::Status {
        if (*found == nullptr) {
          WEIGHTSTORE_ASSIGN_OR_RETURN(*found, registry_->Find(req->name(), req->version()));
        }
        return DescribeStoredFiles(**found, resp, [this, ctx] { return Cancelled(ctx); });
      },
      [this, req, found] {
        auto version = registry_->Find(req->name(), req->version());
        if (!version.ok()) return Work::kQuick;  // its error, at once
        *found = *std::move(version);
        return StoredCrcsKnown(**found) ? Work::kQuick : Work::kLong;
      });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* WeightStoreService::WatchCheckpoints(grpc::CallbackServerContext* ctx,
                                                                                 const grpc::ByteBuffer* req) {
  return watches_.Start(ctx, req);
}

// Receives an upload into a temporary file; validates and stores it when its
// commit message arrives. Only that message commits: the end of the stream
// reads the same whether the client finished or was cancelled.
class PutReactor : public grpc::ServerReadReactor<v1::PutCheckpointRequest> {
 public:
  PutReactor(WeightStoreService* service, v1::CheckpointInfo* response, grpc::CallbackServerContext* ctx)
      : service_(service), registry_(service->registry_), response_(response), ctx_(ctx) {
    absl::Status authorized = service->Admit(*ctx, Scope::kAdmin);
    if (!authorized.ok()) {
      Finish(service->ClientStatus(authorized));
      return;
    }
    // An upload that stalls holds a temporary file and its descriptors: its
    // slot is taken back like a stalled fetch's.
    absl::StatusOr<uint64_t> ticket = service->uploads_.Admit(ctx->peer(), [ctx] { ctx->TryCancel(); });
    if (!ticket.ok()) {
      Finish(service->ClientStatus(ticket.status()));
      return;
    }
    ticket_ = *ticket;
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (ok) service_->uploads_.Progress(ticket_, request_.ByteSizeLong());
    if (!ok) {
      return Fail(absl::CancelledError(
          absl::StrCat("the upload", session_ == nullptr ? "" : absl::StrCat(" of '", session_->name(), "'"),
                       " ended without a commit message; nothing was stored")));
    }
    switch (request_.part_case()) {
      case v1::PutCheckpointRequest::kHeader: {
        if (session_ != nullptr) return Fail(absl::InvalidArgumentError("a second header"));
        const v1::PutHeader& h = request_.header();
        Annotate(ctx_, h.name());
        auto session = registry_->BeginPut(h.name(), h.extension(), h.overwrite(), h.size());
        if (!session.ok()) return Fail(session.status());
        session_ = *std::move(session);
        break;
      }
      case v1::PutCheckpointRequest::kData:
        if (session_ == nullptr) return Fail(absl::InvalidArgumentError("data before the header"));
        if (absl::Status status = session_->Append(request_.data()); !status.ok()) return Fail(status);
        break;
      case v1::PutCheckpointRequest::kCommit:
        return Commit(request_.commit());
      default:
        return Fail(absl::InvalidArgumentError("a PutCheckpointRequest with no part"));
    }
    StartRead(&request_);
  }
  void OnDone() override {
    if (ticket_ != 0) service_->uploads_.Release(ticket_);
    delete this;
  }

 private:
  void Commit(const v1::PutCommit& commit) {
    if (session_ == nullptr) return Fail(absl::InvalidArgumentError("a commit before the header"));
    if (commit.size() != session_->bytes() || commit.crc32c() != session_->crc32c()) {
      return Fail(absl::DataLossError(absl::StrCat(
          "upload of '", session_->name(), "': the commit says ", commit.size(), " bytes with CRC32C ", commit.crc32c(),
          ", ", session_->bytes(), " bytes with CRC32C ", session_->crc32c(), " arrived; nothing was stored")));
    }
    auto version = registry_->FinishPut(std::move(session_));
    if (!version.ok()) return Fail(version.status());
    ToProto(**version, response_);
    End(grpc::Status::OK);
  }
  void Fail(const absl::Status& status) {
    session_.reset();  // removes the temporary file
    End(service_->ClientStatus(status));
  }
  // The slot is free before the client can see the status (see FetchReactor).
  void End(const grpc::Status& status) {
    if (ticket_ != 0) service_->uploads_.Release(std::exchange(ticket_, 0));
    Finish(status);
  }
  WeightStoreService* service_;
  CheckpointRegistry* registry_;
  v1::CheckpointInfo* response_;
  grpc::CallbackServerContext* ctx_;
  v1::PutCheckpointRequest request_;
  std::unique_ptr<PutSession> session_;
  uint64_t ticket_ = 0;  // from the upload governor, once admitted
};

grpc::ServerReadReactor<v1::PutCheckpointRequest>* WeightStoreService::PutCheckpoint(grpc::CallbackServerContext* ctx,
                                                                                     v1::CheckpointInfo* resp) {
  return new PutReactor(this, resp, ctx);
}

// Receives a push: the header starts a PushSession on the base, each tensor's
// bytes go to its staging file, and only the commit message publishes.
// Admitted and timed like an upload.
class PushReactor : public grpc::ServerReadReactor<v1::PushCheckpointRequest> {
 public:
  PushReactor(WeightStoreService* service, v1::CheckpointInfo* response, grpc::CallbackServerContext* ctx)
      : service_(service), response_(response), ctx_(ctx) {
    absl::Status status = service->Admit(*ctx, Scope::kAdmin);
    if (status.ok()) {
      absl::StatusOr<uint64_t> ticket = service->uploads_.Admit(ctx->peer(), [ctx] { ctx->TryCancel(); });
      if (ticket.ok()) ticket_ = *ticket;
      status = ticket.status();
    }
    if (!status.ok()) {
      Finish(service->ClientStatus(status));
      return;
    }
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      return Fail(absl::CancelledError(
          absl::StrCat("the push", session_ == nullptr ? "" : absl::StrCat(" to '", session_->name(), "'"),
                       " ended without a commit message; nothing was published")));
    }
    service_->uploads_.Progress(ticket_, request_.ByteSizeLong());
    switch (request_.part_case()) {
      case v1::PushCheckpointRequest::kHeader: {
        if (session_ != nullptr) return Fail(absl::InvalidArgumentError("a second header"));
        const v1::PushHeader& h = request_.header();
        Annotate(ctx_, h.name());
        PushOptions options{h.base_version(), {h.remove().begin(), h.remove().end()}, h.allow_new_tensors()};
        auto session = service_->registry_->BeginPush(h.name(), std::move(options));
        if (!session.ok()) return Fail(session.status());
        session_ = *std::move(session);
        break;
      }
      case v1::PushCheckpointRequest::kTensor: {
        if (session_ == nullptr) return Fail(absl::InvalidArgumentError("a tensor before the header"));
        const v1::PushTensor& t = request_.tensor();
        std::optional<DType> dtype = ParseDType(t.dtype());
        if (!dtype) {
          return Fail(absl::InvalidArgumentError(absl::StrCat("push to '", session_->name(), "': tensor '",
                                                              t.name().substr(0, 256), "' has unknown dtype '",
                                                              t.dtype().substr(0, 32), "'")));
        }
        if (t.shape_size() > static_cast<int>(kMaxRank)) {
          return Fail(absl::InvalidArgumentError(absl::StrCat("push to '", session_->name(), "': tensor '",
                                                              t.name().substr(0, 256), "' has rank ", t.shape_size(),
                                                              ", more than ", kMaxRank)));
        }
        TensorSpec spec{t.name(), *dtype, {t.shape().begin(), t.shape().end()}};
        absl::Status begun = t.has_patch() ? BeginPatched(t, spec) : session_->BeginTensor(spec, t.crc32c());
        if (!begun.ok()) return Fail(begun);
        break;
      }
      case v1::PushCheckpointRequest::kData:
        if (session_ == nullptr) return Fail(absl::InvalidArgumentError("data before the header"));
        if (absl::Status s = session_->Append(request_.data()); !s.ok()) return Fail(s);
        break;
      case v1::PushCheckpointRequest::kCommit: {
        if (session_ == nullptr) return Fail(absl::InvalidArgumentError("a commit before the header"));
        if (request_.commit().tensors() != session_->tensors()) {
          return Fail(absl::DataLossError(absl::StrCat("push to '", session_->name(), "': the commit says ",
                                                       request_.commit().tensors(), " tensors, ", session_->tensors(),
                                                       " arrived; nothing was published")));
        }
        // Writing the new version can take long; the client is not stalled.
        service_->uploads_.Busy(ticket_);
        auto version = service_->registry_->FinishPush(std::move(session_));
        if (!version.ok()) return Fail(version.status());
        ToProto(**version, response_);
        End(grpc::Status::OK);
        return;
      }
      default:
        return Fail(absl::InvalidArgumentError("a PushCheckpointRequest with no part"));
    }
    StartRead(&request_);
  }
  void OnDone() override {
    if (ticket_ != 0) service_->uploads_.Release(ticket_);
    delete this;
  }

 private:
  // Starts `t`, a tensor pushed as an element patch, after parsing its header
  // and digests.
  absl::Status BeginPatched(const v1::PushTensor& t, const TensorSpec& spec) {
    const std::string where =
        absl::StrCat("push to '", session_->name(), "': the patch of tensor '", t.name().substr(0, 256), "'");
    std::optional<PatchEncoding> encoding = ParsePatchEncoding(t.patch().encoding());
    if (!encoding) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has unknown encoding '",
                                                     absl::CHexEscape(t.patch().encoding().substr(0, 32)),
                                                     "' (\"positions\" or \"runs\")"));
    }
    std::optional<TensorDigest> base = TensorDigest::FromHex(t.base_digest());
    std::optional<TensorDigest> digest = TensorDigest::FromHex(t.digest());
    if (!base || !digest) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " needs base_digest and digest, each 32 lowercase hex digits"));
    }
    const uint32_t element_size = t.patch().element_size();
    ElementPatch header{*encoding,
                        element_size,
                        element_size == 0 ? 0 : spec.byte_size() / element_size,
                        t.patch().changed_elements(),
                        {}};
    return session_->BeginPatchedTensor(spec, t.crc32c(), header, t.patch().patch_bytes(), *base, *digest);
  }
  void Fail(const absl::Status& status) {
    session_.reset();  // removes the staging file
    End(service_->ClientStatus(status));
  }
  // The slot is free before the client can see the status (see FetchReactor).
  void End(const grpc::Status& status) {
    if (ticket_ != 0) service_->uploads_.Release(std::exchange(ticket_, 0));
    Finish(status);
  }
  WeightStoreService* service_;
  v1::CheckpointInfo* response_;
  grpc::CallbackServerContext* ctx_;
  v1::PushCheckpointRequest request_;
  std::unique_ptr<PushSession> session_;
  uint64_t ticket_ = 0;
};

grpc::ServerReadReactor<v1::PushCheckpointRequest>* WeightStoreService::PushCheckpoint(grpc::CallbackServerContext* ctx,
                                                                                       v1::CheckpointInfo* resp) {
  return new PushReactor(this, resp, ctx);
}

}  // namespace weightstore::server
