// request_fuzz: arbitrary request messages through a whole weightstored in this
// process, serving the bundled example models: gRPC, then each handler's
// validation, Resolve and response building (every chunk of a fetch), and the
// same-host socket's frame handling. The first byte picks the call; the rest
// is parsed as its request message. Run with a memory and a time limit
// (scripts/run-fuzzers.sh): an input that makes the daemon crash, allocate
// past the limit or spin past the timeout is a finding.
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/shm/unix_socket.h"
#include "server/log.h"
#include "server/server.h"
#include "weightstore/v1/shm.pb.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace {

namespace pb = ::weightstore::v1;

struct Daemon {
  std::unique_ptr<weightstore::server::WeightStoreServer> server;
  std::unique_ptr<pb::WeightStore::Stub> stub;
  std::string socket;
};

Daemon* Start() {
  // A request log line and a protobuf complaint per input would be most of the work.
  weightstore::server::SetLogLevel(weightstore::server::LogLevel::kError);
  google::protobuf::SetLogHandler(nullptr);
  auto* d = new Daemon();
  char dir[] = "/tmp/request_fuzz-XXXXXX";
  if (::mkdtemp(dir) == nullptr) std::abort();
  d->socket = std::string(dir) + "/ws.sock";
  weightstore::server::ServerOptions options;
  options.listen = "127.0.0.1:0";
  const char* models = std::getenv("WEIGHTSTORE_FUZZ_MODELS");
  options.registry.models_dir = models != nullptr ? models : WEIGHTSTORE_EXAMPLE_MODELS_DIR;
  options.socket.path = d->socket;
  options.shm_budget_bytes = 256 << 20;
  auto server = weightstore::server::WeightStoreServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "request_fuzz: %s\n", server.status().ToString().c_str());
    std::abort();
  }
  d->server = *std::move(server);
  d->stub = pb::WeightStore::NewStub((d)->server->InProcessChannel());
  return d;
}

Daemon& daemon() {
  static Daemon* d = Start();
  return *d;
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
}

template <typename Message>
bool Parse(const uint8_t* data, size_t size, Message* message) {
  return message->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Daemon& d = daemon();
  const uint8_t call = data[0] % 5;
  ++data;
  --size;
  switch (call) {
    case 0: {
      pb::ListTensorsRequest req;
      if (!Parse(data, size, &req)) return 0;
      grpc::ClientContext ctx;
      Deadline(&ctx);
      pb::ListTensorsResponse resp;
      (void)d.stub->ListTensors(&ctx, req, &resp);
      break;
    }
    case 1: {
      pb::FetchTensorsRequest req;
      if (!Parse(data, size, &req)) return 0;
      grpc::ClientContext ctx;
      Deadline(&ctx);
      auto reader = d.stub->FetchTensors(&ctx, req);
      pb::TensorChunk chunk;
      while (reader->Read(&chunk)) {
      }
      (void)reader->Finish();
      break;
    }
    case 2: {
      pb::GetCheckpointRequest req;
      if (!Parse(data, size, &req)) return 0;
      grpc::ClientContext ctx;
      Deadline(&ctx);
      pb::CheckpointInfo info;
      (void)d.stub->GetCheckpoint(&ctx, req, &info);
      break;
    }
    case 3: {  // the whole frame, as a socket client could send it
      auto socket = weightstore::ConnectUnixSocket(d.socket);
      if (!socket.ok()) std::abort();
      if (!weightstore::SendFrame(socket->get(), std::string(reinterpret_cast<const char*>(data), size)).ok()) break;
      std::string frame;
      std::vector<weightstore::UniqueFd> fds;
      (void)weightstore::RecvFrame(socket->get(), 64 << 20, &frame, &fds);
      break;
    }
    case 4: {  // a socket MapTensors, the descriptors received closed again
      pb::ShmRequest req;
      if (!Parse(data, size, req.mutable_map_tensors())) return 0;
      auto socket = weightstore::ConnectUnixSocket(d.socket);
      if (!socket.ok()) std::abort();
      if (!weightstore::SendFrame(socket->get(), req.SerializeAsString()).ok()) break;
      std::string frame;
      std::vector<weightstore::UniqueFd> fds;
      (void)weightstore::RecvFrame(socket->get(), 64 << 20, &frame, &fds);
      break;
    }
  }
  return 0;
}
