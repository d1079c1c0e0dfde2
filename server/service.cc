#include "server/service.h"

#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/select/served.h"
#include "core/select/snapshot.h"
#include "core/status_macros.h"
#include "server/fetch_stream.h"
#include "server/grpc_status.h"
#include "server/observability.h"
#include "server/proto_convert.h"
#include "server/resolve.h"
#include "server/stored_files.h"
#include "server/uploads.h"

namespace weightstore::server {

namespace {

// ServiceOptions::selection_threads, with 0 resolved to half the cores.
int SelectionThreads(const ServiceOptions& options) {
  if (options.selection_threads > 0) return options.selection_threads;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency() / 2));
}

}  // namespace

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
      compositions_(std::max(1, options.composition_threads), std::max(1, options.streams.total),
                    "element patch composition"),
      serving_{.registry = registry,
               .puller = puller,
               .options = &options_,
               .admit = [this](const grpc::ServerContextBase& ctx, Scope scope) { return Admit(ctx, scope); },
               .client_status = [this](const absl::Status& s) { return ClientStatus(s); },
               .streams = &streams_,
               .stalls = &stalls_,
               .stream_limits = &options_.streams,
               .pull_waits = &pull_waits_,
               .uploads = &uploads_,
               .compositions = &compositions_,
               .resolve_async =
                   [this](const grpc::CallbackServerContext& ctx, const std::string& name,
                          const v1::Selection& selection, const std::string& version, const std::string& since_version,
                          std::function<void(absl::StatusOr<Resolved>)> done) {
                     ResolveAsync(ctx, name, selection, version, since_version, std::move(done));
                   }},
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
    // is answered (or its job is dropped unrun), and runs on a selection
    // worker.
    const bool selection = work() == Work::kSelection;
    auto slot = std::make_shared<GateTicket>();
    if (selection) {
      absl::StatusOr<GateTicket> admitted = selection_work_.Admit(ctx->peer());
      if (!admitted.ok()) {
        reactor->Finish(ClientStatus(admitted.status()));
        return;
      }
      *slot = *std::move(admitted);
    }
    absl::Status queued = (selection ? selections_ : background_)
                              .Post([this, ctx, reactor, body, slot, pulled = *pulled](absl::Status runnable) {
                                if (runnable.ok() && Cancelled(ctx))
                                  runnable = absl::CancelledError("the client went away");
                                const grpc::Status status = ClientStatus(runnable.ok() ? body(pulled) : runnable);
                                slot->Release();  // before the client can see the status
                                reactor->Finish(status);
                              });
    if (!queued.ok()) {
      slot->Release();
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
    const PullStats pulls = puller_ != nullptr ? puller_->Stats() : PullStats{};
    for (const auto& version : registry_->List()) {
      v1::CheckpointInfo* info = resp->add_checkpoints();
      ToProto(*version, info);
      AddFollowing(pulls, info);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* WeightStoreService::GetCheckpoint(grpc::CallbackServerContext* ctx,
                                                            const v1::GetCheckpointRequest* req,
                                                            v1::CheckpointInfo* resp) {
  return UnaryReadingThrough(ctx, Scope::kRead, req->name(), [this, req, resp](const PullResult&) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto version, registry_->Find(req->name()));
    ToProto(*version, resp);
    if (puller_ != nullptr) AddFollowing(puller_->StatsOf(req->name()), resp);
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
  WEIGHTSTORE_ASSIGN_OR_RETURN(GateTicket slot, AdmitSelection(&selection_work_, ctx.peer(), selection));
  return Resolve(*registry_, name, selection, version, LimitsFor(ctx), since_version);
}

void WeightStoreService::ResolveAsync(const grpc::CallbackServerContext& ctx, const std::string& name,
                                      const v1::Selection& selection, const std::string& version,
                                      const std::string& since_version,
                                      std::function<void(absl::StatusOr<Resolved>)> done) {
  if (!IsCostlySelection(selection)) {
    done(Resolve(*registry_, name, selection, version, options_.selection_limits, since_version));
    return;
  }
  absl::StatusOr<GateTicket> admitted = AdmitSelection(&selection_work_, ctx.peer(), selection);
  if (!admitted.ok()) {
    done(admitted.status());
    return;
  }
  // Shared so that a Post that refuses (and drops the job) leaves `done` here.
  auto shared_done = std::make_shared<std::function<void(absl::StatusOr<Resolved>)>>(std::move(done));
  auto slot = std::make_shared<GateTicket>(*std::move(admitted));
  absl::Status queued =
      selections_.Post([this, &ctx, name, selection, version, since_version, slot, shared_done](absl::Status runnable) {
        if (runnable.ok() && ctx.IsCancelled()) runnable = absl::CancelledError("the client went away");
        absl::StatusOr<Resolved> resolved =
            runnable.ok() ? Resolve(*registry_, name, selection, version, LimitsFor(ctx), since_version)
                          : absl::StatusOr<Resolved>(runnable);
        slot->Release();
        (*shared_done)(std::move(resolved));
      });
  if (!queued.ok()) {
    slot->Release();
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
          resolved.Describe(t, info);
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
  return StreamTensors(serving_, ctx, req);
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

grpc::ServerWriteReactor<grpc::ByteBuffer>* WeightStoreService::ReadCheckpointFile(grpc::CallbackServerContext* ctx,
                                                                                   const grpc::ByteBuffer* req) {
  return ReadStoredFile(serving_, ctx, req);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* WeightStoreService::WatchCheckpoints(grpc::CallbackServerContext* ctx,
                                                                                 const grpc::ByteBuffer* req) {
  return watches_.Start(ctx, req);
}

grpc::ServerReadReactor<v1::PutCheckpointRequest>* WeightStoreService::PutCheckpoint(grpc::CallbackServerContext* ctx,
                                                                                     v1::CheckpointInfo* resp) {
  return ReceivePut(serving_, ctx, resp);
}

grpc::ServerReadReactor<v1::PushCheckpointRequest>* WeightStoreService::PushCheckpoint(grpc::CallbackServerContext* ctx,
                                                                                       v1::CheckpointInfo* resp) {
  return ReceivePush(serving_, ctx, resp);
}

}  // namespace weightstore::server
