#include "server/observability.h"

#include <CivetServer.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "server/log.h"
#include "server/service.h"
#include "server/shm_server.h"

namespace weightstore::server {
namespace {

using Clock = std::chrono::steady_clock;
using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

const char* TypeLabel(ServerRpcInfo::Type type) {
  switch (type) {
    case ServerRpcInfo::Type::UNARY: return "unary";
    case ServerRpcInfo::Type::CLIENT_STREAMING: return "client_stream";
    case ServerRpcInfo::Type::SERVER_STREAMING: return "server_stream";
    case ServerRpcInfo::Type::BIDI_STREAMING: return "bidi_stream";
  }
  return "unary";
}

std::string RandomRequestId() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
}

bool IsSafeRequestId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == ':';
  });
}

// Observes one call: counts it, times it, and logs it when its status is sent.
class CallInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallInterceptor(ServerMetrics* metrics, ServerRpcInfo* info) : metrics_(metrics), info_(info), start_(Clock::now()) {
    absl::string_view full = info->method() != nullptr ? info->method() : "";
    absl::ConsumePrefix(&full, "/");
    const size_t slash = full.rfind('/');
    labels_ = {TypeLabel(info->type()), std::string(full.substr(0, slash)),
               slash == absl::string_view::npos ? "" : std::string(full.substr(slash + 1))};
    metrics_->started.Add(labels_).Increment();
    counted_ = labels_[1] == v1::WeightStore::service_full_name();
    if (counted_) ++metrics_->weightstore_calls_in_flight;
  }

  ~CallInterceptor() override {
    if (!done_) Record(grpc::Status(grpc::StatusCode::CANCELLED, "ended before a status was sent"), nullptr);
    if (counted_) --metrics_->weightstore_calls_in_flight;
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
    const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    const std::string code = GrpcCodeName(status.error_code());
    metrics_->handled.Add({labels_[0], labels_[1], labels_[2], code}).Increment();
    metrics_->handling_seconds.Add(labels_).Observe(seconds);
    std::string checkpoint;
    uint64_t bytes = 0;
    if (trailers != nullptr) {
      if (auto it = trailers->find(kCheckpointTrailer); it != trailers->end()) checkpoint = it->second;
      if (auto it = trailers->find(kBytesTrailer); it != trailers->end()) (void)absl::SimpleAtoi(it->second, &bytes);
    }
    if (bytes > 0) metrics_->served_bytes.Add({"grpc"}).Increment(static_cast<double>(bytes));
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
  std::vector<std::string> labels_;  // grpc_type, grpc_service, grpc_method
  std::string request_id_;
  bool done_ = false;
  bool counted_ = false;  // in ServerMetrics::weightstore_calls_in_flight
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
  static const char* const kNames[] = {"OK",          "Canceled",        "Unknown",           "InvalidArgument",
                                       "DeadlineExceeded", "NotFound",   "AlreadyExists",     "PermissionDenied",
                                       "ResourceExhausted", "FailedPrecondition", "Aborted",   "OutOfRange",
                                       "Unimplemented", "Internal",      "Unavailable",       "DataLoss",
                                       "Unauthenticated"};
  return code >= 0 && code <= 16 ? kNames[code] : absl::StrCat("Code(", code, ")");
}

ServerMetrics::ServerMetrics()
    : started(registry_.AddCounter("grpc_server_started_total", "RPCs started on the server.",
                                   {"grpc_type", "grpc_service", "grpc_method"})),
      handled(registry_.AddCounter("grpc_server_handled_total",
                                   "RPCs completed on the server, regardless of success or failure.",
                                   {"grpc_type", "grpc_service", "grpc_method", "grpc_code"})),
      handling_seconds(registry_.AddHistogram("grpc_server_handling_seconds",
                                              "Response latency (seconds) of RPCs handled by the server.",
                                              metrics::DurationBuckets(), {"grpc_type", "grpc_service", "grpc_method"})),
      served_bytes(registry_.AddCounter("weightstore_served_bytes_total",
                                        "Tensor bytes served: streamed over gRPC, or mapped through the socket.",
                                        {"transport"})),
      load_seconds(registry_.AddHistogram("weightstore_checkpoint_load_seconds",
                                          "Time to open (or preload) a checkpoint version.",
                                          metrics::DurationBuckets())),
      load_failures(registry_.AddCounter("weightstore_checkpoint_load_failures_total",
                                         "Checkpoint files that could not be opened.")) {
  served_bytes.Add({"grpc"});
  served_bytes.Add({"socket"});
  load_seconds.Add({});
  load_failures.Add({});
}

void ServerMetrics::ObserveLoad(double seconds, bool ok) {
  load_seconds.Add({}).Observe(seconds);
  if (!ok) load_failures.Add({}).Increment();
}

void ServerMetrics::Watch(const CheckpointRegistry* checkpoints, SegmentCache* segments, const ShmServer* shm,
                          const WeightStoreService* service) {
  auto& loaded = registry_.AddGauge("weightstore_checkpoints_loaded", "Checkpoints being served.");
  auto& loaded_bytes = registry_.AddGauge("weightstore_checkpoint_bytes", "Tensor bytes of the checkpoints served.");
  auto& shm_bytes = registry_.AddGauge("weightstore_shm_bytes",
                                       "Shared memory held: materialized segments, and preloaded checkpoints.",
                                       {"kind"});
  auto& shm_budget = registry_.AddGauge("weightstore_shm_budget_bytes", "The shared-memory budget (--shm-budget).");
  auto& shm_segments = registry_.AddGauge("weightstore_shm_segments", "Materialized segments held.");
  auto& shm_evictions = registry_.AddCounter("weightstore_shm_evictions_total", "Segments evicted to fit the budget.");
  auto& socket_connections =
      registry_.AddGauge("weightstore_socket_connections", "Connections open on the same-host socket.");
  auto& socket_requests = registry_.AddCounter("weightstore_socket_requests_total", "Requests on the same-host socket.");
  auto& socket_refused = registry_.AddCounter(
      "weightstore_socket_refused_total", "Socket connections refused (peer credentials or the connection limit).");
  auto& fetches = registry_.AddGauge("weightstore_fetch_streams_active", "FetchTensors streams being served.");
  auto& stalled = registry_.AddCounter("weightstore_fetch_streams_stalled_total",
                                       "FetchTensors streams cancelled because their client stopped reading.");
  auto& rss = registry_.AddGauge("process_resident_memory_bytes", "Resident memory size in bytes.");
  auto& fds = registry_.AddGauge("process_open_fds", "Number of open file descriptors.");
  auto& cpu = registry_.AddCounter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.");
  auto& start_time = registry_.AddGauge("process_start_time_seconds", "Start time of the process since unix epoch.");
  start_time.Add({}).Set(static_cast<double>(std::chrono::duration_cast<std::chrono::seconds>(
                                                 std::chrono::system_clock::now().time_since_epoch())
                                                 .count()));
  registry_.AddCollectHook([=, this, &loaded, &loaded_bytes, &shm_bytes, &shm_budget, &shm_segments, &shm_evictions,
                            &socket_connections, &socket_requests, &socket_refused, &fetches, &stalled, &rss, &fds, &cpu] {
    if (checkpoints != nullptr) {
      auto list = checkpoints->List();
      double bytes = 0;
      for (const auto& v : list) bytes += static_cast<double>(v->checkpoint()->total_bytes());
      loaded.Add({}).Set(static_cast<double>(list.size()));
      loaded_bytes.Add({}).Set(bytes);
    }
    if (segments != nullptr) {
      SegmentCache::Stats s = segments->stats();
      shm_bytes.Add({"segments"}).Set(static_cast<double>(s.segment_bytes));
      shm_bytes.Add({"preloaded"}).Set(static_cast<double>(s.reserved_bytes));
      shm_budget.Add({}).Set(static_cast<double>(s.budget_bytes));
      shm_segments.Add({}).Set(static_cast<double>(s.segments));
      shm_evictions.Add({}).SyncTotal(static_cast<double>(s.evictions));
    }
    if (shm != nullptr) {
      ShmServer::Stats s = shm->stats();
      socket_connections.Add({}).Set(s.active_connections);
      socket_requests.Add({}).SyncTotal(static_cast<double>(s.requests));
      socket_refused.Add({}).SyncTotal(static_cast<double>(s.refused_connections));
      served_bytes.Add({"socket"}).SyncTotal(static_cast<double>(s.bytes_mapped));
    }
    if (service != nullptr) {
      fetches.Add({}).Set(service->active_fetches());
      stalled.Add({}).SyncTotal(static_cast<double>(service->stalled_fetches()));
    }
    rss.Add({}).Set(ResidentBytes());
    fds.Add({}).Set(OpenFds());
    cpu.Add({}).SyncTotal(CpuSeconds());
  });
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> ServerMetrics::InterceptorFactory() {
  return std::make_unique<CallInterceptorFactory>(this);
}

struct MetricsHttpServer::Impl {
  class Handler : public CivetHandler {
   public:
    explicit Handler(const metrics::Registry* registry) : registry_(registry) {}
    bool handleGet(CivetServer*, mg_connection* conn) override {
      const std::string body = registry_->Serialize();
      mg_printf(conn,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                body.size());
      mg_write(conn, body.data(), body.size());
      return true;
    }

   private:
    const metrics::Registry* registry_;
  };
  std::unique_ptr<Handler> handler;
  std::unique_ptr<CivetServer> server;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& listen,
                                                                            const metrics::Registry* registry) {
  auto out = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer());
  out->impl_ = std::make_unique<Impl>();
  out->impl_->handler = std::make_unique<Impl::Handler>(registry);
  std::vector<std::string> options = {"listening_ports", listen, "num_threads", "2", "request_timeout_ms", "10000"};
  try {
    out->impl_->server = std::make_unique<CivetServer>(options);
  } catch (const CivetException& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ", e.what()));
  }
  out->impl_->server->addHandler("/metrics", out->impl_->handler.get());
  std::vector<int> ports = out->impl_->server->getListeningPorts();
  out->port_ = ports.empty() ? 0 : ports[0];
  return out;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (impl_ != nullptr && impl_->server != nullptr) impl_->server->close();
}

}  // namespace weightstore::server
