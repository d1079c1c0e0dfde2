// Serving: what a handler of a call needs from the daemon, whatever the RPC,
// so that handlers in files of their own (fetch_stream, uploads,
// stored_files) take it instead of reaching into WeightStoreService: who may
// call (`admit`), what a client is told (`client_status`), the registry and
// the origin, the gates and the watchdog that bound streams, and how a read
// is resolved. WeightStoreService builds it and outlives every call using it.
#ifndef WEIGHTSTORE_SERVER_SERVING_H_
#define WEIGHTSTORE_SERVER_SERVING_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/catalog/pull.h"
#include "core/catalog/registry.h"
#include "server/admission_gate.h"
#include "server/auth.h"
#include "server/data_lane.h"
#include "server/options.h"
#include "server/resolve.h"
#include "server/stall_watchdog.h"
#include "server/worker_pool.h"

namespace weightstore::server {

struct Serving {
  CheckpointRegistry* registry = nullptr;
  Puller* puller = nullptr;  // null: no origin
  const ServiceOptions* options = nullptr;
  // UNAVAILABLE once the daemon stops accepting, else the authenticator's
  // verdict on the scope.
  std::function<absl::Status(const grpc::ServerContextBase&, Scope)> admit;
  // Paths relative, message bounded.
  std::function<grpc::Status(const absl::Status&)> client_status;
  // Streams served at once (--max-concurrent-fetches), and the watchdog that
  // cancels those that stall by `stream_limits`.
  AdmissionGate* streams = nullptr;
  StallWatchdog* stalls = nullptr;
  const StreamLimits* stream_limits = nullptr;
  // Fetches waiting on a pull (ServiceOptions::pull_waits), and uploads and
  // pushes (ServiceOptions::uploads).
  AdmissionGate* pull_waits = nullptr;
  AdmissionGate* uploads = nullptr;
  // Where patches that must be composed are (TryServedPatch says which),
  // off gRPC's threads; null: composed on the caller's.
  WorkerPool* compositions = nullptr;
  // The data lane (--data-listen); null: off. Shared with the threads that
  // write a stream's chunks over it, which may end after the stream.
  std::shared_ptr<DataLane> lane;
  // Resolve() of a read, calling `done` exactly once: at once for a plain
  // selection, on a selection worker holding a slot of
  // --max-concurrent-selections for a costly one.
  std::function<void(const grpc::CallbackServerContext& ctx, const std::string& name, const v1::Selection& selection,
                     const std::string& version, const std::string& since_version,
                     std::function<void(absl::StatusOr<Resolved>)> done)>
      resolve_async;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_SERVING_H_
