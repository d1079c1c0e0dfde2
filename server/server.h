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
#include <thread>

#include "absl/status/statusor.h"
#include "core/catalog/registry.h"
#include "server/options.h"

namespace weightstore {
class SegmentCache;
}  // namespace weightstore

namespace weightstore::server {

class Authenticator;
class DataLane;
class MetricsHttpServer;
class ServerMetrics;
class ShmServer;
class WeightStoreService;

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
  // The checkpoints served (weightstored rescans it on SIGHUP).
  CheckpointRegistry& registry() { return *registry_; }
  // Bound ports of the metrics endpoint and the health port (0 when off).
  int metrics_port() const { return metrics_port_; }
  int health_port() const { return health_port_; }
  // The data lane's bound port (0 when off).
  int data_lane_port() const;

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
  WeightStoreServer();
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<SegmentCache> segments_;
  std::unique_ptr<CheckpointRegistry> registry_;
  std::unique_ptr<Puller> puller_;  // after the registry it pulls into: destroyed first
  std::thread prefetch_;
  std::unique_ptr<WeightStoreService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ShmServer> shm_server_;
  std::unique_ptr<grpc::Server> health_server_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::shared_ptr<DataLane> lane_;
  int port_ = 0, health_port_ = 0, metrics_port_ = 0;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_SERVER_H_
