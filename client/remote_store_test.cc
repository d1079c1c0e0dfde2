// The gRPC store against streams a real daemon never sends (a daemon's bug,
// or a man in the middle of a plaintext link): each a named error.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/crc32c.h"
#include "tests/util/status_matchers.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::client {
namespace {

using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

// A WeightStore on 127.0.0.1 whose FetchTensors writes what `script` writes.
class ScriptedServer final : public v1::WeightStore::Service {
 public:
  using Script = std::function<grpc::Status(grpc::ServerWriter<v1::TensorChunk>*)>;
  explicit ScriptedServer(Script script) : script_(std::move(script)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~ScriptedServer() override { server_->Shutdown(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  grpc::Status FetchTensors(grpc::ServerContext*, const v1::FetchTensorsRequest*,
                            grpc::ServerWriter<v1::TensorChunk>* writer) override {
    return script_(writer);
  }

 private:
  Script script_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// The first chunk of U8 [6] tensor "w" (index `index`) of version `version`.
v1::TensorChunk Begins(const std::string& data, uint64_t index = 0, const std::string& version = "v1") {
  v1::TensorChunk c;
  c.set_tensor_index(index);
  c.mutable_info()->set_name(absl::StrCat("w", index));
  c.mutable_info()->set_dtype("U8");
  c.mutable_info()->add_shape(6);
  c.mutable_info()->set_byte_size(6);
  c.set_version(version);
  c.set_data(data);
  return c;
}

absl::Status FetchAllFrom(const ScriptedServer& server) {
  absl::StatusOr<std::unique_ptr<Store>> store =
      ConnectRemoteStore(server.address(), {.max_resumes = 0, .parallel_streams = 1});
  if (!store.ok()) return store.status();
  return (*store)->FetchAll("m", {}).status();
}

TEST(RemoteStoreTest, AWholeTensorIsFetched) {
  ScriptedServer server([](grpc::ServerWriter<v1::TensorChunk>* writer) {
    v1::TensorChunk c = Begins("abcdef");
    c.set_last(true);
    c.set_crc32c(Crc32c("abcdef"));
    writer->Write(c);
    return grpc::Status::OK;
  });
  EXPECT_OK(FetchAllFrom(server));
}

// Half a tensor, then the stream's OK: never a whole fetch.
TEST(RemoteStoreTest, AStreamEndedOkInsideATensorIsDataLoss) {
  ScriptedServer server([](grpc::ServerWriter<v1::TensorChunk>* writer) {
    writer->Write(Begins("abc"));
    return grpc::Status::OK;
  });
  EXPECT_THAT(FetchAllFrom(server), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("ended OK inside a tensor")));
}

// A second tensor of another version: never a fetch of two versions' tensors.
TEST(RemoteStoreTest, AStreamThatChangesItsVersionIsDataLoss) {
  ScriptedServer server([](grpc::ServerWriter<v1::TensorChunk>* writer) {
    for (uint64_t i = 0; i < 2; ++i) {
      v1::TensorChunk c = Begins("abcdef", i, i == 0 ? "v1" : "v2");
      c.set_last(true);
      c.set_crc32c(Crc32c("abcdef"));
      writer->Write(c);
    }
    return grpc::Status::OK;
  });
  EXPECT_THAT(FetchAllFrom(server),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("named version v2 after its first message")));
}

}  // namespace
}  // namespace weightstore::client
