// Issue 11: no request, file or client can take weightstored down, blow its
// memory, or get stale bytes served. Each attack the issue lists runs against a
// real daemon on 127.0.0.1 serving the bundled example models; after each one
// the daemon must still serve everyone else, and its peak RSS stay under 1 GiB.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/store.h"
#include "core/atomic_file.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "core/utf8.h"
#include "tests/util/daemon.h"
#include "tests/util/pickle_builder.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "tests/util/zip_builder.h"
#include "weightstore/v1/shm.pb.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

constexpr uint64_t kOneGiB = uint64_t{1} << 30;

// A models folder of links to the bundled example models, plus room for more.
std::string ExampleModels() {
  const std::string dir = testing::MakeScratchDir("models");
  for (const auto& e : fs::directory_iterator(testing::ExampleModelsDir())) {
    if (e.path().extension() != ".py") fs::create_symlink(e.path(), fs::path(dir) / e.path().filename());
  }
  return dir;
}

std::unique_ptr<pb::WeightStore::Stub> Stub(const Daemon& d) {
  return pb::WeightStore::NewStub(grpc::CreateChannel(d.address(), grpc::InsecureChannelCredentials()));
}

// The value of `series` (a name with its labels, as exported) on the daemon's
// metrics port (--metrics-listen); -1 if absent.
double Metric(const Daemon& d, absl::string_view series) {
  for (absl::string_view line : absl::StrSplit(testing::HttpGet(d.metrics_port(), "/metrics"), '\n')) {
    double v = -1;
    if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ") && absl::SimpleAtod(line, &v)) return v;
  }
  return -1;
}

// Polls `done` until it holds, or for 60 s (a bound that only catches what
// never happens); returns whether it held.
bool Eventually(const std::function<bool()>& done) {
  const auto start = std::chrono::steady_clock::now();
  while (!done()) {
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The daemon answers, serves the example models, and stayed under 1 GiB.
void ExpectHealthy(Daemon& d) {
  ASSERT_TRUE(d.alive()) << d.log();
  auto store = client::ConnectRemoteStore(d.address());
  ASSERT_OK(store);
  auto tensors = (*store)->FetchAll("tiny-mlp", {});
  ASSERT_OK(tensors);
  EXPECT_FALSE(tensors->empty());
  const uint64_t peak = d.peak_rss_bytes();
  EXPECT_LT(peak, kOneGiB);
  std::printf("daemon peak RSS: %.1f MiB\n", static_cast<double>(peak) / (1 << 20));
}

grpc::Status Fetch(pb::WeightStore::Stub* stub, const pb::FetchTensorsRequest& req, size_t* chunks = nullptr) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub->FetchTensors(&ctx, req);
  pb::TensorChunk chunk;
  size_t n = 0;
  while (reader->Read(&chunk)) ++n;
  if (chunks != nullptr) *chunks = n;
  return reader->Finish();
}

// Starts a PutCheckpoint of <name>.<extension>: its header is sent.
std::unique_ptr<grpc::ClientWriter<pb::PutCheckpointRequest>> StartUpload(
    pb::WeightStore::Stub* stub, grpc::ClientContext* ctx, pb::CheckpointInfo* info, const std::string& name,
    const std::string& extension = "safetensors") {
  auto writer = stub->PutCheckpoint(ctx, info);
  pb::PutCheckpointRequest header;
  header.mutable_header()->set_name(name);
  header.mutable_header()->set_extension(extension);
  writer->Write(header);
  return writer;
}

// Sends `bytes` and, unless `commit` is false, the commit message (with the
// CRC32C flipped when `corrupt`); half-closes and returns the status.
grpc::Status SendAndFinish(grpc::ClientWriter<pb::PutCheckpointRequest>* writer, const std::string& bytes,
                           bool commit = true, bool corrupt = false) {
  pb::PutCheckpointRequest part;
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

TEST(Issue11Test, ANonAsciiOrControlCharacterNameIsInvalidArgumentOnEveryCall) {
  // Item 1: the name was echoed into trailing metadata, and gRPC aborted the
  // process on a value that is not printable ASCII.
  const std::string models = ExampleModels();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models, {"--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  // Names that are not UTF-8 never reach a handler: gRPC cannot parse a proto3
  // string field holding them, and refuses the call itself.
  auto refused = [](const grpc::Status& s, const std::string& name) {
    return IsValidUtf8(name) ? s.error_code() == grpc::StatusCode::INVALID_ARGUMENT : !s.ok();
  };
  for (const std::string& name : {std::string("\xff\xfe"), std::string("a\r\nb"), std::string("tiny\x7f"),
                                  std::string(1 << 20, 'n'), std::string("\0x", 2), std::string("t\xc2\x9b")}) {
    SCOPED_TRACE(name.size());
    {
      grpc::ClientContext ctx;
      pb::GetCheckpointRequest req;
      req.set_name(name);
      pb::CheckpointInfo info;
      grpc::Status st = stub->GetCheckpoint(&ctx, req, &info);
      EXPECT_TRUE(refused(st, name)) << st.error_code() << " " << st.error_message();
    }
    {
      grpc::ClientContext ctx;
      pb::ListTensorsRequest req;
      req.set_name(name);
      pb::ListTensorsResponse resp;
      EXPECT_TRUE(refused(stub->ListTensors(&ctx, req, &resp), name));
    }
    {
      pb::FetchTensorsRequest req;
      req.set_name(name);
      EXPECT_TRUE(refused(Fetch(stub.get(), req), name));
    }
    {
      grpc::ClientContext ctx;
      pb::LoadCheckpointRequest req;
      req.set_path("tiny-mlp.safetensors");
      req.set_name(name);
      pb::CheckpointInfo info;
      grpc::Status st = stub->LoadCheckpoint(&ctx, req, &info);
      EXPECT_TRUE(refused(st, name)) << st.error_code() << " " << st.error_message();
      grpc::ClientContext by_path;
      req.set_path(name);
      req.clear_name();
      EXPECT_NE(stub->LoadCheckpoint(&by_path, req, &info).error_code(), grpc::StatusCode::OK);
    }
    {
      grpc::ClientContext ctx;
      pb::UnloadCheckpointRequest req;
      req.set_name(name);
      pb::UnloadCheckpointResponse resp;
      EXPECT_TRUE(refused(stub->UnloadCheckpoint(&ctx, req, &resp), name));
    }
    {
      grpc::ClientContext ctx;
      pb::CheckpointInfo info;
      auto writer = StartUpload(stub.get(), &ctx, &info, name);
      writer->WritesDone();
      EXPECT_TRUE(refused(writer->Finish(), name));
    }
    ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
    EXPECT_THAT(shm->GetCheckpoint(name), StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(shm->ListTensors(name, {}), StatusIs(absl::StatusCode::kInvalidArgument));
    ExpectHealthy(daemon);
  }
}

// A SafeTensors checkpoint of `count` F32 tensors of `floats` elements, every
// element derived from `seed`.
std::string Checkpoint(int count, size_t floats, float seed) {
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> data(floats * 4);
    for (size_t k = 0; k < floats; ++k) {
      const float v = seed + static_cast<float>(i) * 0.5f + static_cast<float>(k % 977);
      std::memcpy(data.data() + 4 * k, &v, 4);
    }
    tensors.push_back({{absl::StrCat("t.", i), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(data))});
  }
  return *SerializeCheckpoint(kSafeTensorsFormat, tensors, {});
}

// Writes `bytes` over the file at `path` in place: same inode, no rename.
void OverwriteInPlace(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(bytes.size())), 0);
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

std::string CurrentVersion(client::Store& store, const std::string& name) {
  auto info = store.GetCheckpoint(name);
  return info.ok() ? info->version : "";
}

// Polls until `name` is served under a version other than `old` (or 10 s).
std::string AwaitNewVersion(client::Store& store, const std::string& name, const std::string& old) {
  for (int i = 0; i < 200; ++i) {
    std::string v = CurrentVersion(store, name);
    if (!v.empty() && v != old) return v;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return "";
}

// The tensors of `bytes` (a SafeTensors file) by name.
std::map<std::string, std::string> TensorsOf(const std::string& bytes) {
  auto checkpoint = ParseSafeTensors(SharedBytes::Copy(bytes), "expected", {});
  std::map<std::string, std::string> out;
  if (!checkpoint.ok()) return out;
  for (const CheckpointEntry& e : (*checkpoint)->entries()) {
    out[e.spec.name] = std::string((*checkpoint)->Read(e)->bytes.view());
  }
  return out;
}

std::map<std::string, std::string> Fetched(client::Store& store, const std::string& name, client::Query query = {}) {
  std::map<std::string, std::string> out;
  auto tensors = store.FetchAll(name, query);
  if (!tensors.ok()) return out;
  for (const SharedTensor& t : *tensors) out[t.spec.name] = std::string(t.bytes.view());
  return out;
}

TEST(Issue11Test, AServedFileTruncatedInPlaceFailsTheReadsThatHitItAndItsNextContentsAreANewVersion) {
  // Item 5: the next fetch died with SIGBUS.
  const std::string models = ExampleModels();
  const std::string path = models + "/big.safetensors";
  const std::string v1_bytes = Checkpoint(8, 1 << 20, 1.0f);  // 32 MiB, mapped
  testing::WriteFileOrDie(path, v1_bytes);
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models, {"--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  const std::string v1 = CurrentVersion(*store, "big");
  ASSERT_FALSE(v1.empty());

  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  // Whether the daemon has heard of it yet or not, reads fail cleanly.
  client::Query with_checksums;
  auto listing = store->ListTensors("big", with_checksums);
  auto fetched = store->FetchAll("big", {});
  EXPECT_FALSE(fetched.ok());
  EXPECT_TRUE(daemon.alive()) << daemon.log();

  const std::string v2_bytes = Checkpoint(8, 1 << 20, 2.0f);
  OverwriteInPlace(path, v2_bytes);
  const std::string v2 = AwaitNewVersion(*store, "big", v1);
  ASSERT_FALSE(v2.empty()) << daemon.log();
  EXPECT_EQ(Fetched(*store, "big"), TensorsOf(v2_bytes));
  client::Query pinned;
  pinned.version = v1;
  EXPECT_THAT(store->FetchAll("big", pinned), StatusIs(absl::StatusCode::kAborted));
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  ASSERT_OK_AND_ASSIGN(auto mapped, shm->MapTensors("big", {}));
  EXPECT_EQ(mapped.version, v2);
  ExpectHealthy(daemon);
}

TEST(Issue11Test, ASameSizeRewriteInPlaceIsServedAsANewVersionNeverMixedWithTheOld) {
  // Item 5: a same-size rewrite kept the old version id, so gRPC clients got
  // DATA_LOSS and a socket mapping changed under one version.
  const std::string models = ExampleModels();
  const std::string path = models + "/m.safetensors";
  const std::string v1_bytes = Checkpoint(4, 1 << 18, 1.0f);
  testing::WriteFileOrDie(path, v1_bytes);
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  const std::string v1 = CurrentVersion(*store, "m");
  EXPECT_EQ(Fetched(*store, "m"), TensorsOf(v1_bytes));
  const std::string v2_bytes = Checkpoint(4, 1 << 18, 3.0f);
  ASSERT_EQ(v2_bytes.size(), v1_bytes.size());
  OverwriteInPlace(path, v2_bytes);
  const std::string v2 = AwaitNewVersion(*store, "m", v1);
  ASSERT_FALSE(v2.empty()) << daemon.log();
  EXPECT_EQ(Fetched(*store, "m"), TensorsOf(v2_bytes));
  client::Query pinned;
  pinned.version = v1;
  EXPECT_THAT(store->FetchAll("m", pinned), StatusIs(absl::StatusCode::kAborted, HasSubstr("is gone")));
  ExpectHealthy(daemon);
}

TEST(Issue11Test, AStreamInFlightWhenItsFileIsTruncatedEndsWithAnErrorNotWithWrongBytes) {
  const std::string models = ExampleModels();
  const std::string path = models + "/big.safetensors";
  testing::WriteFileOrDie(path, Checkpoint(16, 1 << 20, 1.0f));  // 64 MiB
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  grpc::ClientContext ctx;
  pb::FetchTensorsRequest req;
  req.set_name("big");
  req.mutable_selection()->set_dtype("F16");  // every chunk read by the daemon itself
  auto reader = stub->FetchTensors(&ctx, req);
  pb::TensorChunk chunk;
  ASSERT_TRUE(reader->Read(&chunk));
  ASSERT_EQ(::truncate(path.c_str(), 1 << 20), 0);
  size_t last_chunks = 0;
  while (reader->Read(&chunk)) last_chunks += chunk.last();
  grpc::Status status = reader->Finish();
  EXPECT_FALSE(status.ok()) << "a truncated file cannot be streamed whole";
  EXPECT_LT(last_chunks, 16u);
  EXPECT_TRUE(daemon.alive()) << daemon.log();
  ExpectHealthy(daemon);
}

// Files under `dir`, hidden ones (temporaries) included.
size_t FilesUnder(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) n += e.is_regular_file() || e.is_symlink();
  return n;
}

TEST(Issue11Test, OnlyACommitMessageStoresAnUploadNeverTheEndOfAStream) {
  // Item 11: an upload cancelled by the client after its last byte was
  // committed (OnReadDone(false) means both "finished" and "cancelled").
  const std::string models = testing::MakeScratchDir("models");
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  const std::string bytes = Checkpoint(2, 1000, 1.0f);
  // How each upload ends: cancelled after the last byte, half-closed without a
  // commit, a commit that does not match, and a good one.
  enum class End { kCancel, kNoCommit, kWrongCrc, kCommit };
  auto upload_once = [&](const std::string& name, End end) {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = StartUpload(stub.get(), &ctx, &info, name);
    if (end != End::kCancel) return SendAndFinish(writer.get(), bytes, end != End::kNoCommit, end == End::kWrongCrc);
    pb::PutCheckpointRequest data;
    data.set_data(bytes);
    writer->Write(data);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // every byte has arrived
    ctx.TryCancel();
    writer->WritesDone();
    return writer->Finish();
  };
  // The daemon frees a cancelled upload's slot (2 per client) on its own
  // threads: on a loaded machine the next upload may find it still taken.
  auto upload = [&](const std::string& name, End end) {
    grpc::Status status = upload_once(name, end);
    for (int i = 0; i < 100 && status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      status = upload_once(name, end);
    }
    return status;
  };
  EXPECT_EQ(upload("cancelled", End::kCancel).error_code(), grpc::StatusCode::CANCELLED);
  grpc::Status no_commit = upload("uncommitted", End::kNoCommit);
  EXPECT_EQ(no_commit.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_THAT(no_commit.error_message(), HasSubstr("without a commit message; nothing was stored"));
  EXPECT_EQ(upload("corrupted", End::kWrongCrc).error_code(), grpc::StatusCode::DATA_LOSS);
  // The cancelled calls wind down (and remove their temporaries) on the
  // daemon's threads: wait for that, up to 10 s on a loaded machine.
  for (int i = 0; i < 200 && FilesUnder(models) != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(FilesUnder(models), 0u) << "nothing stored, no temporaries left";
  ASSERT_TRUE(upload("good", End::kCommit).ok());
  EXPECT_EQ(testing::ReadFileOrEmpty(models + "/good.safetensors"), bytes);
  EXPECT_EQ(FilesUnder(models), 1u);
}

TEST(Issue11Test, StreamsWhoseClientStoppedReadingAreCancelledAndTheirSlotsFreed) {
  // Item 10: 64 fetch streams that stop reading locked every other client out
  // for as long as that client lived.
  const std::string models = ExampleModels();
  testing::WriteFileOrDie(models + "/big.safetensors", Checkpoint(16, 1 << 20, 1.0f));  // 64 MiB
  Daemon daemon(models, {"--max-concurrent-fetches", "6", "--max-fetches-per-peer", "4", "--stream-idle-timeout", "1",
                         "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  struct Stalled {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<pb::TensorChunk>> reader;
  };
  std::vector<std::unique_ptr<Stalled>> stalled;
  for (int i = 0; i < 4; ++i) {  // a client that never reads
    auto s = std::make_unique<Stalled>();
    pb::FetchTensorsRequest req;
    req.set_name("big");
    s->reader = stub->FetchTensors(&s->ctx, req);
    stalled.push_back(std::move(s));
  }
  // All four are admitted (and, not reading, are a second from being cancelled).
  ASSERT_TRUE(Eventually([&] { return Metric(daemon, "weightstore_fetch_streams_active") == 4; })) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address(), {.max_resumes = 0}));
  EXPECT_THAT(store->FetchAll("tiny-mlp", {}),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-fetches-per-peer")));
  // The stalled streams are cancelled after a second of no progress; the
  // share is free again, and the daemon says what it did.
  absl::Status later;
  EXPECT_TRUE(Eventually([&] {
    later = store->FetchAll("tiny-mlp", {}).status();
    return later.ok();
  })) << later;
  // One freed slot is enough for that fetch; the governor may cancel the other
  // stalled streams a sweep later (on a loaded machine, under ASan). Reading
  // them before would be progress that saves them: wait for all four.
  EXPECT_TRUE(Eventually([&] { return Metric(daemon, "weightstore_fetch_streams_stalled_total") >= 4; }))
      << daemon.log();
  for (auto& s : stalled) {  // what they had buffered, then the daemon's cancellation
    pb::TensorChunk chunk;
    while (s->reader->Read(&chunk)) {
    }
    EXPECT_EQ(s->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_THAT(daemon.log(), HasSubstr("stalled stream cancelled"));
  ExpectHealthy(daemon);
}

TEST(Issue11Test, ASocketPeerThatCouldWriteACheckpointGetsASealedCopyNotTheFile) {
  // Item 12: a peer with the daemon's uid (the default allowed peer) could
  // reopen a FILE segment's descriptor through /proc/self/fd with O_RDWR and
  // change the checkpoint on disk.
  const std::string models = ExampleModels();
  const std::string bytes = Checkpoint(2, 4096, 1.0f);
  testing::WriteFileOrDie(models + "/m.safetensors", bytes);  // ours, mode 0644
  const std::string dir = testing::MakeScratchDir("sock");
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  const std::string socket = dir + "/ws.sock";
  Daemon daemon(models,
                {"--socket", socket, "--socket-allow-uid", std::to_string(::geteuid()), "--socket-allow-uid", "65534"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  ASSERT_OK_AND_ASSIGN(auto mapped, shm->MapTensors("m", {}));
  ASSERT_FALSE(mapped.segments.empty());
  for (const auto& segment : mapped.segments) {
    EXPECT_OK(CheckSealed(segment->fd(), "segment")) << "we own the file: a copy, sealed";
    const int rw = ::open(absl::StrCat("/proc/self/fd/", segment->fd()).c_str(), O_RDWR | O_CLOEXEC);
    if (rw >= 0) {
      EXPECT_EQ(::pwrite(rw, "x", 1, 0), -1);
      ::close(rw);
    }
  }
  EXPECT_EQ(testing::ReadFileOrEmpty(models + "/m.safetensors"), bytes);
  EXPECT_OK(mapped.Verify());
  // A peer that cannot write the file (uid 65534, no write bit for it) gets
  // the file itself: nothing copied.
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run the probe as another uid";
  std::string out;
  const std::string probe =
      absl::StrCat("setpriv --reuid 65534 --regid 0 --clear-groups ", WEIGHTSTORE_SHM_PROBE_PATH, " ", socket, " m");
  EXPECT_EQ(testing::RunCommand(probe, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr(" file\n"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr(" sealed\n")));
  ExpectHealthy(daemon);
}

TEST(Issue11Test, OneProcessCannotHoldEverySocketConnection) {
  // Item 14: one peer could hold all 256 socket connections (a thread each).
  const std::string models = ExampleModels();
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models,
                {"--socket", socket, "--socket-max-connections-per-peer", "4", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  std::vector<UniqueFd> held;
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, ConnectUnixSocket(socket));
    held.push_back(std::move(fd));
  }
  // The daemon has taken all four (and counted them as this process's).
  ASSERT_TRUE(Eventually([&] { return Metric(daemon, "weightstore_socket_connections") == 4; })) << daemon.log();
  ASSERT_OK_AND_ASSIGN(UniqueFd extra, ConnectUnixSocket(socket));
  std::string frame;
  std::vector<UniqueFd> fds;
  ASSERT_OK(RecvFrame(extra.get(), 1 << 20, &frame, &fds));
  pb::ShmResponse refused;
  ASSERT_TRUE(refused.ParseFromString(frame));
  EXPECT_EQ(refused.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(refused.message(), HasSubstr(absl::StrCat("pid ", ::getpid(), " has 4 connections")));
  // Another process is served meanwhile.
  std::string out;
  EXPECT_EQ(testing::RunCommand(absl::StrCat(WEIGHTSTORE_SHM_PROBE_PATH, " ", socket, " tiny-mlp"), &out), 0) << out;
  held.clear();  // and ours come back once we let go
  // Forked processes share their uid's quota.
  Daemon by_uid(models,
                {"--socket", socket + "2", "--socket-max-connections-per-uid", "3", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(by_uid.port(), 0) << by_uid.log();
  std::vector<UniqueFd> three;
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, ConnectUnixSocket(socket + "2"));
    three.push_back(std::move(fd));
  }
  ASSERT_TRUE(Eventually([&] { return Metric(by_uid, "weightstore_socket_connections") == 3; })) << by_uid.log();
  EXPECT_NE(testing::RunCommand(absl::StrCat(WEIGHTSTORE_SHM_PROBE_PATH, " ", socket, "2 tiny-mlp"), &out), 0);
  EXPECT_THAT(out, HasSubstr(absl::StrCat("uid ", ::geteuid(), " has 3 connections")));
  // The first daemon has seen ours close.
  ASSERT_TRUE(Eventually([&] { return Metric(daemon, "weightstore_socket_connections") == 0; })) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  EXPECT_OK(shm->ListCheckpoints().status());
  ExpectHealthy(daemon);
}

TEST(Issue11Test, AFetchSurvivesADaemonThatTakesSecondsToRestart) {
  // Item 14: clients gave up on a daemon that restarted in more than ~3 s.
  const std::string models = ExampleModels();
  const std::string bytes = Checkpoint(32, 1 << 19, 4.0f);  // 64 MiB: more than any window holds
  testing::WriteFileOrDie(models + "/big.safetensors", bytes);
  std::string address;
  {  // a free port, then the daemon on it
    Daemon probe(models);
    ASSERT_NE(probe.port(), 0) << probe.log();
    address = probe.address();
  }
  auto daemon = std::make_unique<Daemon>(models, std::vector<std::string>{}, address);
  ASSERT_EQ(daemon->address(), address) << daemon->log();
  struct KillingSink : client::CollectingSink {
    std::function<void()> after_third;
    int ended = 0;
    absl::Status End(const TensorSpec& spec) override {
      if (++ended == 3) after_third();
      return CollectingSink::End(spec);
    }
  } sink;
  std::thread restart;
  sink.after_third = [&] {
    daemon->Signal(SIGKILL);
    daemon->WaitExit(30000);
    restart = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::seconds(4));
      daemon = std::make_unique<Daemon>(models, std::vector<std::string>{}, address);
    });
  };
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(address));
  absl::Status fetched = store->FetchTensors("big", {}, &sink);
  restart.join();
  ASSERT_OK(fetched);
  std::map<std::string, std::string> got;
  for (const SharedTensor& t : sink.tensors()) got[t.spec.name] = std::string(t.bytes.view());
  EXPECT_EQ(got, TensorsOf(bytes));
  ExpectHealthy(*daemon);
}

TEST(Issue11Test, ReadClientsSeePathsRelativeToTheModelsFolderOrLoadRoot) {
  // Item 14: CheckpointInfo.path gave read clients absolute server paths.
  const std::string models = ExampleModels();
  const std::string root = testing::MakeScratchDir("root");
  fs::create_directories(root + "/team");
  testing::WriteFileOrDie(root + "/team/extra.safetensors", Checkpoint(1, 16, 1.0f));
  const std::string socket = testing::MakeScratchDir("sock") + "/ws.sock";
  Daemon daemon(models, {"--load-root", root, "--socket", socket});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  grpc::ClientContext ctx;
  pb::LoadCheckpointRequest load;
  load.set_path(root + "/team/extra.safetensors");
  pb::CheckpointInfo loaded;
  ASSERT_TRUE(stub->LoadCheckpoint(&ctx, load, &loaded).ok());
  EXPECT_EQ(loaded.path(), "team/extra.safetensors");
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  ASSERT_OK_AND_ASSIGN(auto list, store->ListCheckpoints());
  ASSERT_OK_AND_ASSIGN(auto shm, client::ConnectSharedMemoryStore(socket));
  ASSERT_OK_AND_ASSIGN(auto shm_list, shm->ListCheckpoints());
  for (const auto& listing : {list, shm_list}) {
    for (const auto& c : listing) {
      EXPECT_FALSE(absl::StartsWith(c.path, "/")) << c.path;
      EXPECT_THAT(c.path, ::testing::Not(HasSubstr(models))) << c.path;
    }
  }
  ASSERT_OK_AND_ASSIGN(auto tiny, store->GetCheckpoint("tiny-mlp"));
  EXPECT_EQ(tiny.path, "tiny-mlp.safetensors");
}

// Requests whose selection is hostile: each is refused quickly and cheaply.
pb::ListTensorsRequest Listing(const std::string& name) {
  pb::ListTensorsRequest req;
  req.set_name(name);
  return req;
}

grpc::Status List(pb::WeightStore::Stub* stub, const pb::ListTensorsRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  pb::ListTensorsResponse resp;
  return stub->ListTensors(&ctx, req, &resp);
}

TEST(Issue11Test, HostileSelectionsAreRefusedQuicklyAndCheaply) {
  const std::string models = ExampleModels();
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  const auto start = std::chrono::steady_clock::now();
  {  // Item 2: ten rules '' -> 'x' * 1000 grew names to ~10 GB.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    for (int i = 0; i < 10; ++i) {
      pb::RenameRule* rule = req.mutable_selection()->add_renames();
      rule->set_replacement(std::string(1000, 'x'));
    }
    grpc::Status st = List(stub.get(), req);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("past 4096 bytes"));
  }
  {  // Item 9: 1000 patterns [^a]{900} (12 KB of request) took 17 s and 2 GB.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    for (int i = 0; i < 1000; ++i) req.mutable_selection()->add_include("[^a]{900}");
    EXPECT_EQ(List(stub.get(), req).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    pb::ListTensorsRequest within_count = Listing("tiny-mlp");
    for (int i = 0; i < 200; ++i) within_count.mutable_selection()->add_exclude("[^a]{900}");
    grpc::Status st = List(stub.get(), within_count);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("regex budget"));
  }
  {  // Item 8: a target parameter path of 800k dots took 43 s of CPU.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    pb::TargetParameter* p = req.mutable_selection()->mutable_target()->add_parameters();
    p->set_path(std::string(800000, '.'));
    p->add_shape(1);
    req.mutable_selection()->set_allow_partial(true);
    EXPECT_EQ(List(stub.get(), req).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // Contiguous indices over names of thousands of numeric segments.
    pb::ListTensorsRequest req = Listing("tiny-mlp");
    std::string digits;
    for (int i = 0; i < 2000; ++i) absl::StrAppend(&digits, i % 10, ".");
    pb::RenameRule* rule = req.mutable_selection()->add_renames();
    rule->set_pattern("^");
    rule->set_replacement(digits);
    req.mutable_selection()->set_contiguous_indices(true);
    EXPECT_TRUE(List(stub.get(), req).ok());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  ExpectHealthy(daemon);
}

// Writes a .pt built by hand (pickle + zip) or by torch into `path`.
void WriteZip(const std::string& path, const std::vector<testing::ZipBuildEntry>& entries,
              const testing::ZipBuildOptions& options = {}) {
  testing::WriteFileOrDie(path, testing::BuildZip(entries, options));
}

TEST(Issue11Test, HostileFilesInTheModelsFolderAreReportedAndCostNothing) {
  const std::string models = ExampleModels();
  // Item 3: a 254-byte zip bomb: a ZIP64 data.pkl declaring 8 GiB.
  testing::ZipBuildOptions bomb;
  bomb.zip64 = true;
  bomb.method = 8;
  bomb.declared_size = uint64_t{8} << 30;
  WriteZip(models + "/bomb.pt", {{"bomb/data.pkl", std::string("\x03\x00", 2)}}, bomb);
  bomb.declared_size = uint64_t{100} << 20;  // under the pickle bound: deflate's ratio refuses it
  WriteZip(models + "/bomb2.pt", {{"bomb2/data.pkl", std::string("\x03\x00", 2)}}, bomb);
  // Item 7: a 2 MiB memoized key in dicts nested 63 deep.
  testing::PickleBuilder deep;
  deep.Proto(2);
  for (int i = 0; i < 63; ++i) {
    deep.EmptyDict().Mark();
    if (i == 0) {
      deep.Str(std::string(2 << 20, 'k')).Put(0);
    } else {
      deep.Get(0);
    }
  }
  deep.EmptyDict();
  for (int i = 0; i < 63; ++i) deep.SetItems();
  deep.Stop();
  WriteZip(models + "/deep.pt", {{"deep/data.pkl", deep.str()}, {"deep/byteorder", "little"}});
  // Item 6: torch.ones(1).expand(1 << 29), written by PyTorch itself.
  const std::string script =
      absl::StrCat("import torch; torch.save({'x': torch.ones(1).expand(1 << 29)}, '", models, "/broadcast.pt')");
  const std::string command = absl::StrCat(testing::TorchPython(), " -c ", testing::ShellQuote(script));
  std::string out;
  ASSERT_EQ(testing::RunCommand(command, &out), 0) << out;
  // Item 4: a symlink loop.
  fs::create_symlink("loop.safetensors", models + "/loop.safetensors");
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  for (const char* name : {"bomb", "bomb2", "deep", "broadcast", "loop"}) {
    EXPECT_THAT(store->GetCheckpoint(name), StatusIs(absl::StatusCode::kNotFound)) << name;
  }
  const std::string log = daemon.log();
  EXPECT_THAT(log, HasSubstr("pickles over 268435456 bytes are not read"));
  EXPECT_THAT(log, HasSubstr("more than deflate can expand"));
  EXPECT_THAT(log, HasSubstr("dict key of 2097152 bytes"));
  EXPECT_THAT(log, HasSubstr("expands 4 stored bytes to 2147483648"));
  EXPECT_THAT(log, HasSubstr("loop.safetensors"));
  // A rescan, by signal and by RPC, finds the same and keeps serving.
  daemon.Signal(SIGHUP);
  auto stub = Stub(daemon);
  grpc::ClientContext ctx;
  pb::RescanResponse rescan;
  EXPECT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &rescan).ok());
  // The same bomb uploaded is refused before it is stored.
  grpc::ClientContext put_ctx;
  pb::CheckpointInfo info;
  auto writer = StartUpload(stub.get(), &put_ctx, &info, "uploaded-bomb", "pt");
  EXPECT_EQ(SendAndFinish(writer.get(), testing::ReadFileOrEmpty(models + "/bomb.pt")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(fs::exists(models + "/uploaded-bomb.pt"));
  ExpectHealthy(daemon);
}

TEST(Issue11Test, LoadAndUploadStayInsideTheirFolders) {
  // Item 13: LoadCheckpoint read any path and quoted its first bytes; uploads
  // could be steered through a symlinked folder; a kill -9 mid-upload left a
  // temporary file forever.
  const std::string models = ExampleModels();
  const std::string outside = testing::MakeScratchDir("outside");
  fs::create_directory_symlink(outside, models + "/escape");
  auto daemon = std::make_unique<Daemon>(models);
  ASSERT_NE(daemon->port(), 0) << daemon->log();
  auto stub = Stub(*daemon);
  {
    grpc::ClientContext ctx;
    pb::LoadCheckpointRequest req;
    req.set_path("/etc/passwd");
    pb::CheckpointInfo info;
    grpc::Status st = stub->LoadCheckpoint(&ctx, req, &info);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(st.error_message(), ::testing::Not(HasSubstr("root:")));
  }
  auto begin_upload = [&](grpc::ClientContext* ctx, pb::CheckpointInfo* info, const std::string& name) {
    auto writer = StartUpload(stub.get(), ctx, info, name);
    pb::PutCheckpointRequest part;
    part.set_data(std::string(1 << 20, 'z'));
    writer->Write(part);
    return writer;
  };
  {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = begin_upload(&ctx, &info, "escape/x");
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(fs::is_empty(outside));
  }
  auto count_temporaries = [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(models)) n += IsAtomicFileTemporary(e.path().filename().string());
    return n;
  };
  {  // killed mid-upload: the temporary stays until a restarted daemon clears it
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = begin_upload(&ctx, &info, "half");
    EXPECT_TRUE(Eventually([&] { return count_temporaries() == 1; })) << "the upload began";
    daemon->Signal(SIGKILL);
    daemon->WaitExit(30000);
    ctx.TryCancel();
  }
  size_t temporaries = count_temporaries();
  EXPECT_EQ(temporaries, 1u);
  daemon = std::make_unique<Daemon>(models, std::vector<std::string>{"--abandoned-upload-seconds", "0"});
  ASSERT_NE(daemon->port(), 0) << daemon->log();
  EXPECT_THAT(daemon->log(), HasSubstr("removed the abandoned upload"));
  temporaries = 0;
  for (const auto& e : fs::directory_iterator(models))
    temporaries += IsAtomicFileTemporary(e.path().filename().string());
  EXPECT_EQ(temporaries, 0u);
  ExpectHealthy(*daemon);
}

TEST(Issue11Test, UploadsAreSharedPerClientAndAStalledOneIsCancelled) {
  // An upload that stalls holds a temporary file and descriptors; without a cap
  // any number of them could.
  const std::string models = ExampleModels();
  Daemon daemon(models, {"--max-uploads-per-peer", "2", "--stream-idle-timeout", "1"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  struct Upload {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    std::unique_ptr<grpc::ClientWriter<pb::PutCheckpointRequest>> writer;
  };
  auto begin = [&](const std::string& name) {
    auto u = std::make_unique<Upload>();
    u->writer = StartUpload(stub.get(), &u->ctx, &u->info, name);
    return u;
  };
  auto first = begin("a"), second = begin("b");
  // Both are admitted: each has its temporary (and, sending nothing, is a
  // second from being cancelled).
  auto temporaries_now = [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(models)) n += IsAtomicFileTemporary(e.path().filename().string());
    return n;
  };
  ASSERT_TRUE(Eventually([&] { return temporaries_now() == 2; })) << daemon.log();
  auto third = begin("c");
  third->writer->WritesDone();
  grpc::Status refused = third->writer->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("--max-uploads-per-peer"));
  // The two that send nothing are cancelled, their temporaries removed (once
  // the daemon's side of the call has wound down).
  for (auto* u : {first.get(), second.get()}) EXPECT_EQ(u->writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return temporaries_now() == 0; })) << temporaries_now() << " temporaries left";
  EXPECT_THAT(daemon.log(), HasSubstr("\"what\":\"PutCheckpoint uploads\""));
  ExpectHealthy(daemon);
}

TEST(Issue11Test, ACallsSlotIsFreeOnceItsClientSeesItEnd) {
  // A client at its share that starts its next call when one ends was refused
  // now and then (CI: RESOURCE_EXHAUSTED for an upload right after another):
  // the slot was freed only when the daemon's side of the call wound down.
  const std::string models = ExampleModels();
  Daemon daemon(models, {"--max-fetches-per-peer", "1", "--max-uploads-per-peer", "1"});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  auto stub = Stub(daemon);
  pb::FetchTensorsRequest req;
  req.set_name("tiny-mlp");
  for (int i = 0; i < 300; ++i) {
    grpc::Status s = Fetch(stub.get(), req);
    ASSERT_TRUE(s.ok()) << "fetch " << i << ": " << s.error_message();
  }
  const std::string good = testing::ReadFileOrEmpty(models + "/tiny-mlp.safetensors");
  ASSERT_FALSE(good.empty());
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext ctx;
    pb::CheckpointInfo info;
    auto writer = StartUpload(stub.get(), &ctx, &info, absl::StrCat("seq/", i % 2 == 0 ? "ok-" : "bad-", i));
    // Every other one fails its CRC check: an error frees the slot as early.
    grpc::Status s = SendAndFinish(writer.get(), good, /*commit=*/true, /*corrupt=*/i % 2 != 0);
    EXPECT_EQ(s.error_code(), i % 2 == 0 ? grpc::StatusCode::OK : grpc::StatusCode::DATA_LOSS)
        << "upload " << i << ": " << s.error_message();
  }
  ExpectHealthy(daemon);
}

TEST(Issue11Test, ErrorsTellClientsNoServerPaths) {
  const std::string models = ExampleModels();
  Daemon daemon(models);
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectRemoteStore(daemon.address()));
  client::Query query;
  query.selection.top_level_key = "nope";
  absl::Status status = store->ListTensors("tiny-mlp-torch", query).status();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kNotFound, HasSubstr("'tiny-mlp-torch.pt' has no tensors")));
  EXPECT_THAT(std::string(status.message()), ::testing::Not(HasSubstr(models)));
}

}  // namespace
}  // namespace weightstore
