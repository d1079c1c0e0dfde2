#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.pb.h"

namespace weightstore::server {

absl::StatusOr<std::unique_ptr<WeightStoreServer>> WeightStoreServer::Start(ServerOptions options) {
  std::unique_ptr<WeightStoreServer> s(new WeightStoreServer());
  s->segments_ = std::make_unique<SegmentCache>(options.shm_budget_bytes);
  options.registry.shm = s->segments_.get();
  s->registry_ = std::make_unique<CheckpointRegistry>(options.registry);
  ScanReport report = s->registry_->Rescan();
  for (const std::string& e : report.errors) std::fprintf(stderr, "weightstored: not serving %s\n", e.c_str());
  s->service_ = std::make_unique<WeightStoreService>(s->registry_.get(), options.service);

  // The default health service is implemented without protobuf; touching the
  // generated descriptor registers grpc.health.v1 so reflection can describe it.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  builder.SetMaxSendMessageSize(options.max_send_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams_per_connection);
  // gRPC 1.51 turns SO_REUSEPORT on by default: a second daemon would silently
  // share the port. Off, it fails to bind instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen, " (address in use or invalid)"));
  }
  if (!options.socket.path.empty()) {
    auto shm = ShmServer::Start(s->registry_.get(), s->segments_.get(), options.socket);
    if (!shm.ok()) return shm.status();
    s->shm_server_ = *std::move(shm);
  }
  grpc::HealthCheckServiceInterface* health = s->server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(v1::WeightStore::service_full_name(), true);
  return s;
}

WeightStoreServer::~WeightStoreServer() {
  if (server_ != nullptr) Shutdown(std::chrono::milliseconds(0), std::chrono::milliseconds(0));
}

void WeightStoreServer::Shutdown(std::chrono::milliseconds drain, std::chrono::milliseconds grace) {
  if (server_ == nullptr) return;
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->Shutdown();  // every service NOT_SERVING, and it stays so
  }
  if (drain.count() > 0) std::this_thread::sleep_for(drain);
  if (shm_server_ != nullptr) shm_server_->Stop();  // mappings handed out stay valid
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  server_->Wait();
  server_.reset();
}

void WeightStoreServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace weightstore::server
