#include "tests/util/serving.h"

#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/store.h"
#include "core/atomic_file.h"
#include "core/crc32c.h"
#include "tests/util/status_matchers.h"

namespace weightstore::testing {

absl::StatusOr<std::unique_ptr<server::WeightStoreServer>> StartInProcessServer(const std::string& models_dir,
                                                                                server::ServerOptions options) {
  options.listen = "127.0.0.1:0";
  options.registry.models_dir = models_dir;
  return server::WeightStoreServer::Start(std::move(options));
}

std::string AddressOf(const server::WeightStoreServer& server) { return absl::StrCat("127.0.0.1:", server.port()); }

std::unique_ptr<v1::WeightStore::Stub> NewStub(const std::string& address) {
  return v1::WeightStore::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

grpc::Status DrainFetch(v1::WeightStore::Stub* stub, const v1::FetchTensorsRequest& request, size_t* chunks) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->FetchTensors(&context, request);
  v1::TensorChunk chunk;
  size_t n = 0;
  while (reader->Read(&chunk)) ++n;
  if (chunks != nullptr) *chunks = n;
  return reader->Finish();
}

std::unique_ptr<grpc::ClientWriter<v1::PutCheckpointRequest>> StartUpload(v1::WeightStore::Stub* stub,
                                                                          grpc::ClientContext* context,
                                                                          v1::CheckpointInfo* info,
                                                                          const std::string& name,
                                                                          const std::string& extension) {
  auto writer = stub->PutCheckpoint(context, info);
  v1::PutCheckpointRequest header;
  header.mutable_header()->set_name(name);
  header.mutable_header()->set_extension(extension);
  writer->Write(header);
  return writer;
}

grpc::Status FinishUpload(grpc::ClientWriter<v1::PutCheckpointRequest>* writer, const std::string& bytes, bool commit,
                          bool corrupt) {
  v1::PutCheckpointRequest part;
  part.set_data(bytes);
  writer->Write(part);
  if (commit) {
    part.mutable_commit()->set_size(bytes.size());
    part.mutable_commit()->set_crc32c(Crc32c(bytes) ^ (corrupt ? 1u : 0u));
    writer->Write(part);
  }
  writer->WritesDone();
  return writer->Finish();
}

size_t UploadTemporariesIn(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    n += IsAtomicFileTemporary(e.path().filename().string());
  }
  return n;
}

void ExpectStillServes(Daemon& daemon) {
  ASSERT_TRUE(daemon.alive()) << daemon.log();
  auto store = client::ConnectRemoteStore(daemon.address());
  ASSERT_OK(store);
  auto tensors = (*store)->FetchAll("tiny-mlp", {});
  ASSERT_OK(tensors);
  EXPECT_FALSE(tensors->empty());
  const uint64_t peak = daemon.peak_rss_bytes();
  EXPECT_LT(peak, uint64_t{1} << 30);
  std::printf("daemon peak RSS: %.1f MiB\n", static_cast<double>(peak) / (1 << 20));
}

}  // namespace weightstore::testing
