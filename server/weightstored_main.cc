// weightstored: serves the checkpoints of a models folder over gRPC.
//
// With --socket, processes on the same host map tensors through a Unix socket
// (server/shm_server.h).
//
// Signals: SIGHUP rescans the models folder; SIGTERM and SIGINT shut down
// gracefully (health NOT_SERVING, drain, then streams in flight get the grace
// period to finish).
#include <grpc/grpc.h>
#include <signal.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/store.h"
#include "core/format.h"
#include "core/mapped_file.h"
#include "origin/grpc_origin.h"
#include "origin/node_cache.h"
#include "origin/s3_origin.h"
#include "server/log.h"
#include "server/server.h"

namespace {

// The config as --check-config prints it, with every secret's value removed.
std::string RedactSecrets(const std::string& config) {
  std::string out;
  for (absl::string_view line : absl::StrSplit(config, '\n')) {
    if (absl::StartsWith(line, "aws-secret-access-key") || absl::StartsWith(line, "aws-session-token") ||
        absl::StartsWith(line, "aws-access-key-id")) {
      line = line.substr(0, line.find('='));
      out.append(absl::StrCat(absl::StripTrailingAsciiWhitespace(line), "=\"(redacted)\"\n"));
      continue;
    }
    if (!line.empty()) absl::StrAppend(&out, line, "\n");
  }
  return out;
}

// What makes the daemon's puller once its registry exists: the origin named
// by `url`, and the node cache over the models folder.
absl::StatusOr<std::function<absl::StatusOr<std::unique_ptr<weightstore::Puller>>(weightstore::CheckpointRegistry*)>>
MakePuller(const std::string& url, const std::string& token_file, const std::string& ca_file,
           weightstore::origin::S3Config s3, weightstore::origin::NodeCacheOptions cache, bool follow,
           double follow_interval_seconds, std::vector<std::string> follow_only) {
  using weightstore::origin::Origin;
  std::unique_ptr<Origin> origin;
  auto upstream = std::make_shared<weightstore::origin::FollowUpstream>();
  upstream->only = std::move(follow_only);
  if (absl::StartsWith(url, "s3://")) {
    weightstore::origin::FillFromEnvironment(&s3);
    if (cache.parallel_reads > 0) s3.parallel_reads = cache.parallel_reads;
    auto opened = weightstore::origin::S3Origin::Create(url, std::move(s3));
    if (!opened.ok()) return opened.status();
    origin = *std::move(opened);
    if (follow) {
      // Its listing, polled. The origin is the node cache's, which stops the
      // follower before it lets go of the origin.
      upstream->poll = [raw = origin.get()](const std::string& name) { return raw->Version(name); };
      upstream->poll_interval = absl::Seconds(follow_interval_seconds);
    }
  } else {
    weightstore::client::RemoteOptions remote;
    remote.tls_ca_file = ca_file;
    if (!token_file.empty()) {
      std::ifstream in(token_file);
      if (!in || !std::getline(in, remote.token) || remote.token.empty()) {
        return absl::NotFoundError(absl::StrCat("--origin-token-file: cannot read a token from '", token_file, "'"));
      }
    }
    if (follow) {
      // A watch and the steps' fetches on connections of their own, apart
      // from the pulls'. A broken watch is reopened by the follower, which
      // says so in its metrics, not within the store; a step's broken fetch
      // resumes as any client's does.
      weightstore::client::RemoteOptions watching = remote;
      watching.resume_window = std::chrono::milliseconds(0);
      auto watch = weightstore::origin::OpenGrpcUpstream(url, std::move(watching));
      if (!watch.ok()) return watch.status();
      auto steps = weightstore::origin::OpenGrpcUpstream(url, remote);
      if (!steps.ok()) return steps.status();
      upstream->watch = *std::move(watch);
      upstream->steps = *std::move(steps);
    }
    auto opened = weightstore::origin::OpenGrpcOrigin(url, std::move(remote),
                                                      cache.parallel_reads > 0 ? cache.parallel_reads : 4);
    if (!opened.ok()) return opened.status();
    origin = *std::move(opened);
  }
  auto shared = std::make_shared<std::unique_ptr<Origin>>(std::move(origin));
  return [shared, upstream,
          cache](weightstore::CheckpointRegistry* registry) -> absl::StatusOr<std::unique_ptr<weightstore::Puller>> {
    auto opened = weightstore::origin::NodeCache::Open(registry, std::move(*shared), cache, std::move(*upstream));
    if (!opened.ok()) return opened.status();
    return std::unique_ptr<weightstore::Puller>(*std::move(opened));
  };
}

}  // namespace

int main(int argc, char** argv) {
  // A gRPC library reference held for the life of the process, never given
  // back. Otherwise the last gRPC object's destructor (the server's, at
  // shutdown) runs gRPC's global shutdown, which joins an executor thread that
  // may sit in a poll with a timeout of up to 10 s: stopping took 9 s more in
  // about 1 run in 8 of a test with a client still reading. The process exits
  // right after, and the kernel reclaims it all.
  grpc_init();
  using namespace weightstore::server;
  using weightstore::ScanReport;
  using weightstore::SelectionLimits;
  ServerOptions options;
  options.registry.models_dir = WEIGHTSTORE_DEFAULT_MODELS_DIR;
  std::string port_file;
  double drain_seconds = 0, grace_seconds = 10;

  const std::string about =
      absl::StrCat("weightstored: serves model checkpoints (", weightstore::FormatNames(), ") over gRPC");
  CLI::App app{about};
  app.add_option("--models", options.registry.models_dir, "Folder of checkpoints to serve")->capture_default_str();
  app.add_option("--listen", options.listen, "Address to listen on (host:port; port 0 picks one)")
      ->capture_default_str();
  app.add_option("--port-file", port_file, "Write the bound port to this file once serving");
  app.add_option("--drain-seconds", drain_seconds,
                 "On SIGTERM, report NOT_SERVING this long before closing the listener")
      ->capture_default_str();
  app.add_option("--grace-seconds", grace_seconds, "On SIGTERM, let streams in flight finish for this long")
      ->capture_default_str();
  app.add_option("--chunk-bytes", options.service.chunk_bytes, "Largest tensor chunk sent")->capture_default_str();
  app.add_option("--max-concurrent-fetches", options.service.streams.total,
                 "FetchTensors streams served at once; more get RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--max-fetches-per-peer", options.service.streams.per_peer,
                 "FetchTensors streams served at once to one client address")
      ->capture_default_str();
  double stream_idle_seconds = std::chrono::duration<double>(options.service.streams.idle).count();
  app.add_option("--stream-idle-timeout", stream_idle_seconds,
                 "Cancel a FetchTensors stream (or an upload) that moves less than --stream-min-bytes in this many "
                 "seconds: its client stopped reading, or trickles")
      ->capture_default_str();
  app.add_option("--stream-min-bytes", options.service.streams.min_bytes,
                 "Bytes a stream must move in each --stream-idle-timeout period")
      ->capture_default_str();
  app.add_option("--max-streams-per-connection", options.max_concurrent_streams_per_connection,
                 "HTTP/2 streams per client connection")
      ->capture_default_str();
  app.add_option("--max-request-bytes", options.max_receive_message_bytes, "Largest request message")
      ->capture_default_str();
  app.add_option("--max-push-patch-bytes", options.registry.max_push_patch_bytes,
                 "Largest element patch a push may send for one tensor (held in memory while it arrives; bytes, "
                 "or with a unit)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--max-put-bytes", options.registry.max_put_bytes, "Largest PutCheckpoint upload")
      ->capture_default_str();
  app.add_option("--max-fetches-waiting-on-pulls", options.service.pull_waits.total,
                 "With --origin: FetchTensors streams that may wait at once for their checkpoint to be pulled, "
                 "outside --max-concurrent-fetches")
      ->capture_default_str();
  app.add_option("--max-fetches-waiting-on-pulls-per-peer", options.service.pull_waits.per_peer,
                 "With --origin: FetchTensors streams from one client address that may wait at once on pulls")
      ->capture_default_str();
  app.add_option("--max-concurrent-selections", options.service.selection_work.total,
                 "Selections with patterns or a target resolved at once (ListTensors, FetchTensors)")
      ->capture_default_str();
  app.add_option("--max-selections-per-peer", options.service.selection_work.per_peer,
                 "Selections with patterns or a target resolved at once for one client address")
      ->capture_default_str();
  app.add_option("--selection-threads", options.service.selection_threads,
                 "Workers resolving those selections, off gRPC's threads (0: half the cores, at least one)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-concurrent-uploads", options.service.uploads.total, "PutCheckpoint uploads at once")
      ->capture_default_str();
  app.add_option("--max-uploads-per-peer", options.service.uploads.per_peer,
                 "PutCheckpoint uploads at once from one client address")
      ->capture_default_str();
  // Limits on what one request or one file may cost (README, "Limits").
  SelectionLimits& selection = options.service.selection_limits;
  size_t tensor_name_bytes = options.registry.open.max_name_bytes;
  app.add_option("--max-name-bytes", options.registry.max_name_bytes,
                 "Longest checkpoint name, in a request or in the models folder")
      ->capture_default_str();
  app.add_option("--max-tensor-name-bytes", tensor_name_bytes,
                 "Longest tensor name: in a checkpoint file, after renaming, and in a target")
      ->capture_default_str();
  app.add_option("--max-selected-name-bytes", selection.max_total_name_bytes,
                 "Bytes of all names one request selects, together")
      ->capture_default_str();
  app.add_option("--max-expansion", options.registry.open.max_expansion,
                 "A strided .pt tensor may be served as at most this many times the storage bytes it reads "
                 "(or 1 MiB)")
      ->capture_default_str();
  app.add_option("--max-patterns", selection.max_patterns, "Regex patterns in one request (include, exclude, rename)")
      ->capture_default_str();
  app.add_option("--max-pattern-bytes", selection.max_pattern_bytes,
                 "Longest pattern, replacement, exact path or top-level key in a request")
      ->capture_default_str();
  app.add_option("--max-regex-program", selection.max_program_size, "RE2 instructions of one pattern")
      ->capture_default_str();
  app.add_option("--max-regex-program-total", selection.max_total_program_size,
                 "RE2 instructions of all patterns of one request together")
      ->capture_default_str();
  app.add_option("--max-regex-memory", selection.max_regex_memory,
                 "RE2 memory of all patterns of one request together (bytes, or with a unit: 16MiB)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--abandoned-upload-seconds", options.registry.abandoned_temporary_seconds,
                 "A rescan (and startup) removes upload temporaries no live writer holds once this old")
      ->capture_default_str();
  app.add_option("--max-selection-scan-bytes", selection.max_scan_bytes,
                 "Bytes of names one request's patterns may scan, every pass counted (bytes, or with a unit: 1GiB)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  double selection_seconds = std::chrono::duration<double>(selection.max_time).count();
  app.add_option("--max-selection-seconds", selection_seconds,
                 "CPU time one request's selection (renames, filters) may take")
      ->capture_default_str();
  app.add_option("--max-record-inflated-bytes", options.registry.open.max_record_inflated_bytes,
                 "Bytes one gzipped Burn record (.mpk.gz, .json.gz, .bin.gz) may inflate to, kept while served "
                 "(bytes, or with a unit: 8GiB); more than 1100 times its compressed size is refused too")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--record-layout", options.registry.open.record_layout,
                 "Read Burn bincode records (.bin.gz in the models folder, .bin by LoadCheckpoint) with this "
                 "layout: the target-schema JSON ({\"parameters\": [{\"path\", \"shape\"}]}, in declaration order)");
  app.add_option("--load-root", options.registry.load_roots,
                 "A folder besides --models whose files LoadCheckpoint may serve (repeatable)");
  app.add_option("--socket", options.socket.path,
                 "Same-host Unix socket: local processes map tensors through it (off when empty)");
  std::vector<uid_t> allow_uids;
  std::vector<gid_t> allow_gids;
  app.add_option("--socket-allow-uid", allow_uids,
                 "Uid allowed on --socket (repeatable; with no uid or gid given, only the daemon's own uid)");
  app.add_option("--socket-allow-gid", allow_gids, "Gid allowed on --socket, primary or supplementary (repeatable)");
  app.add_option("--socket-max-connections-per-peer", options.socket.max_connections_per_peer,
                 "Socket connections of one process (of one uid when its pid is hidden from the daemon)")
      ->capture_default_str();
  app.add_option("--socket-max-connections-per-uid", options.socket.max_connections_per_uid,
                 "Socket connections of all processes of one uid")
      ->capture_default_str();
  std::string file_segments = "auto";
  app.add_option("--socket-file-segments", file_segments,
                 "auto: pass a checkpoint file itself only to peers that could not open it writable (a read-only "
                 "mount, or neither root nor its owner nor granted write), else a sealed copy; always: pass it to "
                 "every allowed peer; never: always a sealed copy")
      ->check(CLI::IsMember({"auto", "always", "never"}))
      ->capture_default_str();
  app.add_option("--shm-budget", options.shm_budget_bytes,
                 "Shared memory for materialized segments and preloads (bytes, or with a unit: 8GiB)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  bool tensor_digests = true;
  app.add_option("--tensor-digests", tensor_digests,
                 "Digest every tensor (XXH3-128) as a version is loaded, for watch events and delta fetches "
                 "(one read of every byte at load)")
      ->capture_default_str();
  app.add_option("--kept-versions", options.registry.kept_versions,
                 "Versions of each checkpoint whose digests are kept: the versions a delta fetch can start from")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--kept-digest-bytes", options.registry.kept_manifest_bytes,
                 "Memory all kept digests may hold (bytes, or with a unit); the oldest go first")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  options.registry.kept_patch_bytes = uint64_t{1} << 30;
  app.add_option("--kept-patch-bytes", options.registry.kept_patch_bytes,
                 "Memory the element patches between kept versions may hold (bytes, or with a unit; 0: no "
                 "patches): a client a few versions behind gets the changed elements, not whole tensors; the "
                 "oldest go first. The patches composed from them for clients several versions behind may hold "
                 "as much again (while cached or being sent); one that does not fit is not made, and the tensor "
                 "goes whole")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--max-watches", options.service.watches.max_watches, "WatchCheckpoints streams at once")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--max-watches-per-peer", options.service.watches.max_watches_per_peer,
                 "WatchCheckpoints streams at once from one client address")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  bool preload_all = false;
  app.add_flag("--preload", preload_all,
               "Read every checkpoint into sealed shared memory when loaded (models on network storage)");
  std::vector<std::string> preload;
  app.add_option("--preload-checkpoint", preload, "Preload this checkpoint only (repeatable)");
  app.add_option("--metrics-listen", options.metrics_listen,
                 "Serve Prometheus metrics on http://HOST:PORT/metrics (off when empty)");
  app.add_option("--health-listen", options.health_listen,
                 "A second, plaintext gRPC port with only grpc.health.v1.Health, never authenticated (off when empty)");
  app.add_option("--data-listen", options.data_lane.listen,
                 "A plain TCP port (HOST:PORT) where fetches that ask for it receive tensor bytes, beside gRPC: "
                 "one copy fewer on the client. Not with TLS (off when empty)");
  double lane_handshake_seconds = std::chrono::duration<double>(options.data_lane.handshake_time).count();
  app.add_option("--data-lane-handshake-timeout", lane_handshake_seconds,
                 "Seconds a data lane connection has to send its ticket")
      ->check(CLI::Range(0.05, 600.0))
      ->capture_default_str();
  app.add_option("--data-lane-max-handshakes-per-address", options.data_lane.max_handshakes_per_address,
                 "Data lane connections still sending their ticket, from one address (an IPv6 /64)")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--tls-cert", options.tls.cert_file, "TLS certificate chain (PEM) for the gRPC port");
  app.add_option("--tls-key", options.tls.key_file, "TLS private key (PEM)");
  app.add_option("--tls-client-ca", options.tls.client_ca_file,
                 "Require client certificates signed by this CA (PEM): mutual TLS");
  app.add_option("--tokens-file", options.tokens_file,
                 "Bearer tokens, one '<read|admin> <token>' per line; without it every call is allowed");
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "debug, info, warning or error")
      ->check(CLI::IsMember({"debug", "info", "warning", "warn", "error"}))
      ->capture_default_str();
  // The origin tier (origin/node_cache.h).
  std::string origin_url, origin_token_file, origin_ca_file;
  weightstore::origin::NodeCacheOptions cache;
  weightstore::origin::S3Config s3;
  std::vector<std::string> pull;
  app.add_option("--origin", origin_url,
                 "Pull checkpoints this node lacks from here: s3://BUCKET[/PREFIX] or grpc[s]://HOST:PORT (an upstream "
                 "weightstored); the models folder must be writable (off when empty)");
  app.add_option("--origin-token-file", origin_token_file,
                 "File whose first line is the token sent to a grpc:// origin (its read scope)");
  app.add_option("--origin-ca-file", origin_ca_file, "CA certificate (PEM) of a grpcs:// origin");
  app.add_option("--origin-parallel-reads", cache.parallel_reads,
                 "Byte ranges a pull reads at once (0: 8 from S3, 4 from a daemon)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--cache-max-bytes", cache.max_bytes,
                 "Disk budget for pulled checkpoints (least recently used evicted; 0: no limit)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--max-pulls", cache.max_concurrent_pulls, "Distinct checkpoints pulled at once")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--pull", pull, "Pull this checkpoint from the origin once serving (repeatable)");
  bool follow = false;
  CLI::Option* follow_flag =
      app.add_flag("--follow", follow,
                   "Keep every checkpoint pulled at the origin's newest version: from a grpc[s]:// origin as element "
                   "patches where it keeps them, from an s3:// origin whole (docs/origin.md, Following)");
  double follow_interval_seconds = 10;
  app.add_option("--follow-interval", follow_interval_seconds,
                 "Seconds between two polls of an s3:// origin's listing by --follow (with 20% jitter)")
      ->check(CLI::Range(0.05, 86400.0))
      ->capture_default_str();
  std::vector<std::string> follow_only;
  app.add_option("--follow-only", follow_only,
                 "With --follow, follow only the checkpoints so named (repeatable; fnmatch patterns, '*' matching "
                 "'/' too: \"org/*\"); the rest are served as pulled")
      ->needs(follow_flag);
  // S3 credentials: the AWS SDKs' environment variables, or these keys in the
  // config file (never on the command line, where ps shows them). Neither is
  // ever printed or logged.
  app.add_option("--aws-access-key-id", s3.access_key_id, "S3 access key (else AWS_ACCESS_KEY_ID)");
  app.add_option("--aws-secret-access-key", s3.secret_access_key,
                 "S3 secret key (else AWS_SECRET_ACCESS_KEY); put it in the config file, not on the command line");
  app.add_option("--aws-session-token", s3.session_token, "S3 session token (else AWS_SESSION_TOKEN)");
  app.add_option("--aws-region", s3.region, "S3 region (else AWS_REGION, AWS_DEFAULT_REGION, us-east-1)");
  app.add_option("--aws-endpoint-url", s3.endpoint,
                 "S3-compatible endpoint, path-style (else AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL; empty: AWS)");
  bool check_config = false;
  app.add_flag("--check-config", check_config,
               "Check the options (models folder, tokens and TLS files, socket folder), print them, and exit");
  bool copy_payloads = false;
  app.add_flag("--copy-payloads", copy_payloads,
               "Copy tensor bytes into protobuf messages instead of zero-copy slices (benchmark baseline only)");
  // Every option can also come from a TOML file: the same names without the
  // leading dashes ("listen = \"0.0.0.0:50051\""); flags override the file.
  app.set_config("--config", "", "Read options from this TOML file (keys: the long option names)");
  app.allow_config_extras(CLI::config_extras_mode::error);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  options.service.zero_copy = !copy_payloads;
  options.service.streams.idle = std::chrono::milliseconds(static_cast<int64_t>(stream_idle_seconds * 1000));
  options.service.uploads.idle = options.service.streams.idle;
  options.data_lane.handshake_time = std::chrono::milliseconds(static_cast<int64_t>(lane_handshake_seconds * 1000));
  options.service.uploads.min_bytes = options.service.streams.min_bytes;
  selection.max_time = std::chrono::milliseconds(static_cast<int64_t>(selection_seconds * 1000));
  options.registry.watch_files = true;
  // A served file truncated in place must fail the reads that hit it, not kill
  // the daemon (core/mapped_file.h).
  weightstore::InstallMappedFileGuard();
  // Descriptors: connections, mapped files, a pull's files (up to 4096 each).
  // The soft limit (often 1024) is raised to the hard one.
  if (rlimit files; ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &files);
  }
  options.registry.open.max_name_bytes = tensor_name_bytes;
  selection.max_name_bytes = tensor_name_bytes;
  SetLogLevel(*ParseLogLevel(log_level));
  // Following needs an origin, and from an upstream daemon digests to check
  // each step against its (origin/follower.h).
  if (!std::isfinite(follow_interval_seconds)) {  // NaN passes CLI11's range check
    std::fprintf(stderr, "weightstored: --follow-interval: not a number of seconds\n");
    return 1;
  }
  if (follow) {
    const bool upstream_daemon = absl::StartsWith(origin_url, "grpc://") || absl::StartsWith(origin_url, "grpcs://");
    const char* refused = origin_url.empty() ? "--follow needs --origin"
                          : upstream_daemon && !tensor_digests
                              ? "--follow of an upstream weightstored needs tensor digests (--tensor-digests): each "
                                "step is checked against the upstream's"
                              : nullptr;
    if (refused != nullptr) {
      std::fprintf(stderr, "weightstored: %s\n", refused);
      return 1;
    }
  }
  if (!follow && !follow_only.empty()) {  // --follow=false, or follow = false in the config file
    std::fprintf(stderr, "weightstored: --follow-only needs --follow\n");
    return 1;
  }
  if (absl::Status only = weightstore::origin::CheckFollowPatterns(follow_only); !only.ok()) {
    std::fprintf(stderr, "weightstored: --follow-only: %s\n", std::string(only.message()).c_str());
    return 1;
  }
  if (check_config) {
    absl::Status status = CheckOptions(options);
    if (!status.ok()) {
      std::fprintf(stderr, "weightstored: %s\n", std::string(status.message()).c_str());
      return 1;
    }
    std::printf("%s", RedactSecrets(app.config_to_str(/*default_also=*/true, /*write_description=*/false)).c_str());
    return 0;
  }
  options.socket.file_segments = file_segments == "always"  ? FileSegments::kAlways
                                 : file_segments == "never" ? FileSegments::kNever
                                                            : FileSegments::kAuto;
  options.socket.allowed_uids.insert(allow_uids.begin(), allow_uids.end());
  options.socket.allowed_gids.insert(allow_gids.begin(), allow_gids.end());
  options.registry.preload_all = preload_all;
  options.registry.tensor_digests = tensor_digests;
  options.registry.preload.insert(preload.begin(), preload.end());

  // Signals are taken by one thread with sigwait; block them everywhere first.
  sigset_t signals;
  sigemptyset(&signals);
  for (int s : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&signals, s);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  if (!origin_url.empty()) {
    auto make = MakePuller(origin_url, origin_token_file, origin_ca_file, s3, cache, follow, follow_interval_seconds,
                           follow_only);
    if (!make.ok()) {
      std::fprintf(stderr, "weightstored: %s\n", std::string(make.status().message()).c_str());
      return 1;
    }
    options.make_puller = *std::move(make);
    options.prefetch = pull;
  } else if (!pull.empty()) {
    std::fprintf(stderr, "weightstored: --pull needs --origin\n");
    return 1;
  }

  auto server = WeightStoreServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "weightstored: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  std::fprintf(
      stderr, "weightstored: serving %zu checkpoints from %s on port %d%s%s%s%s%s\n",
      (*server)->registry().List().size(), options.registry.models_dir.c_str(), (*server)->port(),
      options.tls.cert_file.empty() ? "" : (options.tls.client_ca_file.empty() ? " (TLS)" : " (mutual TLS)"),
      options.socket.path.empty() ? "" : (", socket " + options.socket.path).c_str(),
      (*server)->metrics_port() == 0 ? "" : (", metrics on port " + std::to_string((*server)->metrics_port())).c_str(),
      (*server)->health_port() == 0 ? "" : (", health on port " + std::to_string((*server)->health_port())).c_str(),
      (*server)->data_lane_port() == 0
          ? ""
          : (", data lane on port " + std::to_string((*server)->data_lane_port())).c_str());
  // Port files for scripts and tests: <file>.metrics and <file>.health first,
  // then <file> itself (renamed into place), so that its presence means all are there.
  auto write_port = [](const std::string& path, int port) {
    std::ofstream out(path);
    out << port << "\n";
    out.close();
    return static_cast<bool>(out);
  };
  bool written = true;
  if (!port_file.empty()) {
    if ((*server)->metrics_port() != 0) written &= write_port(port_file + ".metrics", (*server)->metrics_port());
    if ((*server)->health_port() != 0) written &= write_port(port_file + ".health", (*server)->health_port());
    if ((*server)->data_lane_port() != 0) written &= write_port(port_file + ".lane", (*server)->data_lane_port());
    written &= write_port(port_file + ".tmp", (*server)->port()) &&
               std::rename((port_file + ".tmp").c_str(), port_file.c_str()) == 0;
  }
  if (!written) {
    std::fprintf(stderr, "weightstored: cannot write the port file '%s'\n", port_file.c_str());
    (*server)->Shutdown(std::chrono::milliseconds(0), std::chrono::milliseconds(0));
    return 1;
  }
  while (true) {
    int sig = 0;
    sigwait(&signals, &sig);
    if (sig == SIGHUP) {
      ScanReport r = (*server)->registry().Rescan();
      std::fprintf(stderr, "weightstored: rescan: added [%s] replaced [%s] removed [%s]\n",
                   absl::StrJoin(r.added, ", ").c_str(), absl::StrJoin(r.replaced, ", ").c_str(),
                   absl::StrJoin(r.removed, ", ").c_str());
      for (const std::string& e : r.errors) std::fprintf(stderr, "weightstored: not serving %s\n", e.c_str());
      for (const std::string& c : r.cleaned) {
        std::fprintf(stderr, "weightstored: removed the abandoned upload %s\n", c.c_str());
      }
      for (const std::string& f : r.rolled_forward) {
        std::fprintf(stderr, "weightstored: finished a publish a crash interrupted: %s\n", f.c_str());
      }
      continue;
    }
    std::fprintf(stderr, "weightstored: shutting down (drain %.1fs, grace %.1fs)\n", drain_seconds, grace_seconds);
    (*server)->Shutdown(std::chrono::milliseconds(static_cast<int64_t>(drain_seconds * 1000)),
                        std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000)));
    std::fprintf(stderr, "weightstored: stopped\n");
    return 0;
  }
}
