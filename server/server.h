// WeightStoreServer: the gRPC server of weightstored, with server reflection and
// the standard health service (grpc.health.v1.Health, described by reflection).
//
// With options.socket.path set, it also serves the same-host socket
// (ShmServer), from the same registry.
//
// Lifecycle (tensorstore's KvStoreServer shape): Start() binds and serves;
// port() gives the bound port (listen on port 0 in tests); Shutdown() reports
// NOT_SERVING, waits `drain`, then stops accepting and lets streams in flight
// finish until the grace deadline, after which they are cancelled. Thread-safe.
#ifndef WEIGHTSTORE_SERVER_SERVER_H_
#define WEIGHTSTORE_SERVER_SERVER_H_

#include <grpcpp/server.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/registry.h"
#include "server/service.h"
#include "server/observability.h"
#include "server/shm_server.h"

namespace weightstore::server {

struct ServerOptions {
  // Address to listen on, "host:port". Default: 127.0.0.1:50051.
  std::string listen = "127.0.0.1:50051";
  RegistryOptions registry;
  ServiceOptions service;
  // Largest request message. Default: 4 MiB (PutCheckpoint data comes in chunks).
  int max_receive_message_bytes = 4 << 20;
  // Largest response message: a chunk plus headroom. Default: 8 MiB.
  int max_send_message_bytes = 8 << 20;
  // HTTP/2 streams per connection. Default: 100.
  int max_concurrent_streams_per_connection = 100;
  // Same-host socket (ShmServer). Off while socket.path is empty.
  ShmServerOptions socket;
  // Shared memory for derived segments and preloads. Default: 4 GiB.
  uint64_t shm_budget_bytes = uint64_t{4} << 30;
  // Prometheus text on http://<metrics_listen>/metrics. Off when empty.
  std::string metrics_listen;
  // A second gRPC port serving only grpc.health.v1.Health, plaintext and never
  // authenticated, for probes. Off when empty.
  std::string health_listen;
  // TLS on the main port when cert_file is set (PEM files); mutual TLS, requiring
  // and verifying a client certificate, when client_ca_file is set too.
  struct Tls {
    std::string cert_file, key_file, client_ca_file;
  } tls;
  // Bearer tokens (server/auth.h). Off when empty: keep the port private.
  std::string tokens_file;
};

// Checks what Start() would refuse, without binding anything: the models
// folder, the tokens file, the TLS files, the socket path. For --check-config.
absl::Status CheckOptions(const ServerOptions& options);

class WeightStoreServer {
 public:
  // Scans the models folder, then binds and starts serving. Returns
  // Unavailable if the address cannot be bound (e.g. already in use: port reuse
  // is off, so a second daemon on the same port fails instead of sharing it).
  static absl::StatusOr<std::unique_ptr<WeightStoreServer>> Start(ServerOptions options);
  ~WeightStoreServer();

  int port() const { return port_; }
  CheckpointRegistry& registry() { return *registry_; }
  const WeightStoreService& service() const { return *service_; }
  SegmentCache& segments() { return *segments_; }
  // The same-host socket, or nullptr when it is off.
  const ShmServer* shm_server() const { return shm_server_.get(); }
  ServerMetrics& metrics() { return *metrics_; }
  // Bound ports of the metrics endpoint and the health port (0 when off).
  int metrics_port() const { return metrics_http_ != nullptr ? metrics_http_->port() : 0; }
  int health_port() const { return health_port_; }

  // Marks the server NOT_SERVING, waits `drain` (so load balancers stop sending),
  // then stops; streams in flight get until `grace` to finish, and clients
  // until then to read them and hang up.
  void Shutdown(std::chrono::milliseconds drain, std::chrono::milliseconds grace);
  // Blocks until Shutdown() has finished.
  void Wait();
  // A channel to this server within the process, with no socket in between
  // (the request fuzzer). REQUIRES: before Shutdown().
  std::shared_ptr<grpc::Channel> InProcessChannel();

 private:
  WeightStoreServer() = default;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<SegmentCache> segments_;
  std::unique_ptr<CheckpointRegistry> registry_;
  std::unique_ptr<WeightStoreService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ShmServer> shm_server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  int port_ = 0, health_port_ = 0;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_SERVER_H_
