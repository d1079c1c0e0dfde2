// What weightstored tells operators: Prometheus metrics (prometheus-cpp; see
// server/metrics.h) and one structured log line per request (server/log.h).
//
// gRPC calls are observed by an interceptor, so every service counts
// (weightstore, health, reflection), with go-grpc-prometheus's names and
// labels. Handlers pass the checkpoint and bytes of a call to it as trailing
// metadata ("weightstore-checkpoint", "weightstore-bytes"), which clients see
// too. Values owned elsewhere (checkpoints served, shared memory, socket
// counters) are read at scrape time through callbacks that server.cc adds.
#ifndef WEIGHTSTORE_SERVER_OBSERVABILITY_H_
#define WEIGHTSTORE_SERVER_OBSERVABILITY_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_interceptor.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/metrics.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace weightstore::server {

// Trailing metadata keys handlers set for the interceptor.
inline constexpr char kCheckpointTrailer[] = "weightstore-checkpoint";
inline constexpr char kBytesTrailer[] = "weightstore-bytes";

// The daemon's metrics: families the interceptor and the registry's load hook
// update (a prometheus::Registry), and families read at scrape time (process
// memory, descriptors and CPU here; the rest added by whoever owns the values,
// server/server.cc). Thread-safe.
class ServerMetrics {
 public:
  ServerMetrics();

  // Adds families read at scrape time; they follow the registry's families.
  metrics::ScrapedFamilies& scraped() { return *scraped_; }
  // What the endpoint serves, in order.
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables() const { return {registry_, scraped_}; }
  // The text the endpoint serves (tests, tools).
  std::string Serialize() const { return metrics::Serialize({registry_.get(), scraped_.get()}); }

  // Creates every call series of `services` (full names, as
  // "weightstore.v1.WeightStore") at 0, for each method and status code, as
  // go-grpc-prometheus's InitializeMetrics does: rate() and alerts then work
  // before a method's first call. A service the process has no descriptor
  // of is skipped.
  void InitializeServices(const std::vector<std::string>& services);
  // Records one checkpoint load (RegistryOptions::on_load).
  void ObserveLoad(double seconds, bool ok);
  // Creates the interceptor factory to pass to ServerBuilder.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  // A call began, sent its status, and was torn down (all its operations
  // done, its status handed to the transport): `labels` are grpc_type,
  // grpc_service and grpc_method; `weightstore_call` counts it in
  // weightstore_calls_in_flight() from start to teardown.
  void OnCallStarted(const metrics::Labels& labels, bool weightstore_call);
  void OnCallDone(const metrics::Labels& labels, const std::string& code, double seconds, uint64_t served_bytes);
  void OnCallTornDown(bool weightstore_call, bool ok);

  // Tensor bytes streamed by FetchTensors, as the interceptor counted them.
  uint64_t grpc_served_bytes() const { return grpc_served_bytes_.load(std::memory_order_relaxed); }
  // Stored file bytes streamed by ReadCheckpointFile (what a node tier
  // pulls), as the interceptor counted them.
  uint64_t file_served_bytes() const { return file_served_bytes_.load(std::memory_order_relaxed); }
  // Calls of the WeightStore service (not health or reflection, whose watches
  // may stay open) that have started and not yet been torn down.
  int64_t weightstore_calls_in_flight() const { return calls_in_flight_.load(); }
  // When the last WeightStore call with an OK status was torn down (the
  // epoch if none was).
  std::chrono::steady_clock::time_point last_weightstore_success() const {
    return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(last_success_.load()));
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<metrics::ScrapedFamilies> scraped_;
  prometheus::Family<prometheus::Counter>& started_;
  prometheus::Family<prometheus::Counter>& handled_;
  prometheus::Family<prometheus::Histogram>& handling_seconds_;
  prometheus::Histogram& load_seconds_;
  prometheus::Counter& load_failures_;
  std::atomic<uint64_t> grpc_served_bytes_{0}, file_served_bytes_{0};
  std::atomic<int64_t> calls_in_flight_{0};
  std::atomic<std::chrono::steady_clock::rep> last_success_{0};
};

// `value` as a metadata value gRPC accepts: bytes outside printable ASCII, and
// '%', become %XX (as grpc-message encodes), and anything past 256 bytes is cut
// and marked with "...".
std::string TrailerValue(absl::string_view value);
// Names the checkpoint of a call for the request log, in its trailers.
void Annotate(grpc::ServerContextBase* ctx, const std::string& checkpoint);

// go-grpc-prometheus's code label: "OK", "NotFound", "PermissionDenied", ...
std::string GrpcCodeName(int code);

// Serves `metrics` as text on http://<listen>/metrics (prometheus-cpp's
// Exposer, civetweb inside).
class MetricsHttpServer {
 public:
  // `listen` is "host:port" (port 0 picks one). Unavailable if it cannot bind.
  // `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& listen,
                                                                  const ServerMetrics& metrics);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_OBSERVABILITY_H_
