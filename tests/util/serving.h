// Helpers for tests against a serving daemon: a WeightStoreServer in this
// process, raw gRPC calls to any daemon's address, and the check that a
// daemon (a child weightstored, daemon.h) still serves after an attack.
#ifndef WEIGHTSTORE_TESTS_UTIL_SERVING_H_
#define WEIGHTSTORE_TESTS_UTIL_SERVING_H_

#include <grpcpp/client_context.h>
#include <grpcpp/support/sync_stream.h>

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/server.h"
#include "tests/util/daemon.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::testing {

// Starts a WeightStoreServer in this process on 127.0.0.1, port 0, serving
// `models_dir`; the other fields of `options` are kept as given.
absl::StatusOr<std::unique_ptr<server::WeightStoreServer>> StartInProcessServer(const std::string& models_dir,
                                                                                server::ServerOptions options = {});

// "127.0.0.1:<port>" of a server started by StartInProcessServer.
std::string AddressOf(const server::WeightStoreServer& server);

// A stub on a plaintext channel to `address`.
std::unique_ptr<v1::WeightStore::Stub> NewStub(const std::string& address);

// Reads a FetchTensors stream to its end (a 60 s deadline only stops a hang)
// and returns its status; stores the number of chunks read in `*chunks`.
grpc::Status DrainFetch(v1::WeightStore::Stub* stub, const v1::FetchTensorsRequest& request, size_t* chunks = nullptr);

// Starts a PutCheckpoint of <name>.<extension> on `context` and sends its
// header; the daemon answers into `*info`.
std::unique_ptr<grpc::ClientWriter<v1::PutCheckpointRequest>> StartUpload(v1::WeightStore::Stub* stub,
                                                                          grpc::ClientContext* context,
                                                                          v1::CheckpointInfo* info,
                                                                          const std::string& name,
                                                                          const std::string& extension = "safetensors");

// Sends `bytes` and, when `commit`, the commit message (its CRC32C flipped
// when `corrupt`); half-closes and returns the upload's status.
grpc::Status FinishUpload(grpc::ClientWriter<v1::PutCheckpointRequest>* writer, const std::string& bytes,
                          bool commit = true, bool corrupt = false);

// How many upload temporaries (atomic-file temporaries) lie directly in `dir`.
size_t UploadTemporariesIn(const std::string& dir);

// Adds a test failure unless `daemon` runs, serves the example model
// "tiny-mlp" (MakeExampleModelsDir) and has peaked under 1 GiB resident.
void ExpectStillServes(Daemon& daemon);

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_SERVING_H_
