#include "server/observability.h"

#include <dirent.h>
#include <google/protobuf/descriptor.h>
#include <prometheus/exposer.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "server/log.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::server {
namespace {

using Clock = std::chrono::steady_clock;
using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

const char* TypeLabel(ServerRpcInfo::Type type) {
  switch (type) {
    case ServerRpcInfo::Type::UNARY:
      return "unary";
    case ServerRpcInfo::Type::CLIENT_STREAMING:
      return "client_stream";
    case ServerRpcInfo::Type::SERVER_STREAMING:
      return "server_stream";
    case ServerRpcInfo::Type::BIDI_STREAMING:
      return "bidi_stream";
  }
  return "unary";
}

std::string RandomRequestId() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
}

bool IsSafeRequestId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(),
                     [](char c) { return absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == ':'; });
}

// Observes one call: counts it, times it, and logs it when its status is sent.
class CallInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallInterceptor(ServerMetrics* metrics, ServerRpcInfo* info) : metrics_(metrics), info_(info), start_(Clock::now()) {
    absl::string_view full = info->method() != nullptr ? info->method() : "";
    absl::ConsumePrefix(&full, "/");
    const size_t slash = full.rfind('/');
    labels_ = {{"grpc_type", TypeLabel(info->type())},
               {"grpc_service", std::string(full.substr(0, slash))},
               {"grpc_method", slash == absl::string_view::npos ? "" : std::string(full.substr(slash + 1))}};
    counted_ = labels_["grpc_service"] == v1::WeightStore::service_full_name();
    metrics_->OnCallStarted(labels_, counted_);
  }

  // The call is torn down: every operation done, its status (and the messages
  // before it) handed to the transport. Only now does it stop counting as in
  // flight: at PRE_SEND_STATUS, flow control may still hold its last messages,
  // which shutdown must not cut off.
  ~CallInterceptor() override {
    if (!done_) Record(grpc::Status(grpc::StatusCode::CANCELLED, "ended before a status was sent"), nullptr);
    metrics_->OnCallTornDown(counted_, ok_);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      if (auto* md = methods->GetRecvInitialMetadata()) {
        auto it = md->find("x-request-id");
        // Echoed in the trailers and the log: only a short id of safe characters.
        if (it != md->end() && IsSafeRequestId(absl::string_view(it->second.data(), it->second.size()))) {
          request_id_.assign(it->second.data(), it->second.size());
        }
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      std::multimap<std::string, std::string>* trailers = methods->GetSendTrailingMetadata();
      if (request_id_.empty()) request_id_ = RandomRequestId();
      if (trailers != nullptr) trailers->emplace("x-request-id", request_id_);
      Record(methods->GetSendStatus(), trailers);
    }
    methods->Proceed();
  }

 private:
  void Record(const grpc::Status& status, const std::multimap<std::string, std::string>* trailers) {
    done_ = true;
    ok_ = status.ok();
    const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    const std::string code = GrpcCodeName(status.error_code());
    std::string checkpoint;
    uint64_t bytes = 0;
    if (trailers != nullptr) {
      if (auto it = trailers->find(kCheckpointTrailer); it != trailers->end()) checkpoint = it->second;
      if (auto it = trailers->find(kBytesTrailer); it != trailers->end()) (void)absl::SimpleAtoi(it->second, &bytes);
    }
    metrics_->OnCallDone(labels_, code, seconds, bytes);
    const LogLevel level = status.ok() ? LogLevel::kInfo : LogLevel::kWarning;
    if (!LogEnabled(level)) return;
    nlohmann::ordered_json fields;
    fields["method"] = info_->method() != nullptr ? info_->method() : "";
    if (!checkpoint.empty()) fields["checkpoint"] = checkpoint;
    fields["bytes"] = bytes;
    fields["duration_ms"] = std::round(seconds * 1e6) / 1e3;
    fields["status"] = code;
    if (!status.ok()) fields["error"] = status.error_message();
    fields["peer"] = info_->server_context() != nullptr ? info_->server_context()->peer() : "";
    fields["request_id"] = request_id_.empty() ? RandomRequestId() : request_id_;
    Log(level, "request", std::move(fields));
  }

  ServerMetrics* metrics_;
  ServerRpcInfo* info_;
  Clock::time_point start_;
  metrics::Labels labels_;  // grpc_type, grpc_service, grpc_method
  std::string request_id_;
  bool done_ = false;
  bool ok_ = false;       // the status sent was OK
  bool counted_ = false;  // in ServerMetrics::weightstore_calls_in_flight()
};

class CallInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(ServerRpcInfo* info) override {
    return new CallInterceptor(metrics_, info);
  }

 private:
  ServerMetrics* metrics_;
};

// Resident set size in bytes, from /proc/self/statm.
double ResidentBytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  in >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE));
}

double OpenFds() {
  double n = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(dir)) n += e->d_name[0] != '.';
    ::closedir(dir);
    n -= 1;  // the directory stream itself
  }
  return n;
}

double CpuSeconds() {
  std::ifstream in("/proc/self/stat");
  std::string field;
  std::vector<std::string> fields;
  while (in >> field) fields.push_back(field);
  if (fields.size() < 15) return 0;
  return (std::stod(fields[13]) + std::stod(fields[14])) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

}  // namespace

std::string TrailerValue(absl::string_view value) {
  constexpr size_t kMaxBytes = 256;
  std::string out;
  for (char c : value) {
    if (out.size() >= kMaxBytes) {
      out += "...";
      break;
    }
    const auto b = static_cast<unsigned char>(c);
    if (b >= 0x20 && b < 0x7F && b != '%') {
      out.push_back(c);
    } else {
      absl::StrAppend(&out, "%", absl::Hex(b, absl::kZeroPad2));
    }
  }
  return out;
}

std::string GrpcCodeName(int code) {
  static const char* const kNames[] = {
      "OK",       "Canceled",       "Unknown",          "InvalidArgument",   "DeadlineExceeded",
      "NotFound", "AlreadyExists",  "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
      "Aborted",  "OutOfRange",     "Unimplemented",    "Internal",          "Unavailable",
      "DataLoss", "Unauthenticated"};
  return code >= 0 && code <= 16 ? kNames[code] : absl::StrCat("Code(", code, ")");
}

ServerMetrics::ServerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      scraped_(std::make_shared<metrics::ScrapedFamilies>()),
      started_(prometheus::BuildCounter()
                   .Name("grpc_server_started_total")
                   .Help("RPCs started on the server.")
                   .Register(*registry_)),
      handled_(prometheus::BuildCounter()
                   .Name("grpc_server_handled_total")
                   .Help("RPCs completed on the server, regardless of success or failure.")
                   .Register(*registry_)),
      handling_seconds_(prometheus::BuildHistogram()
                            .Name("grpc_server_handling_seconds")
                            .Help("Response latency (seconds) of RPCs handled by the server.")
                            .Register(*registry_)),
      load_seconds_(prometheus::BuildHistogram()
                        .Name("weightstore_checkpoint_load_seconds")
                        .Help("Time to open (or preload) a checkpoint version.")
                        .Register(*registry_)
                        .Add({}, metrics::DurationBuckets())),
      load_failures_(prometheus::BuildCounter()
                         .Name("weightstore_checkpoint_load_failures_total")
                         .Help("Checkpoint files that could not be opened.")
                         .Register(*registry_)
                         .Add({})) {
  const double start = static_cast<double>(
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count());
  scraped_->AddGauge("process_resident_memory_bytes", "Resident memory size in bytes.", metrics::One(ResidentBytes));
  scraped_->AddGauge("process_open_fds", "Number of open file descriptors.", metrics::One(OpenFds));
  scraped_->AddCounter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                       metrics::One(CpuSeconds));
  scraped_->AddGauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                     metrics::One([start] { return start; }));
}

void ServerMetrics::InitializeServices(const std::vector<std::string>& services) {
  const google::protobuf::DescriptorPool* pool = google::protobuf::DescriptorPool::generated_pool();
  for (const std::string& name : services) {
    const google::protobuf::ServiceDescriptor* service = pool->FindServiceByName(name);
    if (service == nullptr) continue;
    for (int i = 0; i < service->method_count(); ++i) {
      const google::protobuf::MethodDescriptor* method = service->method(i);
      const char* type = method->client_streaming() ? (method->server_streaming() ? "bidi_stream" : "client_stream")
                                                    : (method->server_streaming() ? "server_stream" : "unary");
      const metrics::Labels labels = {{"grpc_type", type}, {"grpc_service", name}, {"grpc_method", method->name()}};
      started_.Add(labels);
      handling_seconds_.Add(labels, metrics::DurationBuckets());
      for (int code = 0; code <= 16; ++code) {
        metrics::Labels with_code = labels;
        with_code["grpc_code"] = GrpcCodeName(code);
        handled_.Add(with_code);
      }
    }
  }
}

void ServerMetrics::OnCallStarted(const metrics::Labels& labels, bool weightstore_call) {
  started_.Add(labels).Increment();
  if (weightstore_call) ++calls_in_flight_;
}

void ServerMetrics::OnCallDone(const metrics::Labels& labels, const std::string& code, double seconds,
                               uint64_t served_bytes) {
  metrics::Labels with_code = labels;
  with_code["grpc_code"] = code;
  handled_.Add(with_code).Increment();
  handling_seconds_.Add(labels, metrics::DurationBuckets()).Observe(seconds);
  const auto method = labels.find("grpc_method");
  const bool file = method != labels.end() && method->second == "ReadCheckpointFile";
  (file ? file_served_bytes_ : grpc_served_bytes_).fetch_add(served_bytes, std::memory_order_relaxed);
}

void ServerMetrics::OnCallTornDown(bool weightstore_call, bool ok) {
  if (!weightstore_call) return;
  if (ok) last_success_.store(std::chrono::steady_clock::now().time_since_epoch().count());
  --calls_in_flight_;
}

void ServerMetrics::ObserveLoad(double seconds, bool ok) {
  load_seconds_.Observe(seconds);
  if (!ok) load_failures_.Increment();
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> ServerMetrics::InterceptorFactory() {
  return std::make_unique<CallInterceptorFactory>(this);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& listen,
                                                                            const ServerMetrics& metrics) {
  std::unique_ptr<MetricsHttpServer> out(new MetricsHttpServer());
  // civetweb's options, as before prometheus-cpp: two threads, and a client
  // that stalls mid-request is dropped after 10 s.
  std::vector<std::string> options = {"listening_ports", listen, "num_threads", "2", "request_timeout_ms", "10000"};
  try {
    out->exposer_ = std::make_unique<prometheus::Exposer>(std::move(options));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  for (const auto& collectable : metrics.collectables()) out->exposer_->RegisterCollectable(collectable);
  std::vector<int> ports = out->exposer_->GetListeningPorts();
  out->port_ = ports.empty() ? 0 : ports[0];
  return out;
}

MetricsHttpServer::~MetricsHttpServer() = default;

// The name comes from the request: gRPC aborts the process on a metadata value
// that is not printable ASCII, so it is encoded first (TrailerValue).
void Annotate(grpc::ServerContextBase* ctx, const std::string& checkpoint) {
  if (!checkpoint.empty()) ctx->AddTrailingMetadata(kCheckpointTrailer, TrailerValue(checkpoint));
}

}  // namespace weightstore::server
