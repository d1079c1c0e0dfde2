#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/shm/segment_cache.h"
#include "grpc/health/v1/health.pb.h"
#include "proto/codec/tls.h"
#include "server/auth.h"
#include "server/data_lane.h"
#include "server/log.h"
#include "server/observability.h"
#include "server/service.h"
#include "server/shm_server.h"
#include "server/tcp_linger.h"

namespace weightstore::server {
namespace {

// How long connections get to acknowledge the GOAWAY at shutdown, once every
// WeightStore call is done, when none succeeded since the signal (see Shutdown).
constexpr std::chrono::milliseconds kGoawayWindow(500);

// Plaintext, TLS, or mutual TLS, from the options' PEM files.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerOptions::Tls& tls) {
  return wire::ServerCredentialsFromPem(tls.cert_file, tls.key_file, tls.client_ca_file);
}

// The folders a registry serves from, as given and as absolute paths: the
// spellings a core message may use for a file in them.
std::vector<std::string> RegistryFolders(const RegistryOptions& registry) {
  std::vector<std::string> folders;
  std::vector<std::string> roots = {registry.models_dir};
  roots.insert(roots.end(), registry.load_roots.begin(), registry.load_roots.end());
  for (const std::string& root : roots) {
    std::error_code ec;
    const std::string absolute = std::filesystem::absolute(root, ec).lexically_normal().string();
    folders.push_back(root);
    if (!ec && absolute != root) folders.push_back(absolute);
  }
  // Longest first, so that a folder inside another is taken out whole.
  std::sort(folders.begin(), folders.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  return folders;
}

}  // namespace

absl::Status DataLaneWithTls() {
  return absl::InvalidArgumentError(
      "--data-listen sends tensors in the clear, so it cannot be used with TLS (--tls-cert)");
}

absl::Status CheckOptions(const ServerOptions& options) {
  std::error_code ec;
  if (!std::filesystem::is_directory(options.registry.models_dir, ec)) {
    return absl::NotFoundError(absl::StrCat("models: '", options.registry.models_dir, "' is not a folder"));
  }
  if (!options.tokens_file.empty()) {
    absl::StatusOr<Authenticator> auth = Authenticator::FromFile(options.tokens_file);
    if (!auth.ok()) return auth.status();
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  if (!options.data_lane.listen.empty() && !options.tls.cert_file.empty()) return DataLaneWithTls();
  if (!options.socket.path.empty()) {
    std::filesystem::path parent = std::filesystem::path(options.socket.path).parent_path();
    if (!parent.empty() && !std::filesystem::is_directory(parent, ec)) {
      return absl::NotFoundError(absl::StrCat("socket: the folder '", parent.string(), "' does not exist"));
    }
  }
  return absl::OkStatus();
}

namespace {

// The families read at scrape time from the parts that own their values; each
// part is asked through a callback, and none of them sees the metrics.
void AddScrapedFamilies(ServerMetrics* metrics, const CheckpointRegistry* registry, const SegmentCache* segments,
                        const ShmServer* shm, const WeightStoreService* service) {
  using metrics::One;
  using metrics::Sample;
  metrics::ScrapedFamilies& f = metrics->scraped();
  f.AddCounter(
      "weightstore_served_bytes_total",
      "Bytes served, by API: tensors streamed over gRPC (FetchTensors) or mapped through the socket (MapTensors), "
      "and stored files streamed to other daemons (ReadCheckpointFile: a regional tier's egress).",
      [metrics, shm] {
        return std::vector<Sample>{
            {{{"transport", "grpc"}, {"api", "FetchTensors"}}, static_cast<double>(metrics->grpc_served_bytes())},
            {{{"transport", "grpc"}, {"api", "ReadCheckpointFile"}}, static_cast<double>(metrics->file_served_bytes())},
            {{{"transport", "socket"}, {"api", "MapTensors"}},
             shm != nullptr ? static_cast<double>(shm->stats().bytes_mapped) : 0}};
      });
  f.AddGauge("weightstore_checkpoints_loaded", "Checkpoints being served.",
             One([registry] { return static_cast<double>(registry->List().size()); }));
  f.AddGauge("weightstore_checkpoint_bytes", "Tensor bytes of the checkpoints served.", One([registry] {
               double bytes = 0;
               for (const auto& v : registry->List()) bytes += static_cast<double>(v->checkpoint()->total_bytes());
               return bytes;
             }));
  f.AddGauge("weightstore_scan_errors",
             "Errors the last scan of the models folder reported (files it could not serve, publishing records it "
             "could not finish), each in the log as \"not serving\" and in Rescan's not_served.",
             One([registry] { return static_cast<double>(registry->LastScan().errors); }));
  f.AddGauge("weightstore_publishes_held_back",
             "Sharded checkpoints held now at the version served by a publishing record that a scan, publish or "
             "load could not finish: not reopened until an operator removes the record (docs/updates.md).",
             One([registry] { return static_cast<double>(registry->LastScan().held_back); }));
  f.AddCounter("weightstore_push_files_written_total",
               "Files pushes and followers' steps wrote, by how: shared_extents (the base's file cloned, the changed "
               "tensors written over it), kernel_copy (copied in the kernel, the same), or whole.",
               [registry] {
                 const CheckpointRegistry::PushWrites w = registry->PushWriteStats();
                 return std::vector<Sample>{{{{"how", "shared_extents"}}, static_cast<double>(w.cloned)},
                                            {{{"how", "kernel_copy"}}, static_cast<double>(w.copied)},
                                            {{{"how", "whole"}}, static_cast<double>(w.whole)}};
               });
  f.AddGauge("weightstore_composed_patch_bytes",
             "Bytes of element patches composed for clients several versions behind, cached or being sent.",
             One([registry] { return static_cast<double>(registry->CompositionStats().bytes); }));
  f.AddGauge("weightstore_composed_patch_budget_bytes",
             "What composed element patches may hold (as much as --kept-patch-bytes).",
             One([registry] { return static_cast<double>(registry->CompositionStats().budget_bytes); }));
  f.AddCounter("weightstore_patch_compositions_total",
               "Asks for a composed element patch: made, shared (made before or in flight), or over_budget "
               "(not made: the tensor went whole).",
               [registry] {
                 const PatchCompositions::Stats s = registry->CompositionStats();
                 return std::vector<Sample>{{{{"result", "made"}}, static_cast<double>(s.made)},
                                            {{{"result", "shared"}}, static_cast<double>(s.shared)},
                                            {{{"result", "over_budget"}}, static_cast<double>(s.over_budget)}};
               });
  f.AddGauge("weightstore_shm_bytes", "Shared memory held: materialized segments, and preloaded checkpoints.",
             [segments] {
               const SegmentCache::Stats s = segments->stats();
               return std::vector<Sample>{{{{"kind", "preloaded"}}, static_cast<double>(s.reserved_bytes)},
                                          {{{"kind", "segments"}}, static_cast<double>(s.segment_bytes)}};
             });
  f.AddGauge("weightstore_shm_budget_bytes", "The shared-memory budget (--shm-budget).",
             One([segments] { return static_cast<double>(segments->stats().budget_bytes); }));
  f.AddGauge("weightstore_shm_segments", "Materialized segments held.",
             One([segments] { return static_cast<double>(segments->stats().segments); }));
  f.AddCounter("weightstore_shm_evictions_total", "Segments evicted to fit the budget.",
               One([segments] { return static_cast<double>(segments->stats().evictions); }));
  if (shm != nullptr) {
    f.AddGauge("weightstore_socket_connections", "Connections open on the same-host socket.",
               One([shm] { return static_cast<double>(shm->stats().active_connections); }));
    f.AddCounter("weightstore_socket_requests_total", "Requests on the same-host socket.",
                 One([shm] { return static_cast<double>(shm->stats().requests); }));
    f.AddCounter("weightstore_socket_refused_total",
                 "Socket connections refused (peer credentials or the connection limit).",
                 One([shm] { return static_cast<double>(shm->stats().refused_connections); }));
  }
  f.AddGauge("weightstore_watches_active", "WatchCheckpoints streams open.",
             One([service] { return static_cast<double>(service->active_watches()); }));
  f.AddGauge("weightstore_watch_cached_bytes",
             "Bytes of serialized events and diffs kept for watchers; given back once the last watch ends.",
             One([service] { return static_cast<double>(service->watch_cached_bytes()); }));
  f.AddGauge("weightstore_selections_active",
             "Selections with patterns or a target admitted now: resolving, or waiting for a selection worker.",
             One([service] { return static_cast<double>(service->active_selections()); }));
  f.AddGauge("weightstore_fetch_streams_active", "FetchTensors streams being served.",
             One([service] { return static_cast<double>(service->active_fetches()); }));
  f.AddGauge("weightstore_fetches_waiting_on_pulls",
             "FetchTensors streams waiting for a checkpoint being pulled from the origin "
             "(--max-fetches-waiting-on-pulls).",
             One([service] { return static_cast<double>(service->fetches_waiting_on_pulls()); }));
  f.AddCounter("weightstore_fetch_streams_stalled_total",
               "FetchTensors streams cancelled because their client stopped reading.",
               One([service] { return static_cast<double>(service->stalled_fetches()); }));
}

// The origin tier's families (core/catalog/pull.h), when the daemon has an origin.
void AddPullFamilies(ServerMetrics* metrics, const Puller* puller) {
  using metrics::One;
  using metrics::Sample;
  metrics::ScrapedFamilies& f = metrics->scraped();
  const std::string origin = puller->Stats().origin;
  f.AddCounter("weightstore_origin_pulled_bytes_total", "Bytes read from the origin by pulls.", [puller, origin] {
    return std::vector<Sample>{{{{"origin", origin}}, static_cast<double>(puller->Stats().bytes_pulled)}};
  });
  f.AddCounter("weightstore_origin_pulls_total", "Pulls from the origin, by outcome.", [puller] {
    const PullStats s = puller->Stats();
    return std::vector<Sample>{{{{"outcome", "ok"}}, static_cast<double>(s.pulls - s.pull_errors)},
                               {{{"outcome", "error"}}, static_cast<double>(s.pull_errors)}};
  });
  f.AddGauge("weightstore_origin_pulls_in_flight", "Checkpoints being pulled now.",
             One([puller] { return static_cast<double>(puller->Stats().pulls_in_flight); }));
  f.AddCounter("weightstore_node_cache_lookups_total",
               "Lookups through the node cache: hit (served here), miss (pulled, or waited on a pull).", [puller] {
                 const PullStats s = puller->Stats();
                 return std::vector<Sample>{{{{"result", "hit"}}, static_cast<double>(s.hits)},
                                            {{{"result", "miss"}}, static_cast<double>(s.misses)}};
               });
  f.AddGauge("weightstore_node_cache_bytes", "Bytes of pulled checkpoints on disk.",
             One([puller] { return static_cast<double>(puller->Stats().cache_bytes); }));
  f.AddGauge("weightstore_node_cache_budget_bytes", "The disk budget for pulled checkpoints (0: none).",
             One([puller] { return static_cast<double>(puller->Stats().cache_budget_bytes); }));
  f.AddCounter("weightstore_node_cache_evictions_total", "Pulled checkpoints evicted to fit the budget.",
               One([puller] { return static_cast<double>(puller->Stats().evictions); }));
  if (!puller->Stats().follow.following) return;
  // Following (origin/follower.h), per followed checkpoint.
  using Per = std::function<std::vector<Sample>(const FollowedStats&)>;
  auto per_checkpoint = [puller](Per per) {
    return [puller, per = std::move(per)] {
      std::vector<Sample> out;
      for (const FollowedStats& c : puller->Stats().follow.checkpoints) {
        for (Sample& sample : per(c)) out.push_back(std::move(sample));
      }
      return out;
    };
  };
  auto one = [](const FollowedStats& c, double value) {
    return std::vector<Sample>{{{{"checkpoint", c.name}}, value}};
  };
  f.AddGauge("weightstore_follow_upstream_connected",
             "1 while the watch of the upstream daemon is up (from S3: while its last poll succeeded).",
             One([puller] { return puller->Stats().follow.upstream_connected ? 1.0 : 0.0; }));
  f.AddGauge("weightstore_follow_checkpoints", "Checkpoints this node follows now.",
             One([puller] { return static_cast<double>(puller->Stats().follow.checkpoints.size()); }));
  f.AddGauge("weightstore_follow_unfollowed_checkpoints",
             "Checkpoints held as pulled that are to be followed (--follow-only) and are not: 0 on a healthy node.",
             One([puller] { return static_cast<double>(puller->UnfollowedCheckpoints()); }));
  f.AddGauge("weightstore_follow_lag_versions",
             "Versions the upstream announced since the one this node holds, not applied yet.",
             per_checkpoint([one](const FollowedStats& c) { return one(c, static_cast<double>(c.lag_versions)); }));
  f.AddGauge("weightstore_follow_lag_seconds",
             "Seconds since the upstream announced the oldest version not applied yet (0 when current).",
             per_checkpoint([one](const FollowedStats& c) { return one(c, c.lag_seconds); }));
  f.AddCounter("weightstore_follow_updates_total",
               "Versions applied: every changed tensor as an element patch (patches), or some whole (whole), or "
               "from an origin of whole files only the changed tensors' byte ranges (ranges).",
               per_checkpoint([](const FollowedStats& c) {
                 return std::vector<Sample>{
                     {{{"checkpoint", c.name}, {"how", "patches"}}, static_cast<double>(c.steps_patched)},
                     {{{"checkpoint", c.name}, {"how", "whole"}}, static_cast<double>(c.steps_whole)},
                     {{{"checkpoint", c.name}, {"how", "ranges"}}, static_cast<double>(c.steps_ranged)}};
               }));
  f.AddCounter("weightstore_follow_received_bytes_total", "Bytes received from the upstream by steps, by kind.",
               per_checkpoint([](const FollowedStats& c) {
                 return std::vector<Sample>{
                     {{{"checkpoint", c.name}, {"kind", "patch"}}, static_cast<double>(c.patch_bytes)},
                     {{{"checkpoint", c.name}, {"kind", "whole"}}, static_cast<double>(c.whole_bytes)}};
               }));
  f.AddCounter("weightstore_follow_failures_total", "Steps that failed and published nothing.",
               per_checkpoint([one](const FollowedStats& c) { return one(c, static_cast<double>(c.failures)); }));
  f.AddGauge("weightstore_follow_blocked",
             "1 while a checkpoint's steps cannot succeed as things are (the log says why); tried again at the "
             "upstream's next version.",
             per_checkpoint([one](const FollowedStats& c) { return one(c, c.blocked ? 1.0 : 0.0); }));
  f.AddCounter("weightstore_follow_fallbacks_total",
               "Steps whose changed tensors came whole, by reason: not_kept, patch_failed, not_delta, index_changed.",
               per_checkpoint([](const FollowedStats& c) {
                 std::vector<Sample> out;
                 for (const char* reason : {"not_kept", "patch_failed", "not_delta", "index_changed"}) {
                   auto it = c.fallbacks.find(reason);
                   out.push_back({{{"checkpoint", c.name}, {"reason", reason}},
                                  static_cast<double>(it == c.fallbacks.end() ? 0 : it->second)});
                 }
                 return out;
               }));
}

}  // namespace

WeightStoreServer::WeightStoreServer() = default;

absl::StatusOr<std::unique_ptr<WeightStoreServer>> WeightStoreServer::Start(ServerOptions options) {
  std::unique_ptr<WeightStoreServer> s(new WeightStoreServer());
  s->metrics_ = std::make_unique<ServerMetrics>();
  s->auth_ = std::make_unique<Authenticator>();
  if (!options.tokens_file.empty()) {
    absl::StatusOr<Authenticator> auth = Authenticator::FromFile(options.tokens_file);
    if (!auth.ok()) return auth.status();
    *s->auth_ = *std::move(auth);
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = Credentials(options.tls);
  if (!credentials.ok()) return credentials.status();

  s->segments_ = std::make_unique<SegmentCache>(options.shm_budget_bytes);
  options.registry.shm = s->segments_.get();
  ServerMetrics* metrics = s->metrics_.get();
  options.registry.on_load = [metrics](const std::string& name, double seconds, const absl::Status& status) {
    metrics->ObserveLoad(seconds, status.ok());
  };
  s->registry_ = std::make_unique<CheckpointRegistry>(options.registry);
  if (options.make_puller) {
    auto puller = options.make_puller(s->registry_.get());
    if (!puller.ok()) return puller.status();
    s->puller_ = *std::move(puller);
  }
  ScanReport report = s->registry_->Rescan();
  for (const std::string& e : report.errors) std::fprintf(stderr, "weightstored: not serving %s\n", e.c_str());
  for (const std::string& c : report.cleaned) {
    std::fprintf(stderr, "weightstored: removed the abandoned upload %s\n", c.c_str());
  }
  for (const std::string& f : report.rolled_forward) {
    std::fprintf(stderr, "weightstored: finished a publish a crash interrupted: %s\n", f.c_str());
  }
  for (const std::string& folder : RegistryFolders(options.registry)) options.service.hidden_folders.push_back(folder);
  s->service_ =
      std::make_unique<WeightStoreService>(s->registry_.get(), options.service, s->auth_.get(), s->puller_.get());
  if (!options.data_lane.listen.empty()) {
    if (!options.tls.cert_file.empty()) return DataLaneWithTls();
    absl::StatusOr<std::unique_ptr<DataLane>> lane = DataLane::Start(options.data_lane);
    if (!lane.ok()) return lane.status();
    s->lane_ = std::shared_ptr<DataLane>(*std::move(lane));
    s->service_->SetDataLane(s->lane_);
  }

  // The default health service is implemented without protobuf; touching the
  // generated descriptor registers grpc.health.v1 so reflection can describe it.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
  // Every method's call series exist from the start, at 0.
  s->metrics_->InitializeServices({std::string(v1::WeightStore::service_full_name()), "grpc.health.v1.Health",
                                   "grpc.reflection.v1alpha.ServerReflection"});
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, *credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  builder.SetMaxSendMessageSize(options.max_send_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams_per_connection);
  // gRPC 1.51 turns SO_REUSEPORT on by default: a second daemon would silently
  // share the port. Off, it fails to bind instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(s->metrics_->InterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen, " (address in use or invalid)"));
  }
  if (!options.health_listen.empty()) {
    grpc::ServerBuilder health;
    health.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(), &s->health_port_);
    health.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    s->health_server_ = health.BuildAndStart();
    if (s->health_server_ == nullptr || s->health_port_ == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen for health checks on ", options.health_listen));
    }
  }
  if (!options.socket.path.empty()) {
    options.socket.selection_limits = options.service.selection_limits;
    options.socket.hidden_folders = options.service.hidden_folders;
    auto shm = ShmServer::Start(s->registry_.get(), s->segments_.get(), options.socket, s->puller_.get(),
                                s->service_->selection_gate());
    if (!shm.ok()) return shm.status();
    s->shm_server_ = *std::move(shm);
  }
  AddScrapedFamilies(s->metrics_.get(), s->registry_.get(), s->segments_.get(), s->shm_server_.get(),
                     s->service_.get());
  if (s->puller_ != nullptr) AddPullFamilies(s->metrics_.get(), s->puller_.get());
  if (s->lane_ != nullptr) {
    s->metrics_->scraped().AddCounter(
        "weightstore_data_lane_connections_total",
        "Connections to the data lane (--data-listen), by outcome: attached (a fetch's bytes went over it), refused "
        "(a bad hello, an unknown or spent ticket, another address), timed_out (no ticket in time), overflowed "
        "(too many handshakes at once), unclaimed (a ticket whose connection never came).",
        [lane = s->lane_.get()] {
          const DataLaneCounts c = lane->counts();
          std::vector<metrics::Sample> out;
          for (const auto& [outcome, n] : {std::pair<const char*, uint64_t>{"attached", c.attached},
                                           {"refused", c.refused},
                                           {"timed_out", c.timed_out},
                                           {"overflowed", c.overflowed},
                                           {"unclaimed", c.unclaimed}}) {
            out.push_back({{{"outcome", outcome}}, static_cast<double>(n)});
          }
          return out;
        });
  }
  if (!options.metrics_listen.empty()) {
    auto http = MetricsHttpServer::Start(options.metrics_listen, *s->metrics_);
    if (!http.ok()) return http.status();
    s->metrics_http_ = *std::move(http);
    s->metrics_port_ = s->metrics_http_->port();
  }
  for (grpc::Server* server : {s->server_.get(), s->health_server_.get()}) {
    if (server == nullptr) continue;
    grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
    health->SetServingStatus("", true);
    health->SetServingStatus(v1::WeightStore::service_full_name(), true);
  }
  if (s->puller_ != nullptr && !options.prefetch.empty()) {
    s->prefetch_ = std::thread([puller = s->puller_.get(), names = options.prefetch] {
      for (const std::string& name : names) {
        absl::StatusOr<PullResult> pulled = puller->Pull(name);
        if (pulled.ok()) {
          std::fprintf(stderr, "weightstored: pulled '%s': %llu bytes in %.2f s%s\n", name.c_str(),
                       static_cast<unsigned long long>(pulled->bytes_pulled), pulled->seconds,
                       pulled->already_present ? " (already here)" : "");
        } else {
          std::fprintf(stderr, "weightstored: cannot pull '%s': %s\n", name.c_str(),
                       std::string(pulled.status().message()).c_str());
        }
      }
    });
  }
  return s;
}

WeightStoreServer::~WeightStoreServer() {
  if (server_ != nullptr) Shutdown(std::chrono::milliseconds(0), std::chrono::milliseconds(0));
}

void WeightStoreServer::Shutdown(std::chrono::milliseconds drain, std::chrono::milliseconds grace) {
  if (server_ == nullptr) return;
  const auto began = std::chrono::steady_clock::now();
  for (grpc::Server* server : {server_.get(), health_server_.get()}) {
    if (server == nullptr) continue;
    if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService()) {
      health->Shutdown();  // every service NOT_SERVING, and it stays so
    }
  }
  if (drain.count() > 0) std::this_thread::sleep_for(drain);
  service_->StopAccepting();
  if (puller_ != nullptr) puller_->Shutdown();  // pulls in progress end, Unavailable
  if (prefetch_.joinable()) prefetch_.join();
  if (shm_server_ != nullptr) shm_server_->Stop();  // mappings handed out stay valid
  service_->StopWatches();                          // they never end by themselves
  service_->StopBackground();                       // calls queued for a checksum worker end
  const auto deadline = std::chrono::system_clock::now() + grace;
  // gRPC's Shutdown closes each connection once its calls are done, even with
  // their last bytes still queued (tcp_linger.h): let the WeightStore calls
  // finish and their bytes reach the clients first, within the same grace.
  // New calls are refused by now, but one admitted just before may still be
  // starting: checked again after the acknowledgements.
  do {
    while (metrics_->weightstore_calls_in_flight() > 0 && std::chrono::system_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    WaitForPeersToAcknowledge(port_, deadline);
  } while (metrics_->weightstore_calls_in_flight() > 0 && std::chrono::system_clock::now() < deadline);
  // Every WeightStore call is done and its bytes acknowledged: by the client's
  // kernel, not yet its gRPC, which a slow reader's flow-control window can
  // hold back by many messages. Closing the connection before the client has
  // read them fails its call. gRPC's graceful shutdown sends each connection a
  // GOAWAY and a PING and closes it on the ack, which a client sends only once
  // it has read everything before it: a call that succeeded since the signal
  // gets that, within the grace. Otherwise the short window, because an idle
  // client reads the PING only when its channel's backup poller wakes (every
  // 5 s): with idle clients connected, stopping took 5 or 10 s more.
  const bool clients_may_be_reading = metrics_->last_weightstore_success() >= began;
  server_->Shutdown(clients_may_be_reading ? deadline
                                           : std::min(deadline, std::chrono::system_clock::now() + kGoawayWindow));
  server_->Wait();
  server_.reset();
  if (lane_ != nullptr) lane_->Stop();  // no stream is left to use it
  if (health_server_ != nullptr) {
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_.reset();
  }
  metrics_http_.reset();
}

int WeightStoreServer::data_lane_port() const { return lane_ != nullptr ? lane_->port() : 0; }

std::shared_ptr<grpc::Channel> WeightStoreServer::InProcessChannel() {
  return server_->InProcessChannel(grpc::ChannelArguments());
}

void WeightStoreServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace weightstore::server
