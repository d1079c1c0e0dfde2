// The same-host socket of a real weightstored: processes map its segments
// read-only, see identical bytes, cannot write them, keep them after unload,
// eviction and a daemon crash; bad peers and bad frames are refused while
// everyone else is served.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "client/materialize.h"
#include "client/store.h"
#include "core/checkpoint.h"
#include "core/crc32c.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "core/shm/filled_memfd.h"
#include "core/shm/sealed_memfd.h"
#include "core/shm/unix_socket.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/shm.pb.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace fs = std::filesystem;
namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::weightstore::testing::StatusIs;

std::string ProbePath() { return WEIGHTSTORE_SHM_PROBE_PATH; }

// Writes a SafeTensors file of `count` F32 tensors of `floats` elements each.
void WriteFloats(const std::string& path, int count, size_t floats, float seed) {
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < count; ++i) {
    std::vector<std::byte> data(floats * 4);
    for (size_t k = 0; k < floats; ++k) {
      float v = seed + static_cast<float>(i) + static_cast<float>(k) / 8;
      std::memcpy(data.data() + 4 * k, &v, 4);
    }
    tensors.push_back({{absl::StrCat("w.", i), DType::kF32, {floats}}, SharedBytes::FromVector(std::move(data))});
  }
  testing::WriteFileOrDie(path, *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
}

// Runs weightstored with a socket in a scratch folder.
struct SocketDaemon {
  explicit SocketDaemon(const std::string& models, std::vector<std::string> extra = {})
      : socket(testing::MakeScratchDir("sock") + "/ws.sock") {
    extra.push_back("--socket");
    extra.push_back(socket);
    daemon = std::make_unique<Daemon>(models, extra);
  }
  std::string socket;
  std::unique_ptr<Daemon> daemon;
};

std::unique_ptr<client::SharedMemoryStore> ConnectShm(const std::string& socket) {
  auto store = client::ConnectSharedMemoryStore(socket);
  EXPECT_OK(store.status());
  return store.ok() ? *std::move(store) : nullptr;
}

client::Query CastTo(DType dtype) {
  client::Query q;
  q.selection.dtype = dtype;
  return q;
}

// Memfds weightstored holds open, by /proc/PID/fd.
int MemfdsHeldBy(pid_t pid) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec)) {
    std::string target = fs::read_symlink(e.path(), ec).string();
    if (target.find("memfd:weightstore:") != std::string::npos) ++n;
  }
  return n;
}

class ShmTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models_ = new std::string(testing::MakeFixtureModelsDir());
    // These tests run as root, which could reopen a file writable: they trust
    // their peers, to see the files themselves passed (issue 11 tests "auto").
    server_ = new SocketDaemon(*models_, {"--socket-file-segments", "always"});
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(server_->daemon->port(), 0) << server_->daemon->log(); }

  static std::string* models_;
  static SocketDaemon* server_;
};
std::string* ShmTest::models_ = nullptr;
SocketDaemon* ShmTest::server_ = nullptr;

TEST_F(ShmTest, SocketFileIsGroupOnly) {
  struct stat st;
  ASSERT_EQ(::stat(server_->socket.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

TEST_F(ShmTest, MapsEveryFixtureByteForByteWithoutCopying) {
  auto store = ConnectShm(server_->socket);
  ASSERT_OK_AND_ASSIGN(auto list, store->ListCheckpoints());
  ASSERT_GT(list.size(), 40u);
  for (const auto& c : list) {
    SCOPED_TRACE(c.name);
    ASSERT_OK_AND_ASSIGN(auto local, Checkpoint::Open(*models_ + "/" + c.path));
    ASSERT_OK_AND_ASSIGN(client::MappedTensors mapped, store->MapTensors(c.name, {}));
    ASSERT_EQ(mapped.tensors.size(), local->size());
    EXPECT_OK(mapped.Verify());
    for (size_t i = 0; i < mapped.tensors.size(); ++i) {
      ASSERT_OK_AND_ASSIGN(SharedTensor want, local->Read(local->entries()[i]));
      EXPECT_EQ(mapped.tensors[i].spec, want.spec);
      EXPECT_TRUE(mapped.tensors[i].bytes.view() == want.bytes.view()) << want.spec.name;
    }
  }
}

TEST_F(ShmTest, SafeTensorsArePassedAsTheFileItselfAndCastsAsOneSealedMemfd) {
  auto store = ConnectShm(server_->socket);
  ASSERT_OK_AND_ASSIGN(auto summary, store->GetCheckpoint("safetensors/multi_layer"));
  ASSERT_OK_AND_ASSIGN(client::MappedTensors plain, store->MapTensors("safetensors/multi_layer", {}));
  ASSERT_EQ(plain.segments.size(), 1u);
  struct stat file_st, seg_st;
  ASSERT_EQ(::stat((*models_ + "/" + summary.path).c_str(), &file_st), 0);
  ASSERT_EQ(::fstat(plain.segments[0]->fd(), &seg_st), 0);
  EXPECT_EQ(seg_st.st_ino, file_st.st_ino);  // the checkpoint file itself
  EXPECT_FALSE(CheckSealed(plain.segments[0]->fd(), "file").ok());

  // Cast: floating-point tensors are materialized into one sealed memfd; the
  // integer ones (num_batches_tracked) still come from the file.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors cast, store->MapTensors("safetensors/multi_layer", CastTo(DType::kF16)));
  ASSERT_EQ(cast.segments.size(), 2u);
  const int sealed = CheckSealed(cast.segments[0]->fd(), "0").ok() ? 0 : 1;
  EXPECT_OK(CheckSealed(cast.segments[sealed]->fd(), "segment"));
  EXPECT_FALSE(CheckSealed(cast.segments[1 - sealed]->fd(), "file").ok());
  EXPECT_OK(cast.Verify());
  for (const SharedTensor& t : cast.tensors) {
    EXPECT_EQ(t.spec.dtype, IsFloatingPoint(t.spec.dtype) ? DType::kF16 : DType::kI64) << t.spec.name;
  }
  // The same transformation again is the same segment, not a new one.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors again, store->MapTensors("safetensors/multi_layer", CastTo(DType::kF16)));
  ASSERT_EQ(again.segments.size(), 2u);
  ASSERT_EQ(::fstat(cast.segments[sealed]->fd(), &file_st), 0);
  ASSERT_EQ(::fstat(again.segments[sealed]->fd(), &seg_st), 0);
  EXPECT_EQ(seg_st.st_ino, file_st.st_ino);
}

TEST_F(ShmTest, TwoProcessesMapTheSameSegmentsAndSeeIdenticalBytes) {
  const std::string name = "pytorch-models/linear";
  auto store = ConnectShm(server_->socket);
  ASSERT_OK_AND_ASSIGN(client::MappedTensors mine, store->MapTensors(name, CastTo(DType::kF64)));
  std::map<std::string, uint32_t> want;
  for (const auto& t : mine.tensors) want[t.spec.name] = Crc32c(t.bytes.view());
  std::set<std::string> my_segments;
  for (const auto& s : mine.segments) {
    struct stat st;
    ::fstat(s->fd(), &st);
    my_segments.insert(absl::StrCat(st.st_dev, ":", st.st_ino));
  }
  std::string out;
  ASSERT_EQ(
      testing::RunCommand(absl::StrCat(ProbePath(), " ", server_->socket, " ", name, " --dtype f64"), &out, false), 0)
      << out;
  std::map<std::string, uint32_t> theirs;
  std::set<std::string> their_segments;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() == 3 && f[0] == "tensor") theirs[f[1]] = static_cast<uint32_t>(std::stoul(f[2]));
    if (f.size() == 5 && f[0] == "segment") their_segments.insert(f[2]);
  }
  EXPECT_EQ(theirs, want);
  EXPECT_EQ(their_segments, my_segments);  // the same inodes: one copy in memory
}

TEST_F(ShmTest, TableOnlyListingMaterializesNothing) {
  auto store = ConnectShm(server_->socket);
  client::Query q = CastTo(DType::kF64);
  q.with_checksums = true;
  q.selection.include = {"fc1"};
  const int before = MemfdsHeldBy(server_->daemon->pid());
  ASSERT_OK_AND_ASSIGN(client::TensorListing listing, store->ListTensors("burnpack/mnist", q));
  EXPECT_EQ(MemfdsHeldBy(server_->daemon->pid()), before);
  ASSERT_FALSE(listing.tensors.empty());
  for (const auto& t : listing.tensors) {
    EXPECT_THAT(t.spec.name, HasSubstr("fc1"));
    EXPECT_EQ(t.spec.dtype, DType::kF64);
    EXPECT_TRUE(t.crc32c.has_value());
  }
  // The checksums listed are those of the bytes mapped later.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors mapped, store->MapTensors("burnpack/mnist", q));
  ASSERT_EQ(mapped.tensors.size(), listing.tensors.size());
  for (size_t i = 0; i < mapped.tensors.size(); ++i) {
    EXPECT_EQ(Crc32c(mapped.tensors[i].bytes.view()), *listing.tensors[i].crc32c);
  }
}

TEST_F(ShmTest, ApplyingToATargetReturnsTheLoadResult) {
  auto store = ConnectShm(server_->socket);
  client::Query q;
  q.target = TargetSchema{};
  q.target->parameters.push_back({"fc1.weight", DType::kF32, {1600, 128}, ""});
  q.target->parameters.push_back({"absent.weight", DType::kF32, {3}, ""});
  q.allow_partial = true;
  ASSERT_OK_AND_ASSIGN(client::MappedTensors mapped, store->MapTensors("burnpack/mnist", q));
  ASSERT_TRUE(mapped.apply_result.has_value());
  EXPECT_THAT(mapped.apply_result->applied, ::testing::ElementsAre("fc1.weight"));
  EXPECT_THAT(mapped.apply_result->missing, ::testing::ElementsAre("absent.weight"));
  ASSERT_EQ(mapped.tensors.size(), 1u);
}

TEST_F(ShmTest, UnknownCheckpointAndBadPatternAreClearErrors) {
  auto store = ConnectShm(server_->socket);
  EXPECT_THAT(store->MapTensors("nope", {}), StatusIs(absl::StatusCode::kNotFound, HasSubstr("'nope'")));
  client::Query bad;
  bad.selection.include = {"(unclosed"};
  EXPECT_THAT(store->MapTensors("burnpack/mnist", bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(unclosed")));
  // The connection is still good.
  EXPECT_OK(store->GetCheckpoint("burnpack/mnist").status());
}

// Sends raw bytes on a fresh connection and returns the daemon's answer, if any.
absl::StatusOr<pb::ShmResponse> RawExchange(const std::string& socket, const std::string& bytes) {
  absl::StatusOr<UniqueFd> fd = ConnectUnixSocket(socket);
  if (!fd.ok()) return fd.status();
  (void)SetSocketTimeouts(fd->get(), std::chrono::seconds(10));
  if (::send(fd->get(), bytes.data(), bytes.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(bytes.size())) {
    return absl::UnavailableError("send");
  }
  std::string frame;
  std::vector<UniqueFd> fds;
  absl::Status status = RecvFrame(fd->get(), 1 << 20, &frame, &fds);
  if (!status.ok()) return status;
  pb::ShmResponse response;
  if (!response.ParseFromString(frame)) return absl::DataLossError("not a ShmResponse");
  return response;
}

std::string Framed(const std::string& payload) {
  const uint32_t n = static_cast<uint32_t>(payload.size());
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + payload;
}

TEST_F(ShmTest, GarbageTruncatedFramesAndAbsurdLengthsGetErrorsAndOthersKeepBeingServed) {
  auto bystander = ConnectShm(server_->socket);
  ASSERT_OK_AND_ASSIGN(client::MappedTensors before, bystander->MapTensors("burnpack/mnist", {}));

  ASSERT_OK_AND_ASSIGN(pb::ShmResponse garbage, RawExchange(server_->socket, Framed("\xff\xfe garbage \x01")));
  EXPECT_EQ(garbage.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(garbage.message(), HasSubstr("not a ShmRequest"));

  ASSERT_OK_AND_ASSIGN(pb::ShmResponse absurd, RawExchange(server_->socket, std::string("\xff\xff\xff\xff", 4)));
  EXPECT_EQ(absurd.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(absurd.message(), HasSubstr("4294967295"));

  pb::ShmRequest empty;
  ASSERT_OK_AND_ASSIGN(pb::ShmResponse no_request, RawExchange(server_->socket, Framed(empty.SerializeAsString())));
  EXPECT_EQ(no_request.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));

  {  // a frame cut short, then the client leaves
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, ConnectUnixSocket(server_->socket));
    std::string partial = Framed(std::string(100, 'x')).substr(0, 50);
    ASSERT_EQ(::send(fd.get(), partial.data(), partial.size(), MSG_NOSIGNAL), 50);
  }
  {  // a request carrying descriptors
    ASSERT_OK_AND_ASSIGN(UniqueFd fd, ConnectUnixSocket(server_->socket));
    pb::ShmRequest list;
    list.mutable_list_checkpoints();
    int pass = ::open("/dev/null", O_RDONLY);
    ASSERT_OK(SendFrame(fd.get(), list.SerializeAsString(), std::span<const int>(&pass, 1)));
    ::close(pass);
    std::string frame;
    std::vector<UniqueFd> fds;
    ASSERT_OK(RecvFrame(fd.get(), 1 << 20, &frame, &fds));
    pb::ShmResponse response;
    ASSERT_TRUE(response.ParseFromString(frame));
    EXPECT_EQ(response.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(response.message(), HasSubstr("descriptors"));
  }
  // A client that connects and says nothing does not hold anyone up.
  ASSERT_OK_AND_ASSIGN(UniqueFd silent, ConnectUnixSocket(server_->socket));

  ASSERT_OK_AND_ASSIGN(client::MappedTensors after, bystander->MapTensors("burnpack/mnist", {}));
  EXPECT_OK(after.Verify());
  EXPECT_OK(before.Verify());
  EXPECT_NE(server_->daemon->port(), 0);
}

TEST_F(ShmTest, MaterializeOnTheCpuFromEveryStoreIsByteExact) {
  const std::string name = "pytorch-models/linear";
  ASSERT_OK_AND_ASSIGN(auto local, client::OpenLocalStore(*models_));
  ASSERT_OK_AND_ASSIGN(std::vector<SharedTensor> want, local->FetchAll(name, CastTo(DType::kF16)));
  std::vector<std::pair<std::string, std::unique_ptr<client::Store>>> stores;
  stores.emplace_back("local", std::move(local));
  stores.emplace_back("socket", ConnectShm(server_->socket));
  stores.emplace_back("grpc", *client::ConnectRemoteStore(server_->daemon->address()));
  for (auto& [label, store] : stores) {
    SCOPED_TRACE(label);
    ASSERT_OK_AND_ASSIGN(auto got, client::Materialize(*store, name, CastTo(DType::kF16)));
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].spec, want[i].spec);
      EXPECT_EQ(got[i].device.ToString(), "cpu");
      EXPECT_EQ(absl::string_view(static_cast<const char*>(got[i].data()), got[i].spec.byte_size()),
                want[i].bytes.view());
    }
  }
}

// This process's resident set and its peak since the last reset, in bytes
// (/proc/self/status).
std::pair<uint64_t, uint64_t> RssAndPeak() {
  std::ifstream status("/proc/self/status");
  uint64_t rss = 0, peak = 0;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::stoull(line.substr(6)) * 1024;
    if (line.rfind("VmHWM:", 0) == 0) peak = std::stoull(line.substr(6)) * 1024;
  }
  return {rss, peak};
}

// A copying fetch reads shared memory (the sealed or filled copy, "auto"
// for a peer that could write the file) through its descriptor: none of its
// pages become this process's. A file handed out ("always") is copied from
// its mapping, whose pages are dropped as the copy goes when asked.
TEST(ShmCopyTest, ACopyIntoPlacesReadsSharedMemoryUnmappedAndDropsAFilesPagesAsItGoes) {
  // One 64 MiB tensor, served as a sealed copy (the default for a root peer)
  // and as the file itself.
  const std::string models = testing::MakeScratchDir("shm-copy");
  constexpr size_t kFloats = size_t{16} << 20;
  WriteFloats(models + "/big.safetensors", 1, kFloats, 3.0f);
  for (const char* segments : {"auto", "always"}) {
    SCOPED_TRACE(segments);
    SocketDaemon server(models, {"--socket-file-segments", segments});
    ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
    auto store = ConnectShm(server.socket);
    ASSERT_NE(store, nullptr);
    ASSERT_OK(store->FetchAll("big", {}).status());  // the daemon's segment and checksums, made once

    std::vector<std::byte> place(kFloats * 4);  // written (zeroed) already: resident before the copy
    // How far this process's RSS peak rose above its start while `run` ran
    // (the peak reset first: "5" to clear_refs).
    auto peak_rise = [&](const std::function<void()>& run) -> uint64_t {
      std::ofstream("/proc/self/clear_refs") << "5";
      const uint64_t start = RssAndPeak().first;
      run();
      const uint64_t peak = RssAndPeak().second;
      return peak > start ? peak - start : 0;
    };
    auto copy = [&](bool release) {
      absl::flat_hash_map<std::string, client::PlacingSink::Place> places;
      places["w.0"] = {DType::kF32, {kFloats}, place};
      client::PlacingSink sink(std::move(places));
      client::Query query;
      query.release_source_pages = release;
      EXPECT_OK(store->FetchTensors("big", query, &sink));
      EXPECT_THAT(sink.placed(), ::testing::ElementsAre("w.0"));
    };
    // The measure sees a mapping read whole...
    const uint64_t mapped = peak_rise([&] {
      auto views = store->MapTensors("big", {});
      ASSERT_OK(views.status());
      uint64_t sum = 0;
      for (const auto& t : views->tensors) {
        for (size_t i = 0; i < t.bytes.size(); i += 4096) sum += static_cast<uint8_t>(t.bytes.data()[i]);
      }
      EXPECT_NE(sum, 1u);
    });
    // ...and a copy from shared memory brings none of its pages in; one from
    // a file keeps them only when not asked to drop them.
    const uint64_t kept = peak_rise([&] { copy(false); });
    const uint64_t dropped = peak_rise([&] { copy(true); });
    std::cout << "peak RSS rise over 64 MiB (" << segments << "): mapped and read " << (mapped >> 20) << " MiB, copied "
              << (kept >> 20) << " MiB, copied dropping pages " << (dropped >> 20) << " MiB\n";
    EXPECT_GE(mapped, kFloats * 4 * 3 / 4);
    if (std::string(segments) == "auto") {
      EXPECT_LT(kept, kFloats * 4 / 2);
    } else {
      EXPECT_GE(kept, kFloats * 4 * 3 / 4);
    }
    EXPECT_LT(dropped, kFloats * 4 / 2);
    float first, last;
    std::memcpy(&first, place.data(), 4);
    std::memcpy(&last, place.data() + place.size() - 4, 4);
    EXPECT_EQ(first, 3.0f);
    EXPECT_EQ(last, 3.0f + static_cast<float>(kFloats - 1) / 8);
  }
}

TEST(DeviceTest, ParsesCpuAndCudaNamesAndRefusesOthers) {
  ASSERT_OK_AND_ASSIGN(client::Device cuda, client::Device::Parse("cuda:2"));
  EXPECT_EQ(cuda.kind, client::Device::Kind::kCuda);
  EXPECT_EQ(cuda.index, 2);
  EXPECT_EQ(client::Device::Parse("cpu")->ToString(), "cpu");
  EXPECT_EQ(client::Device::Parse("cuda")->ToString(), "cuda:0");
  EXPECT_THAT(client::Device::Parse("tpu"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'tpu'")));
  EXPECT_THAT(client::Device::Parse("cuda:-1"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ShmAccessTest, DisallowedUidIsRefusedByPeerCredentials) {
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/m.safetensors", 2, 64, 1);
  // Only uid 65534 may connect; this test runs as another uid.
  ASSERT_NE(::geteuid(), 65534u);
  SocketDaemon server(models, {"--socket-allow-uid", "65534"});
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  ASSERT_OK_AND_ASSIGN(auto store, client::ConnectSharedMemoryStore(server.socket));
  EXPECT_THAT(store->ListCheckpoints(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr(absl::StrCat("uid ", ::geteuid()))));
  // Our gid on the list lets us in.
  SocketDaemon by_gid(models, {"--socket-allow-uid", "65534", "--socket-allow-gid", std::to_string(::getegid())});
  ASSERT_NE(by_gid.daemon->port(), 0) << by_gid.daemon->log();
  ASSERT_OK_AND_ASSIGN(auto allowed, client::ConnectSharedMemoryStore(by_gid.socket));
  EXPECT_OK(allowed->ListCheckpoints().status());
}

TEST(ShmAccessTest, ASupplementaryGroupOnTheListLetsAPeerIn) {
  // setpriv (util-linux) sets the probe's groups; that takes root.
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give the client process other groups";
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/m.safetensors", 2, 64, 1);
  // Neither uid 0 nor gid 0 is on the lists: only the supplementary group 4242 is.
  SocketDaemon server(models, {"--socket-allow-uid", "65534", "--socket-allow-gid", "4242"});
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  const std::string probe = absl::StrCat(ProbePath(), " ", server.socket, " m");
  std::string out;
  EXPECT_EQ(testing::RunCommand(absl::StrCat("setpriv --regid 0 --groups 4242 ", probe), &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("tensor w.0 "));
  EXPECT_NE(testing::RunCommand(absl::StrCat("setpriv --regid 0 --groups 4343 ", probe), &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("PERMISSION_DENIED"));
  EXPECT_THAT(out, HasSubstr("groups 4343,0"));
}

// Runs on checkpoints written by the test: the checks below try to write, and a
// root test process could otherwise damage a shared fixture if one ever passed.
TEST(ShmSealTest, ClientWritesStayInItsOwnPagesAndNoSegmentReopensWritable) {
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/m.safetensors", 2, 4096, 3);
  SocketDaemon server(models, {"--socket-file-segments", "always"});
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  auto store = ConnectShm(server.socket);
  ASSERT_OK_AND_ASSIGN(client::MappedTensors file, store->MapTensors("m", {}));
  ASSERT_OK_AND_ASSIGN(client::MappedTensors memfd, store->MapTensors("m", CastTo(DType::kBF16)));
  ASSERT_EQ(file.segments.size(), 1u);
  ASSERT_EQ(memfd.segments.size(), 1u);
  ASSERT_FALSE(CheckSealed(file.segments[0]->fd(), "file").ok());
  ASSERT_OK(CheckSealed(memfd.segments[0]->fd(), "memfd"));
  for (const auto* mapped : {&file, &memfd}) {
    const MappedFile& segment = *mapped->segments[0];
    SCOPED_TRACE(segment.path());
    EXPECT_EQ(::fcntl(segment.fd(), F_GETFL) & O_ACCMODE, O_RDONLY);
    EXPECT_EQ(::mmap(nullptr, segment.size(), PROT_READ | PROT_WRITE, MAP_SHARED, segment.fd(), 0), MAP_FAILED);
    EXPECT_LT(::write(segment.fd(), "x", 1), 0);
    EXPECT_NE(::ftruncate(segment.fd(), 0), 0);
  }
  // The memfd reopened for writing through /proc still refuses every change.
  int rw = ::open(absl::StrCat("/proc/self/fd/", memfd.segments[0]->fd()).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(rw, 0);
  EXPECT_LT(::write(rw, "x", 1), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::mmap(nullptr, memfd.segments[0]->size(), PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0), MAP_FAILED);
  EXPECT_NE(::ftruncate(rw, 1), 0);
  EXPECT_NE(::fcntl(rw, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);  // F_SEAL_SEAL: no seal can change
  ::close(rw);
  EXPECT_OK(memfd.Verify());
  EXPECT_OK(file.Verify());
  // By default a client cannot even write to its own mapping.
  const MappedFile& segment = *file.segments[0];
  const long page = ::sysconf(_SC_PAGESIZE);
  void* page_start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(segment.bytes().data()) & ~(page - 1));
  EXPECT_NE(::mprotect(page_start, page, PROT_READ | PROT_WRITE), 0);
  // With copy-on-write mappings (the Python package's), a write through one
  // copies the page for this process, and the daemon's bytes, and every other
  // mapping of them, stay as served.
  client::SharedMemoryOptions cow;
  cow.copy_on_write = true;
  ASSERT_OK_AND_ASSIGN(auto cow_store, client::ConnectSharedMemoryStore(server.socket, cow));
  for (const client::Query& query : {client::Query{}, CastTo(DType::kBF16)}) {
    ASSERT_OK_AND_ASSIGN(client::MappedTensors scratch, cow_store->MapTensors("m", query));
    auto* byte = const_cast<std::byte*>(scratch.tensors[0].bytes.data());
    *byte = ~*byte;
    EXPECT_FALSE(scratch.Verify().ok());
    ASSERT_OK_AND_ASSIGN(client::MappedTensors again, cow_store->MapTensors("m", query));
    EXPECT_OK(again.Verify());
  }
  EXPECT_OK(memfd.Verify());
  EXPECT_OK(file.Verify());
}

client::Query Paths(std::vector<std::string> paths) {
  client::Query q;
  q.selection.paths = std::move(paths);
  return q;
}

// Device and inode of a mapped segment.
std::string Identity(const MappedFile& segment) {
  struct stat st;
  if (::fstat(segment.fd(), &st) != 0) return "";
  return absl::StrCat(st.st_dev, ":", st.st_ino);
}

TEST(ShmFilledCopyTest, AFileAPeerCouldWriteIsCopiedATensorAtATimeOnceForEverySelection) {
  const std::string models = testing::MakeScratchDir("models");
  const uint64_t tensor_bytes = 256 * 1024;
  WriteFloats(models + "/m.safetensors", 4, tensor_bytes / 4, 5);
  const uint64_t file_bytes = fs::file_size(models + "/m.safetensors");
  // Our own file: we could write it, so the default (auto) sends a copy.
  SocketDaemon server(models, {"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  auto copied = [&] {
    return testing::MetricValue(server.daemon->metrics_port(), "weightstore_shm_bytes", {"kind=\"segments\""});
  };
  auto store = ConnectShm(server.socket);
  // The first request copies its tensor only, into a copy shaped as the file.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors first, store->MapTensors("m", Paths({"w.1"})));
  ASSERT_EQ(first.segments.size(), 1u);
  EXPECT_OK(CheckFilledSeals(first.segments[0]->fd(), "copy"));
  EXPECT_FALSE(CheckSealed(first.segments[0]->fd(), "copy").ok()) << "sealed as it is filled, not whole";
  EXPECT_OK(first.Verify());
  const std::string copy = Identity(*first.segments[0]);
  const double one = copied();
  EXPECT_GE(one, tensor_bytes);
  EXPECT_LE(one, tensor_bytes + 8192) << "one tensor, in whole pages";
  // Another selection shares the copy and adds only what it lacks.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors second, store->MapTensors("m", Paths({"w.1", "w.3"})));
  ASSERT_EQ(second.segments.size(), 1u);
  EXPECT_EQ(Identity(*second.segments[0]), copy);
  EXPECT_LE(copied(), one + tensor_bytes + 8192);
  // All of it: one copy of the file, however many selections asked.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors all, store->MapTensors("m", {}));
  ASSERT_EQ(all.segments.size(), 1u);
  EXPECT_EQ(Identity(*all.segments[0]), copy);
  EXPECT_EQ(all.segments[0]->size(), file_bytes);
  EXPECT_LE(copied(), 4 * tensor_bytes + 4 * 8192);
  for (const client::MappedTensors* mapped : {&first, &second, &all}) EXPECT_OK(mapped->Verify());
  // Every byte the daemon described is the file's.
  const std::string file = testing::ReadFileOrEmpty(models + "/m.safetensors");
  for (const auto& t : all.tensors) {
    const uint64_t at =
        static_cast<uint64_t>(t.bytes.data() - all.segments[0]->bytes().data()) + all.segments[0]->offset();
    EXPECT_EQ(t.bytes.view(), absl::string_view(file).substr(at, t.bytes.size())) << t.spec.name;
  }
  // Clients on several connections at once share the copy too.
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      auto mine = client::ConnectSharedMemoryStore(server.socket);
      if (!mine.ok()) return;
      auto mapped = (*mine)->MapTensors("m", Paths({absl::StrCat("w.", i)}));
      if (mapped.ok() && mapped->Verify().ok() && Identity(*mapped->segments[0]) == copy) ++good;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(good.load(), 4);
  // A cast is still materialized into a segment sealed whole.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors cast, store->MapTensors("m", CastTo(DType::kBF16)));
  ASSERT_EQ(cast.segments.size(), 1u);
  EXPECT_OK(CheckSealed(cast.segments[0]->fd(), "cast"));
}

TEST(ShmFilledCopyTest, ACopyThatFillsTheBudgetLeavesTheRestToCopiesPerRequest) {
  // A 2 MiB file read a tensor at a time under a 1 MiB budget: the file's
  // copy stops growing at the budget, and the tensors past it come in
  // segments of their own (evicting the copy), so every request is served.
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/m.safetensors", 8, 64 * 1024, 7);  // 8 tensors of 256 KiB
  SocketDaemon server(models, {"--shm-budget", "1MiB"});
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  auto store = ConnectShm(server.socket);
  int filled = 0, sealed = 0;
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < 8; ++i) {
      SCOPED_TRACE(absl::StrCat("round ", round, ", w.", i));
      ASSERT_OK_AND_ASSIGN(client::MappedTensors one, store->MapTensors("m", Paths({absl::StrCat("w.", i)})));
      ASSERT_EQ(one.segments.size(), 1u);
      EXPECT_OK(one.Verify());
      if (CheckSealed(one.segments[0]->fd(), "s").ok()) {
        ++sealed;
      } else {
        EXPECT_OK(CheckFilledSeals(one.segments[0]->fd(), "s"));
        ++filled;
      }
    }
  }
  EXPECT_GT(filled, 0);
  EXPECT_GT(sealed, 0) << "the budget cannot hold the whole copy";
}

TEST(ShmFilledCopyTest, WithFilledCopiesTurnedOffEachRequestGetsACopySealedWhole) {
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/m.safetensors", 2, 1024, 9);
  ::setenv("WEIGHTSTORE_FILLED_COPIES", "0", 1);
  SocketDaemon server(models);
  ::unsetenv("WEIGHTSTORE_FILLED_COPIES");
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  auto store = ConnectShm(server.socket);
  ASSERT_OK_AND_ASSIGN(client::MappedTensors one, store->MapTensors("m", Paths({"w.0"})));
  ASSERT_OK_AND_ASSIGN(client::MappedTensors all, store->MapTensors("m", {}));
  ASSERT_EQ(one.segments.size(), 1u);
  ASSERT_EQ(all.segments.size(), 1u);
  EXPECT_OK(CheckSealed(one.segments[0]->fd(), "one"));
  EXPECT_OK(CheckSealed(all.segments[0]->fd(), "all"));
  EXPECT_NE(Identity(*one.segments[0]), Identity(*all.segments[0])) << "a copy per selection";
  EXPECT_OK(one.Verify());
  EXPECT_OK(all.Verify());
}

TEST(ShmFilledCopyTest, MoreFilesThanAFrameCarriesAreCopiedIntoOneSegment) {
  // A sharded checkpoint of more files than one answer passes descriptors
  // for (253): copied per file it could not go out, so its tensors are
  // materialized into one segment sealed whole.
  const std::string models = testing::MakeScratchDir("models");
  fs::create_directories(models + "/many");
  std::string map;
  const int shards = kMaxFdsPerFrame + 2;
  for (int s = 0; s < shards; ++s) {
    const std::string file = absl::StrCat("part-", s, ".safetensors");
    absl::StrAppend(&map, map.empty() ? "" : ",", "\"w.0.", s, "\":\"", file, "\"");
  }
  for (int s = 0; s < shards; ++s) {
    std::vector<std::byte> data(64, static_cast<std::byte>(s));
    testing::WriteFileOrDie(
        models + "/many/" + absl::StrCat("part-", s, ".safetensors"),
        *SerializeCheckpoint(kSafeTensorsFormat,
                             {{{absl::StrCat("w.0.", s), DType::kF32, {16}}, SharedBytes::FromVector(std::move(data))}},
                             {}));
  }
  testing::WriteFileOrDie(models + "/many/model.safetensors.index.json",
                          absl::StrCat("{\"metadata\":{},\"weight_map\":{", map, "}}"));
  SocketDaemon server(models);
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  auto store = ConnectShm(server.socket);
  ASSERT_OK(store->GetCheckpoint("many/model").status()) << server.daemon->log();
  ASSERT_OK_AND_ASSIGN(client::MappedTensors all, store->MapTensors("many/model", {}));
  EXPECT_EQ(all.tensors.size(), static_cast<size_t>(shards));
  ASSERT_EQ(all.segments.size(), 1u);
  EXPECT_OK(CheckSealed(all.segments[0]->fd(), "segment"));
  EXPECT_OK(all.Verify());
  // A few of them: a copy per file, filled.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors few, store->MapTensors("many/model", Paths({"w.0.0", "w.0.9"})));
  ASSERT_EQ(few.segments.size(), 2u);
  EXPECT_OK(CheckFilledSeals(few.segments[0]->fd(), "segment"));
  EXPECT_OK(few.Verify());
}

TEST(ShmLifetimeTest, MappingsStayReadableAfterUnloadAndEviction) {
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/a.safetensors", 4, 64 * 1024, 1);  // 1 MiB of F32; 2 MiB as F64
  WriteFloats(models + "/b.safetensors", 4, 64 * 1024, 2);
  // Room for one F64 copy (2 MiB) at a time.
  SocketDaemon server(models, {"--shm-budget", "3MiB", "--socket-file-segments", "always"});
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  auto store = ConnectShm(server.socket);
  ASSERT_OK_AND_ASSIGN(client::MappedTensors a, store->MapTensors("a", CastTo(DType::kF64)));
  ASSERT_OK_AND_ASSIGN(client::MappedTensors a_file, store->MapTensors("a", {}));
  EXPECT_EQ(MemfdsHeldBy(server.daemon->pid()), 1);

  // b's segment evicts a's.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors b, store->MapTensors("b", CastTo(DType::kF64)));
  EXPECT_EQ(MemfdsHeldBy(server.daemon->pid()), 1);

  // Unload a, then remove its file: our mappings still read the same bytes.
  auto channel = grpc::CreateChannel(server.daemon->address(), grpc::InsecureChannelCredentials());
  auto stub = pb::WeightStore::NewStub(channel);
  grpc::ClientContext ctx;
  pb::UnloadCheckpointRequest req;
  req.set_name("a");
  pb::UnloadCheckpointResponse resp;
  ASSERT_TRUE(stub->UnloadCheckpoint(&ctx, req, &resp).ok());
  fs::remove(models + "/a.safetensors");
  EXPECT_THAT(store->MapTensors("a", {}), StatusIs(absl::StatusCode::kNotFound));

  EXPECT_OK(a.Verify());
  EXPECT_OK(a_file.Verify());
  EXPECT_OK(b.Verify());
  double first;
  std::memcpy(&first, a.tensors[1].bytes.data() + 8, 8);
  EXPECT_EQ(first, 1.0 + 1 + 1.0 / 8);  // w.1[1] of seed 1, as F64
}

TEST(ShmLifetimeTest, BudgetHoldsForSegmentsAndPreloads) {
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/small.safetensors", 1, 1024, 1);      // 4 KiB
  WriteFloats(models + "/big.safetensors", 2, 256 * 1024, 2);  // 2 MiB
  SocketDaemon server(models, {"--shm-budget", "1MiB", "--preload-checkpoint", "small", "--preload-checkpoint", "big"});
  ASSERT_NE(server.daemon->port(), 0) << server.daemon->log();
  // big does not fit the budget: not served, and the log says why.
  EXPECT_THAT(server.daemon->log(), HasSubstr("preloading 'big'"));
  auto store = ConnectShm(server.socket);
  EXPECT_THAT(store->GetCheckpoint("big"), StatusIs(absl::StatusCode::kNotFound));
  // small is served from a sealed memfd.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors small, store->MapTensors("small", {}));
  ASSERT_EQ(small.segments.size(), 1u);
  EXPECT_OK(CheckSealed(small.segments[0]->fd(), "preload"));
  EXPECT_OK(small.Verify());
  // A cast larger than what is left of the budget is refused, naming it.
  WriteFloats(models + "/mid.safetensors", 1, 200 * 1024, 3);  // 800 KiB; 1.6 MiB as F64
  auto channel = grpc::CreateChannel(server.daemon->address(), grpc::InsecureChannelCredentials());
  auto stub = pb::WeightStore::NewStub(channel);
  grpc::ClientContext ctx;
  pb::RescanResponse rescan;
  ASSERT_TRUE(stub->Rescan(&ctx, pb::RescanRequest(), &rescan).ok());
  EXPECT_THAT(store->MapTensors("mid", CastTo(DType::kF64)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("budget is 1048576 bytes")));
  ASSERT_OK_AND_ASSIGN(client::MappedTensors half, store->MapTensors("mid", CastTo(DType::kF16)));
  EXPECT_OK(half.Verify());
}

TEST(ShmCrashTest, MappingsSurviveKill9AndARestartedDaemonServesOnTheSamePath) {
  const std::string models = testing::MakeScratchDir("models");
  WriteFloats(models + "/m.safetensors", 3, 4096, 5);
  auto server = std::make_unique<SocketDaemon>(models);
  ASSERT_NE(server->daemon->port(), 0) << server->daemon->log();
  const std::string socket = server->socket;
  auto store = ConnectShm(socket);
  ASSERT_OK_AND_ASSIGN(client::MappedTensors cast, store->MapTensors("m", CastTo(DType::kF16)));
  ASSERT_OK_AND_ASSIGN(client::MappedTensors file, store->MapTensors("m", {}));

  server->daemon->Signal(SIGKILL);
  server->daemon->WaitExit(10000);
  EXPECT_OK(cast.Verify());
  EXPECT_OK(file.Verify());
  EXPECT_TRUE(fs::exists(socket));  // left by the crash, replaced by the next daemon

  // A second daemon on a live socket refuses to start; after a crash it takes over.
  Daemon restarted(models, {"--socket", socket});
  ASSERT_NE(restarted.port(), 0) << restarted.log();
  Daemon second(models, {"--socket", socket});
  EXPECT_EQ(second.port(), 0);
  EXPECT_THAT(second.log(), HasSubstr("another daemon is listening"));

  // The old store reconnects by itself.
  ASSERT_OK_AND_ASSIGN(client::MappedTensors fresh, store->MapTensors("m", CastTo(DType::kF16)));
  ASSERT_EQ(fresh.tensors.size(), cast.tensors.size());
  for (size_t i = 0; i < fresh.tensors.size(); ++i) {
    EXPECT_TRUE(fresh.tensors[i].bytes.view() == cast.tensors[i].bytes.view());
  }
  restarted.Signal(SIGTERM);
  EXPECT_EQ(restarted.WaitExit(60000), 0);
  EXPECT_FALSE(fs::exists(socket));  // a clean stop removes it
}

// A socket daemon serving "m" (four F32 tensors "w.0".."w.3") and a store
// connected to it, for the tests that stop the daemon mid-call.
class ShmCancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string models = testing::MakeScratchDir("models");
    WriteFloats(models + "/m.safetensors", 4, 1024, 1.0f);
    server_ = std::make_unique<SocketDaemon>(models);
    ASSERT_NE(server_->daemon->port(), 0) << server_->daemon->log();
    store_ = ConnectShm(server_->socket);
    ASSERT_NE(store_, nullptr);
  }

  std::unique_ptr<SocketDaemon> server_;
  std::unique_ptr<client::SharedMemoryStore> store_;
};

TEST_F(ShmCancelTest, ACancelEndsTheWaitForAStalledDaemonsAnswerAndTheStoreThenReconnects) {
  SocketDaemon& server = *server_;
  client::SharedMemoryStore* store = store_.get();
  ASSERT_OK_AND_ASSIGN(client::MappedTensors before, store->MapTensors("m", {}));

  // The daemon stops (SIGSTOP) with the connection open: an answer that takes
  // a while, as a cast being made or a checkpoint being pulled would.
  ASSERT_TRUE(server.daemon->Stop());
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  std::chrono::steady_clock::time_point cancelled_at;
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    cancelled_at = std::chrono::steady_clock::now();
    cancel->store(true);
  });
  client::Query query;
  query.cancel = cancel;
  absl::StatusOr<client::MappedTensors> map = store->MapTensors("m", query);
  const auto returned_at = std::chrono::steady_clock::now();
  canceller.join();
  server.daemon->Signal(SIGCONT);
  EXPECT_THAT(map.status(), StatusIs(absl::StatusCode::kCancelled, HasSubstr(server.socket)));
  std::cout << "a cancelled map returned "
            << std::chrono::duration_cast<std::chrono::milliseconds>(returned_at - cancelled_at).count()
            << " ms after the cancel\n";
  // Without the wait's cancel, this would be the socket's timeout (60 s): only
  // that, or a machine stalled for as long, breaks this bound.
  EXPECT_LT(returned_at - cancelled_at, std::chrono::seconds(30));

  // The late answer to the cancelled request is never read: the next call
  // goes over a new connection and gets its own.
  query.cancel = nullptr;
  query.selection.paths = {"w.2"};
  ASSERT_OK_AND_ASSIGN(client::MappedTensors after, store->MapTensors("m", query));
  ASSERT_EQ(after.tensors.size(), 1u);
  EXPECT_EQ(after.tensors[0].spec.name, "w.2");
  EXPECT_TRUE(after.tensors[0].bytes.view() == before.tensors[2].bytes.view());
}

TEST_F(ShmCancelTest, ACallQueuedBehindAnotherOnTheSameStoreIsCancellableToo) {
  SocketDaemon& server = *server_;
  client::SharedMemoryStore* store = store_.get();
  ASSERT_OK(store->MapTensors("m", {}).status());
  ASSERT_TRUE(server.daemon->Stop());
  // The first call holds the store's connection, waiting for its answer. A
  // watchdog ends it after 60 s, so that a second call that cannot be
  // cancelled fails this test rather than hanging it.
  auto first_cancel = std::make_shared<std::atomic<bool>>(false);
  absl::Status first;
  absl::Notification holding;
  std::thread holder([&] {
    client::Query query;
    query.cancel = first_cancel;
    holding.Notify();
    first = store->MapTensors("m", query).status();
  });
  std::thread watchdog([first_cancel] {
    for (int i = 0; i < 6000 && !first_cancel->load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    first_cancel->store(true);
  });
  // The holder is about to take the connection: it has half a second to.
  holding.WaitForNotification();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto second_cancel = std::make_shared<std::atomic<bool>>(false);
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    second_cancel->store(true);
  });
  client::Query query;
  query.cancel = second_cancel;
  const auto start = std::chrono::steady_clock::now();
  absl::Status second = store->ListTensors("m", query).status();
  const auto waited = std::chrono::steady_clock::now() - start;
  canceller.join();
  first_cancel->store(true);
  holder.join();
  watchdog.join();
  server.daemon->Signal(SIGCONT);
  // Cancelled while waiting for its turn (the message says so), not once the
  // watchdog ended the first call: the bound only catches the latter.
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kCancelled, HasSubstr("another call on this store")));
  std::cout << "the queued call returned after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() << " ms (cancelled at 300 ms)\n";
  EXPECT_LT(waited, std::chrono::seconds(30));
  EXPECT_THAT(first, StatusIs(absl::StatusCode::kCancelled, HasSubstr("checkpoint 'm'")));
  EXPECT_OK(store->MapTensors("m", {}).status());
}

}  // namespace
}  // namespace weightstore
