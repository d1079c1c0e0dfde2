// What an operator relies on, against a real weightstored: TLS and mutual TLS
// (certificates made here with openssl), bearer-token scopes, the
// unauthenticated health port, Prometheus metrics that count what was sent (and
// pass promtool; a real Prometheus scrapes them), structured request logs, and
// configuration errors that name the key.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/store.h"
#include "core/formats/checkpoint_writer.h"
#include "core/formats/safetensors.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/util/daemon.h"
#include "tests/util/metrics.h"
#include "tests/util/status_matchers.h"
#include "tests/util/test_env.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore {
namespace {

namespace pb = ::weightstore::v1;
using testing::Daemon;
using ::testing::HasSubstr;
using ::testing::Not;
using ::weightstore::testing::StatusIs;

constexpr char kReadToken[] = "read-token-0123456789abcdef";
constexpr char kAdminToken[] = "admin-token-fedcba9876543210";

std::string Models() {
  const std::string dir = testing::MakeScratchDir("models");
  std::vector<SharedTensor> tensors;
  for (int i = 0; i < 3; ++i) {
    std::vector<std::byte> bytes(4096 * 4, std::byte(i + 1));
    tensors.push_back({{absl::StrCat("w.", i), DType::kF32, {4096}}, SharedBytes::FromVector(std::move(bytes))});
  }
  testing::WriteFileOrDie(dir + "/m.safetensors", *SerializeCheckpoint(kSafeTensorsFormat, tensors, {}));
  return dir;
}

// A free loopback TCP port (bound, then released).
int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// A CA, a server certificate for 127.0.0.1/localhost and a client certificate.
struct Certificates {
  std::string dir;
  Certificates() : dir(testing::MakeScratchDir("tls")) {
    const std::string d = testing::ShellQuote(dir);
    const std::string script = absl::StrCat(
        "set -e; cd ", d, "; ",
        "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=test-ca -keyout ca.key -out ca.pem 2>/dev/null; ",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext; ",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key -out server.csr 2>/dev/null; ",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile san.ext "
        "-out server.pem 2>/dev/null; ",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=inference-node -keyout client.key -out client.csr 2>/dev/null; ",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out client.pem "
        "2>/dev/null");
    std::string out;
    EXPECT_EQ(testing::RunCommand(script, &out), 0) << out;
  }
  std::string operator()(const char* name) const { return dir + "/" + name; }
};

client::RemoteOptions Tls(const Certificates& certs, bool client_cert) {
  client::RemoteOptions o;
  o.tls_ca_file = certs("ca.pem");
  if (client_cert) {
    o.tls_cert_file = certs("client.pem");
    o.tls_key_file = certs("client.key");
  }
  o.deadline = std::chrono::seconds(10);
  o.max_resumes = 0;
  return o;
}

TEST(TlsTest, TheDataLaneIsRefusedBesideTlsAsItSendsInTheClear) {
  Certificates certs;
  Daemon daemon(Models(),
                {"--tls-cert", certs("server.pem"), "--tls-key", certs("server.key"), "--data-listen", "127.0.0.1:0"});
  EXPECT_EQ(daemon.port(), 0);
  EXPECT_THAT(daemon.log(), HasSubstr("--data-listen sends tensors in the clear"));
}

TEST(TlsTest, ServesOverTlsAndRefusesPlaintext) {
  Certificates certs;
  Daemon daemon(Models(), {"--tls-cert", certs("server.pem"), "--tls-key", certs("server.key")});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  EXPECT_THAT(daemon.log(), HasSubstr("(TLS)"));
  ASSERT_OK_AND_ASSIGN(auto secure, client::ConnectRemoteStore(daemon.address(), Tls(certs, false)));
  ASSERT_OK_AND_ASSIGN(auto all, secure->FetchAll("m", {}));
  EXPECT_EQ(all.size(), 3u);
  client::RemoteOptions plain;
  plain.deadline = std::chrono::seconds(5);
  ASSERT_OK_AND_ASSIGN(auto insecure, client::ConnectRemoteStore(daemon.address(), plain));
  EXPECT_THAT(insecure->ListCheckpoints(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(TlsTest, MutualTlsRequiresAClientCertificateFromTheCa) {
  Certificates certs;
  Daemon daemon(Models(), {"--tls-cert", certs("server.pem"), "--tls-key", certs("server.key"), "--tls-client-ca",
                           certs("ca.pem")});
  ASSERT_NE(daemon.port(), 0) << daemon.log();
  EXPECT_THAT(daemon.log(), HasSubstr("(mutual TLS)"));
  ASSERT_OK_AND_ASSIGN(auto with_cert, client::ConnectRemoteStore(daemon.address(), Tls(certs, true)));
  EXPECT_OK(with_cert->ListCheckpoints().status());
  ASSERT_OK_AND_ASSIGN(auto without, client::ConnectRemoteStore(daemon.address(), Tls(certs, false)));
  EXPECT_THAT(without->ListCheckpoints(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(TlsTest, BadCertificateFilesStopTheDaemonWithTheirNames) {
  Daemon missing(Models(), {"--tls-cert", "/nonexistent/server.pem", "--tls-key", "/nonexistent/server.key"});
  EXPECT_EQ(missing.port(), 0);
  EXPECT_THAT(missing.log(), HasSubstr("/nonexistent/server.pem"));
  const std::string not_pem = testing::MakeScratchDir("tls") + "/junk.pem";
  testing::WriteFileOrDie(not_pem, "hello");
  Daemon junk(Models(), {"--tls-cert", not_pem, "--tls-key", not_pem});
  EXPECT_EQ(junk.port(), 0);
  EXPECT_THAT(junk.log(), HasSubstr("is not a PEM file"));
}

class TokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string tokens = testing::MakeScratchDir("tokens") + "/tokens";
    testing::WriteFileOrDie(tokens, absl::StrCat("# scopes\nread ", kReadToken, "\nadmin ", kAdminToken, "\n"));
    daemon_ = std::make_unique<Daemon>(
        Models(), std::vector<std::string>{"--tokens-file", tokens, "--health-listen", "127.0.0.1:0"});
    ASSERT_NE(daemon_->port(), 0) << daemon_->log();
  }
  std::unique_ptr<client::Store> Connect(const std::string& token) {
    client::RemoteOptions o;
    o.token = token;
    o.max_resumes = 0;
    return *client::ConnectRemoteStore(daemon_->address(), o);
  }
  grpc::Status Rescan(const std::string& token) {
    auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    pb::RescanResponse resp;
    return stub->Rescan(&ctx, pb::RescanRequest(), &resp);
  }
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(TokenTest, ReadAndAdminScopesAreCheckedPerCall) {
  EXPECT_THAT(Connect("")->ListCheckpoints(), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("Bearer")));
  EXPECT_THAT(Connect("not-a-real-token-at-all")->ListCheckpoints(),
              StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("unknown bearer token")));
  EXPECT_THAT(Connect("")->FetchAll("m", {}), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_OK(Connect(kReadToken)->FetchAll("m", {}).status());
  EXPECT_OK(Connect(kAdminToken)->ListCheckpoints().status());
  EXPECT_EQ(Rescan("").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  grpc::Status denied = Rescan(kReadToken);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(denied.error_message(), HasSubstr("admin scope"));
  EXPECT_TRUE(Rescan(kAdminToken).ok());
}

TEST_F(TokenTest, TokensNeverReachTheLog) {
  (void)Connect(kReadToken)->ListCheckpoints();
  (void)Connect("wrong-token-wrong-token")->ListCheckpoints();
  (void)Rescan(kReadToken);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string log = daemon_->log();
  EXPECT_THAT(log, HasSubstr("Unauthenticated"));
  EXPECT_THAT(log, HasSubstr("PermissionDenied"));
  EXPECT_THAT(log, Not(HasSubstr(kReadToken)));
  EXPECT_THAT(log, Not(HasSubstr("wrong-token-wrong-token")));
}

TEST_F(TokenTest, HealthPortAnswersProbesWithoutAToken) {
  ASSERT_NE(daemon_->health_port(), 0) << daemon_->log();
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", daemon_->health_port()), grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  for (const char* service : {"", "weightstore.v1.WeightStore"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok()) << service;
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // The CLI's health command (the container's HEALTHCHECK) says the same.
  std::string out;
  EXPECT_EQ(testing::RunCommand(absl::StrCat(testing::CliPath(), " health --server 127.0.0.1:", daemon_->health_port()),
                                &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("SERVING"));
  EXPECT_NE(testing::RunCommand(absl::StrCat(testing::CliPath(), " health --timeout 1 --server 127.0.0.1:", FreePort()),
                                &out),
            0);
  // The health port serves nothing else.
  auto stub = pb::WeightStore::NewStub(channel);
  grpc::ClientContext ctx;
  pb::ListCheckpointsResponse resp;
  EXPECT_EQ(stub->ListCheckpoints(&ctx, pb::ListCheckpointsRequest(), &resp).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST(TokensFileTest, MalformedFilesNameTheLineNotTheToken) {
  const std::string dir = testing::MakeScratchDir("tokens");
  testing::WriteFileOrDie(dir + "/bad", "read secret-value-1234567890\nwrite secret-value-abcdefghij\n");
  Daemon daemon(Models(), {"--tokens-file", dir + "/bad"});
  EXPECT_EQ(daemon.port(), 0);
  EXPECT_THAT(daemon.log(), HasSubstr(dir + "/bad:2: unknown scope 'write'"));
  EXPECT_THAT(daemon.log(), Not(HasSubstr("secret-value")));
}

TEST(ConfigTest, ConfigFileSetsOptionsAndErrorsNameTheKey) {
  const std::string dir = testing::MakeScratchDir("config");
  testing::WriteFileOrDie(dir + "/good.toml", absl::StrCat("# weightstored.toml\nmetrics-listen = \"127.0.0.1:0\"\n",
                                                           "shm-budget = \"64MiB\"\nlog-level = \"warning\"\n"));
  Daemon good(Models(), {"--config", dir + "/good.toml"});
  ASSERT_NE(good.port(), 0) << good.log();
  EXPECT_NE(good.metrics_port(), 0);
  EXPECT_EQ(testing::MetricValue(good.metrics_port(), "weightstore_shm_budget_bytes"), 67108864);

  testing::WriteFileOrDie(dir + "/unknown.toml", "listen = \"127.0.0.1:0\"\nmax-conncurrent-fetches = 3\n");
  Daemon unknown(Models(), {"--config", dir + "/unknown.toml"});
  EXPECT_EQ(unknown.port(), 0);
  EXPECT_THAT(unknown.log(), HasSubstr("max-conncurrent-fetches"));

  testing::WriteFileOrDie(dir + "/badvalue.toml", "chunk-bytes = \"lots\"\n");
  Daemon bad_value(Models(), {"--config", dir + "/badvalue.toml"});
  EXPECT_EQ(bad_value.port(), 0);
  EXPECT_THAT(bad_value.log(), HasSubstr("chunk-bytes"));

  // --check-config reads the file and the files it names, and serves nothing.
  const std::string models = Models();
  std::string checked;
  EXPECT_EQ(testing::RunCommand(absl::StrCat(testing::DaemonPath(), " --models ", models, " --config ",
                                             dir + "/good.toml --check-config"),
                                &checked),
            0)
      << checked;
  EXPECT_THAT(checked, HasSubstr("shm-budget=67108864"));
  EXPECT_NE(testing::RunCommand(absl::StrCat(testing::DaemonPath(), " --models ", models,
                                             " --tokens-file /nonexistent/tokens --check-config"),
                                &checked),
            0);
  EXPECT_THAT(checked, HasSubstr("/nonexistent/tokens"));

  std::string help;
  testing::RunCommand(testing::DaemonPath() + " --help", &help);
  for (const char* option : {"--config", "--metrics-listen", "--health-listen", "--tls-cert", "--tls-client-ca",
                             "--tokens-file", "--log-level", "--socket", "--shm-budget", "--preload"}) {
    EXPECT_THAT(help, HasSubstr(option));
  }
}

TEST(PortFileTest, AnUnwritablePortFileStopsTheDaemonLoudly) {
  std::string out;
  const int status = testing::RunCommand(absl::StrCat(testing::DaemonPath(), " --models ", Models(),
                                                      " --listen 127.0.0.1:0 --port-file /nonexistent/dir/port"),
                                         &out);
  EXPECT_NE(status, 0);
  EXPECT_THAT(out, HasSubstr("cannot write the port file '/nonexistent/dir/port'"));
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    socket_ = testing::MakeScratchDir("sock") + "/ws.sock";
    daemon_ = std::make_unique<Daemon>(
        Models(), std::vector<std::string>{"--metrics-listen", "127.0.0.1:0", "--socket", socket_});
    ASSERT_NE(daemon_->metrics_port(), 0) << daemon_->log();
  }
  std::string socket_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(MetricsTest, CountsMatchAMixedLoadAndPassPromtool) {
  // One stream per fetch, whatever the cores (more open several).
  client::RemoteOptions one_stream;
  one_stream.parallel_streams = 1;
  auto store = *client::ConnectRemoteStore(daemon_->address(), one_stream);
  for (int i = 0; i < 3; ++i) ASSERT_OK(store->ListCheckpoints().status());
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(store->GetCheckpoint("missing").ok());
  uint64_t fetched = 0;
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(auto tensors, store->FetchAll("m", {}));
    for (const auto& t : tensors) fetched += t.bytes.size();
  }
  auto shm = *client::ConnectSharedMemoryStore(socket_);
  ASSERT_OK(shm->MapTensors("m", {}).status());
  // What a node tier pulls: the stored file, whole, then its last 100 bytes.
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
  pb::ListCheckpointFilesResponse files;
  {
    grpc::ClientContext ctx;
    pb::ListCheckpointFilesRequest request;
    request.set_name("m");
    ASSERT_TRUE(stub->ListCheckpointFiles(&ctx, request, &files).ok());
    ASSERT_EQ(files.files_size(), 1);
  }
  uint64_t read = 0;
  const uint64_t size = files.files(0).size();
  for (uint64_t offset : {uint64_t{0}, size - 100}) {
    grpc::ClientContext ctx;
    pb::ReadCheckpointFileRequest request;
    request.set_name("m");
    request.set_version(files.version());
    request.set_path(files.files(0).path());
    request.set_offset(offset);
    auto reader = stub->ReadCheckpointFile(&ctx, request);
    pb::CheckpointFileChunk chunk;
    while (reader->Read(&chunk)) read += chunk.data().size();
    ASSERT_TRUE(reader->Finish().ok());
  }
  ASSERT_EQ(read, size + 100);

  auto metric = [&](absl::string_view name, std::initializer_list<absl::string_view> labels = {}) {
    return testing::MetricValue(daemon_->metrics_port(), name, labels);
  };
  constexpr absl::string_view ws = "grpc_service=\"weightstore.v1.WeightStore\"";
  EXPECT_EQ(metric("grpc_server_handled_total",
                   {"grpc_type=\"unary\"", ws, "grpc_method=\"ListCheckpoints\"", "grpc_code=\"OK\""}),
            3);
  EXPECT_EQ(metric("grpc_server_handled_total",
                   {"grpc_type=\"unary\"", ws, "grpc_method=\"GetCheckpoint\"", "grpc_code=\"NotFound\""}),
            2);
  // FetchAll lists, then fetches: 4 of each.
  EXPECT_EQ(metric("grpc_server_started_total", {"grpc_type=\"server_stream\"", ws, "grpc_method=\"FetchTensors\""}),
            4);
  EXPECT_EQ(
      metric("grpc_server_handling_seconds_count", {"grpc_type=\"server_stream\"", ws, "grpc_method=\"FetchTensors\""}),
      4);
  EXPECT_EQ(metric("weightstore_served_bytes_total", {"transport=\"grpc\"", "api=\"FetchTensors\""}),
            static_cast<double>(fetched));
  EXPECT_EQ(metric("weightstore_served_bytes_total", {"transport=\"grpc\"", "api=\"ReadCheckpointFile\""}),
            static_cast<double>(read));
  EXPECT_EQ(metric("weightstore_served_bytes_total", {"transport=\"socket\"", "api=\"MapTensors\""}),
            static_cast<double>(fetched / 4));
  // Every method's series is there from the start, at 0 until called.
  EXPECT_EQ(metric("grpc_server_started_total", {"grpc_type=\"unary\"", ws, "grpc_method=\"Rescan\""}), 0);
  EXPECT_EQ(metric("grpc_server_handled_total",
                   {"grpc_type=\"unary\"", ws, "grpc_method=\"Rescan\"", "grpc_code=\"PermissionDenied\""}),
            0);
  EXPECT_EQ(metric("weightstore_checkpoints_loaded"), 1);
  EXPECT_EQ(metric("weightstore_checkpoint_load_seconds_count"), 1);
  EXPECT_EQ(metric("weightstore_scan_errors"), 0);
  EXPECT_EQ(metric("weightstore_publishes_held_back"), 0);
  EXPECT_EQ(metric("weightstore_socket_requests_total"), 1);
  EXPECT_GT(metric("process_resident_memory_bytes"), 1e6);
  EXPECT_GT(metric("process_open_fds"), 5);
  EXPECT_EQ(metric("weightstore_shm_budget_bytes"), 4.0 * (1 << 30));

  const std::string text = testing::HttpGet(daemon_->metrics_port(), "/metrics");
  const std::string file = testing::MakeScratchDir("metrics") + "/metrics.txt";
  testing::WriteFileOrDie(file, text);
  std::string out;
  EXPECT_EQ(testing::RunCommand("promtool check metrics < " + testing::ShellQuote(file), &out), 0) << out;
}

TEST_F(MetricsTest, EveryRequestIsOneJsonLogLineWithItsRequestId) {
  auto stub = pb::WeightStore::NewStub(grpc::CreateChannel(daemon_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-request-id", "abc-123");
  pb::GetCheckpointRequest req;
  req.set_name("m");
  pb::CheckpointInfo info;
  ASSERT_TRUE(stub->GetCheckpoint(&ctx, req, &info).ok());
  auto trailers = ctx.GetServerTrailingMetadata();
  ASSERT_NE(trailers.find("x-request-id"), trailers.end());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  bool found = false;
  for (absl::string_view line : absl::StrSplit(daemon_->log(), '\n')) {
    if (!absl::StartsWith(line, "{")) continue;
    nlohmann::json j = nlohmann::json::parse(line);  // every structured line is JSON
    if (j.value("request_id", "") != "abc-123") continue;
    found = true;
    EXPECT_EQ(j["msg"], "request");
    EXPECT_EQ(j["method"], "/weightstore.v1.WeightStore/GetCheckpoint");
    EXPECT_EQ(j["checkpoint"], "m");
    EXPECT_EQ(j["status"], "OK");
    EXPECT_THAT(j["peer"].get<std::string>(), HasSubstr("127.0.0.1"));
    EXPECT_TRUE(j.contains("duration_ms"));
  }
  EXPECT_TRUE(found) << daemon_->log();
}

TEST_F(MetricsTest, ARealPrometheusScrapesTheEndpoint) {
  const std::string dir = testing::MakeScratchDir("prometheus");
  testing::WriteFileOrDie(dir + "/prometheus.yml",
                          absl::StrCat("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: weightstored\n"
                                       "    static_configs:\n      - targets: ['127.0.0.1:",
                                       daemon_->metrics_port(), "']\n"));
  std::string out;
  ASSERT_EQ(testing::RunCommand("promtool check config " + testing::ShellQuote(dir + "/prometheus.yml"), &out), 0)
      << out;
  const int port = FreePort();
  const std::string command =
      absl::StrCat("exec prometheus --config.file=", testing::ShellQuote(dir + "/prometheus.yml"),
                   " --storage.tsdb.path=", testing::ShellQuote(dir + "/data"),
                   " --web.listen-address=127.0.0.1:", port, " > ", testing::ShellQuote(dir + "/log"), " 2>&1");
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", command.c_str(), nullptr);
    ::_exit(127);
  }
  ASSERT_OK(client::ConnectRemoteStore(daemon_->address()).value()->ListCheckpoints().status());
  std::string result;
  for (int i = 0; i < 150; ++i) {  // up to 30 s for startup and two scrapes
    result = testing::HttpGet(port,
                              "/api/v1/query?query=grpc_server_handled_total%7Bgrpc_method%3D%22ListCheckpoints%22%7D");
    if (absl::StrContains(result, "\"value\"")) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::string up = testing::HttpGet(port, "/api/v1/query?query=up%7Bjob%3D%22weightstored%22%7D");
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  EXPECT_THAT(result, HasSubstr("\"grpc_code\":\"OK\"")) << testing::ReadFileOrEmpty(dir + "/log");
  EXPECT_THAT(up, HasSubstr("\"1\"]"));
}

}  // namespace
}  // namespace weightstore
