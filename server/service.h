// WeightStoreService: the gRPC service. Each unary handler validates, converts,
// makes one call into core or the registry, and converts the result back,
// through Unary() or UnaryReadingThrough() (auth, request log, reply); no
// format logic here. The streaming handlers live in files of their own and take
// a Serving (server/serving.h), not the service: fetch_stream.h (FetchTensors),
// uploads.h (PutCheckpoint, PushCheckpoint), stored_files.h
// (ReadCheckpointFile), watch.h (WatchCheckpoints).
//
// FetchTensors is implemented on raw ByteBuffers: each chunk is a small
// serialized header followed by a payload slice that points into the checkpoint's
// mapping (or the transformed tensor) and holds it alive, so tensor bytes are
// never copied into a protobuf message. The bytes on the wire are an ordinary
// TensorChunk. Thread-safe.
#ifndef WEIGHTSTORE_SERVER_SERVICE_H_
#define WEIGHTSTORE_SERVER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>

#include "core/catalog/registry.h"
#include "core/select/selection.h"
#include "server/admission_gate.h"
#include "server/auth.h"
#include "server/options.h"
#include "server/resolve.h"
#include "server/serving.h"
#include "server/stall_watchdog.h"
#include "server/watch.h"
#include "server/worker_pool.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::server {

using ::weightstore::CheckpointRegistry;
using ::weightstore::CheckpointVersion;
using ::weightstore::Puller;
using ::weightstore::PullResult;
using ::weightstore::PushOptions;
using ::weightstore::PushSession;
using ::weightstore::PutSession;
using ::weightstore::RegistryOptions;
using ::weightstore::ScanReport;

// FetchTensors and ReadCheckpointFile stream raw ByteBuffers: their payloads go
// out as slices of the checkpoints' mappings (proto/codec/chunk_codec.h).
// WatchCheckpoints too: every watcher of one step is sent the same serialized
// event (server/watch.h).
using ServiceBase =
    v1::WeightStore::WithRawCallbackMethod_FetchTensors<v1::WeightStore::WithRawCallbackMethod_ReadCheckpointFile<
        v1::WeightStore::WithRawCallbackMethod_WatchCheckpoints<v1::WeightStore::CallbackService>>>;

class WeightStoreService final : public ServiceBase {
 public:
  // `auth` (may be null: no tokens) must outlive the service.
  // `puller` (may be null: no origin) pulls the checkpoints requests name
  // that the daemon lacks (read-through), and serves PullCheckpoint; it must
  // outlive the service.
  WeightStoreService(CheckpointRegistry* registry, ServiceOptions options, const Authenticator* auth = nullptr,
                     Puller* puller = nullptr);

  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* ctx, const v1::ListCheckpointsRequest* req,
                                            v1::ListCheckpointsResponse* resp) override;
  grpc::ServerUnaryReactor* GetCheckpoint(grpc::CallbackServerContext* ctx, const v1::GetCheckpointRequest* req,
                                          v1::CheckpointInfo* resp) override;
  grpc::ServerUnaryReactor* ListTensors(grpc::CallbackServerContext* ctx, const v1::ListTensorsRequest* req,
                                        v1::ListTensorsResponse* resp) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchTensors(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* req) override;
  grpc::ServerUnaryReactor* LoadCheckpoint(grpc::CallbackServerContext* ctx, const v1::LoadCheckpointRequest* req,
                                           v1::CheckpointInfo* resp) override;
  grpc::ServerUnaryReactor* UnloadCheckpoint(grpc::CallbackServerContext* ctx, const v1::UnloadCheckpointRequest* req,
                                             v1::UnloadCheckpointResponse* resp) override;
  grpc::ServerReadReactor<v1::PutCheckpointRequest>* PutCheckpoint(grpc::CallbackServerContext* ctx,
                                                                   v1::CheckpointInfo* resp) override;
  grpc::ServerUnaryReactor* Rescan(grpc::CallbackServerContext* ctx, const v1::RescanRequest* req,
                                   v1::RescanResponse* resp) override;
  grpc::ServerReadReactor<v1::PushCheckpointRequest>* PushCheckpoint(grpc::CallbackServerContext* ctx,
                                                                     v1::CheckpointInfo* resp) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchCheckpoints(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* req) override;
  // The origin tier (server/stored_files.cc): pulls into this daemon, and the
  // API a node pulls from it through.
  grpc::ServerUnaryReactor* PullCheckpoint(grpc::CallbackServerContext* ctx, const v1::PullCheckpointRequest* req,
                                           v1::PullCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* ListCheckpointFiles(grpc::CallbackServerContext* ctx,
                                                const v1::ListCheckpointFilesRequest* req,
                                                v1::ListCheckpointFilesResponse* resp) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* ReadCheckpointFile(grpc::CallbackServerContext* ctx,
                                                                 const grpc::ByteBuffer* req) override;

  // Fetches that ask for the data lane get it. REQUIRES: before the first call.
  void SetDataLane(std::shared_ptr<DataLane> lane) { serving_.lane = std::move(lane); }

  // Refuses every call that starts from now on (UNAVAILABLE): once the drain
  // is over, the calls in flight are the last ones shutdown waits for.
  void StopAccepting() { stopping_.store(true); }
  // Ends every WatchCheckpoints stream (UNAVAILABLE) and refuses new ones:
  // the first step of shutting down, as watches never end by themselves.
  void StopWatches() { watches_.Stop(); }
  // Ends the calls waiting for a checksum worker (UNAVAILABLE) and waits for
  // those computing: a step of shutting down, before gRPC waits for calls.
  void StopBackground() {
    // Both marked stopping first: a body on one pool asks both (Cancelled).
    selections_.BeginStop();
    background_.BeginStop();
    compositions_.BeginStop();
    selections_.Stop();
    background_.Stop();
    compositions_.Stop();
  }
  int active_watches() const { return watches_.active(); }
  uint64_t watch_cached_bytes() const { return watches_.cached_bytes(); }

  // Costly selections admitted now (resolving, or waiting for a selection
  // worker).
  int active_selections() const { return selection_work_.active(); }
  // The gate of costly selections (--max-concurrent-selections), for the
  // same-host socket's to share.
  AdmissionGate* selection_gate() { return &selection_work_; }
  // Streams being served now, and those cancelled for stalling.
  int active_fetches() const { return streams_.active(); }
  // Streams waiting for a checkpoint their node is pulling from its origin.
  int fetches_waiting_on_pulls() const { return pull_waits_.active(); }
  uint64_t stalled_fetches() const { return stalls_.cancelled(options_.streams); }

 private:
  // The first step of every call: UNAVAILABLE once StopAccepting was called,
  // else the authenticator's verdict on `scope`.
  absl::Status Admit(const grpc::ServerContextBase& ctx, Scope scope) const;
  // What a client is told: paths relative, message bounded.
  grpc::Status ClientStatus(const absl::Status& status) const;
  grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status);
  // Runs one unary call as every handler does: checks `scope`, names
  // `checkpoint` for the request log, runs `body` (returning absl::Status) and
  // replies with its status. The handlers are then one call into core each.
  template <typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, Scope scope, absl::string_view checkpoint,
                                  Body body);
  // How long a body may run: kQuick on whichever thread is at hand, kLong (it
  // reads whole tensors or files) on background_, kSelection (it resolves a
  // costly selection) on selections_ holding a slot of selection_work_
  // (RESOURCE_EXHAUSTED when none is free); never the last two on gRPC's
  // threads.
  enum class Work { kQuick, kLong, kSelection };
  // Unary(), for a call that reads `checkpoint`: with an origin, a checkpoint
  // the daemon lacks is pulled first, and `body` (given the PullResult; it
  // must capture by value) runs on the pull's thread once it is in. gRPC's
  // threads never wait on a transfer. `work` (empty: kQuick) says, once the
  // checkpoint is in, where the body runs.
  template <typename Body>
  grpc::ServerUnaryReactor* UnaryReadingThrough(grpc::CallbackServerContext* ctx, Scope scope,
                                                const std::string& checkpoint, Body body,
                                                std::function<Work()> work = {});
  // For a body on background_: true once its client left or the daemon stops.
  bool Cancelled(grpc::CallbackServerContext* ctx) const {
    return ctx->IsCancelled() || background_.stopping() || selections_.stopping();
  }
  CheckpointRegistry* registry_;
  Puller* puller_;
  ServiceOptions options_;
  Authenticator no_auth_;
  const Authenticator* auth_;
  // The request's selection limits, cancelled once its client goes away or
  // the daemon stops (valid while the call is).
  SelectionLimits LimitsFor(const grpc::CallbackServerContext& ctx) const;
  // Resolve() on this thread (a worker), holding a slot of selection_work_
  // while a costly selection is resolved (RESOURCE_EXHAUSTED when none is
  // free).
  absl::StatusOr<Resolved> ResolveInSlot(const grpc::CallbackServerContext& ctx, const std::string& name,
                                         const v1::Selection& selection, const std::string& version,
                                         const std::string& since_version);
  // Resolve(), calling `done` with the result: at once on this thread for a
  // plain selection, or on a selections_ worker, holding a slot of
  // selection_work_, for a costly one. `done` is called exactly once.
  void ResolveAsync(const grpc::CallbackServerContext& ctx, const std::string& name, const v1::Selection& selection,
                    const std::string& version, const std::string& since_version,
                    std::function<void(absl::StatusOr<Resolved>)> done);

  AdmissionGate streams_;         // FetchTensors and ReadCheckpointFile streams (ServiceOptions::streams)
  AdmissionGate pull_waits_;      // fetches waiting on a pull (ServiceOptions::pull_waits)
  AdmissionGate selection_work_;  // costly selections being resolved (ServiceOptions::selection_work)
  AdmissionGate uploads_;         // PutCheckpoint and PushCheckpoint streams (ServiceOptions::uploads)
  StallWatchdog stalls_;          // cancels the streams and uploads that stall
  WorkerPool background_;
  WorkerPool selections_;    // ServiceOptions::selection_threads
  WorkerPool compositions_;  // ServiceOptions::composition_threads
  std::atomic<bool> stopping_{false};
  Serving serving_;   // for the handlers in files of their own
  WatchHub watches_;  // last: its streams end first
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_SERVICE_H_
