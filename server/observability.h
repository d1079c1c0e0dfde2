// What weightstored tells operators: Prometheus metrics (server/metrics.h) and
// one structured log line per request (server/log.h).
//
// gRPC calls are observed by an interceptor, so every service counts
// (weightstore, health, reflection), with go-grpc-prometheus's names and
// labels. Handlers pass the checkpoint and bytes of a call to it as trailing
// metadata ("weightstore-checkpoint", "weightstore-bytes"), which clients see
// too. Values owned elsewhere (checkpoints served, shared memory, socket
// counters, process memory and descriptors) are read at scrape time.
#ifndef WEIGHTSTORE_SERVER_OBSERVABILITY_H_
#define WEIGHTSTORE_SERVER_OBSERVABILITY_H_

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/registry.h"
#include "core/shm/segment_cache.h"
#include "server/metrics.h"

namespace weightstore::server {

class ShmServer;
class WeightStoreService;

// Trailing metadata keys handlers set for the interceptor.
inline constexpr char kCheckpointTrailer[] = "weightstore-checkpoint";
inline constexpr char kBytesTrailer[] = "weightstore-bytes";

class ServerMetrics {
 private:
  metrics::Registry registry_;  // first: the families below live in it

 public:
  ServerMetrics();

  metrics::Registry& registry() { return registry_; }

  // Sources read at scrape time; any may be null. They must outlive scrapes.
  void Watch(const CheckpointRegistry* checkpoints, SegmentCache* segments, const ShmServer* shm,
             const WeightStoreService* service);
  // Records one checkpoint load (RegistryOptions::on_load).
  void ObserveLoad(double seconds, bool ok);
  // Creates the interceptor factory to pass to ServerBuilder.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  metrics::Family<metrics::Counter>& started;
  metrics::Family<metrics::Counter>& handled;
  metrics::Family<metrics::Histogram>& handling_seconds;
  metrics::Family<metrics::Counter>& served_bytes;
  metrics::Family<metrics::Histogram>& load_seconds;
  metrics::Family<metrics::Counter>& load_failures;
  // Calls of the WeightStore service (not health or reflection, whose watches
  // may stay open) that have started and not yet been torn down.
  std::atomic<int64_t> weightstore_calls_in_flight{0};
};

// `value` as a metadata value gRPC accepts: bytes outside printable ASCII, and
// '%', become %XX (as grpc-message encodes), and anything past 256 bytes is cut
// and marked with "...".
std::string TrailerValue(absl::string_view value);

// go-grpc-prometheus's code label: "OK", "NotFound", "PermissionDenied", ...
std::string GrpcCodeName(int code);

// Serves `registry` as text on http://<listen>/metrics (civetweb).
class MetricsHttpServer {
 public:
  // `listen` is "host:port" (port 0 picks one). Unavailable if it cannot bind.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& listen,
                                                                  const metrics::Registry* registry);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_OBSERVABILITY_H_
