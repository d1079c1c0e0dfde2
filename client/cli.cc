#include "client/cli.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/file_sink.h"
#include "client/store.h"
#include "client/updates.h"
#include "core/checkpoint.h"
#include "core/formats/checkpoint_writer.h"
#include "core/select/apply.h"
#include "core/select/dtype_cast.h"
#include "core/select/selection.h"
#include "core/select/snapshot.h"
#include "core/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "proto/codec/tls.h"

namespace weightstore::cli {
namespace {

absl::StatusOr<SelectionOptions> ParseSelection(const SelectionArgs& args) {
  SelectionOptions options;
  options.top_level_key = args.top_level_key;
  options.include = args.include;
  options.paths = args.paths;
  options.exclude = args.exclude;
  for (const std::string& rule : args.renames) {
    size_t eq = rule.find('=');
    if (eq == std::string::npos)
      return absl::InvalidArgumentError(absl::StrCat("--rename '", rule, "' is not FROM=TO"));
    options.renames.push_back({rule.substr(0, eq), rule.substr(eq + 1)});
  }
  if (args.contiguous_indices && args.no_contiguous_indices) {
    return absl::InvalidArgumentError("--contiguous-indices and --no-contiguous-indices contradict each other");
  }
  if (args.contiguous_indices) options.contiguous_indices = true;
  if (args.no_contiguous_indices) options.contiguous_indices = false;
  if (!args.adapter.empty()) {
    std::optional<Adapter> adapter = ParseAdapter(args.adapter);
    if (!adapter) return absl::InvalidArgumentError(absl::StrCat("unknown --adapter '", args.adapter, "'"));
    options.adapter = *adapter;
    if (args.target.empty() && *adapter != Adapter::kNone) {
      return absl::InvalidArgumentError(
          "--adapter needs --target SCHEMA.json: a checkpoint alone does not say which tensors belong to which "
          "module type");
    }
  }
  if (!args.dtype.empty()) {
    std::optional<DType> dtype = ParseDType(absl::AsciiStrToUpper(args.dtype));
    if (!dtype || !IsCastTarget(*dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--dtype '", args.dtype, "' is not one of ", absl::AsciiStrToLower(kCastTargets)));
    }
    options.dtype = dtype;
  }
  if (!args.shard.empty()) {
    const size_t slash = args.shard.find('/');
    if (slash == std::string::npos ||
        !absl::SimpleAtoi(absl::string_view(args.shard).substr(0, slash), &options.shard.rank) ||
        !absl::SimpleAtoi(absl::string_view(args.shard).substr(slash + 1), &options.shard.world_size) ||
        options.shard.world_size == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--shard '", args.shard, "' is not RANK/WORLD, e.g. 0/4"));
    }
  }
  for (const std::string& rule : args.shard_dims) {
    const size_t eq = rule.rfind('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--shard-dim '", rule, "' is not REGEX=DIM[xPARTS][:uneven]"));
    }
    absl::StatusOr<ShardSplit> split = ParseShardSplit(absl::string_view(rule).substr(eq + 1));
    if (!split.ok()) return absl::InvalidArgumentError(absl::StrCat("--shard-dim: ", split.status().message()));
    options.shard.rules.push_back({rule.substr(0, eq), *split});
  }
  for (const std::string& rule : args.shard_scales) {
    const size_t eq = rule.rfind('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == rule.size()) {
      return absl::InvalidArgumentError(absl::StrCat("--shard-scale '", rule, "' is not REGEX=WEIGHT[:BxB]"));
    }
    ScaleRule scale{rule.substr(0, eq), rule.substr(eq + 1), {}};
    if (const size_t colon = scale.weight.rfind(':'); colon != std::string::npos) {
      for (absl::string_view b : absl::StrSplit(absl::string_view(scale.weight).substr(colon + 1), 'x')) {
        uint64_t size = 0;
        if (!absl::SimpleAtoi(b, &size) || size == 0) {
          return absl::InvalidArgumentError(absl::StrCat("--shard-scale '", rule, "': block '",
                                                         scale.weight.substr(colon + 1),
                                                         "' is not sizes joined by x (128x128)"));
        }
        scale.block.push_back(size);
      }
      scale.weight.resize(colon);
    }
    options.shard.scales.push_back(std::move(scale));
  }
  options.shard.experts = args.shard_experts;
  options.shard.detect_scales = !args.no_scale_detection;
  const bool shard_rules =
      !options.shard.rules.empty() || !options.shard.scales.empty() || !options.shard.experts.empty();
  if (shard_rules && options.shard.world_size == 0) {
    return absl::InvalidArgumentError("--shard-dim, --shard-scale and --shard-experts need --shard RANK/WORLD");
  }
  if (options.shard.world_size > 0 && options.shard.rules.empty() && options.shard.experts.empty()) {
    return absl::InvalidArgumentError(
        "--shard needs at least one --shard-dim REGEX=DIM or --shard-experts REGEX (otherwise every tensor is "
        "replicated)");
  }
  for (const std::string& slice : args.slices) {
    const size_t eq = slice.rfind("=[");
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--slice '", slice, "' is not NAME=[a:b, :]"));
    }
    absl::StatusOr<std::vector<SliceBound>> bounds = ParseSliceBounds(absl::string_view(slice).substr(eq + 1));
    if (!bounds.ok()) return absl::InvalidArgumentError(absl::StrCat("--slice: ", bounds.status().message()));
    options.slices.push_back({slice.substr(0, eq), *std::move(bounds)});
  }
  return options;
}

// A checkpoint with the selection (and target, if any) applied.
struct Loaded {
  std::shared_ptr<const Checkpoint> checkpoint;
  std::shared_ptr<const Snapshot> snapshot;
  std::optional<Applied> applied;  // set when --target was given
};

absl::StatusOr<Loaded> LoadForCli(const std::string& path, const SelectionArgs& args) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(SelectionOptions options, ParseSelection(args));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Selection> selection, Selection::Compile(options));
  Loaded loaded;
  OpenOptions open;
  open.record_layout = args.record_layout;
  WEIGHTSTORE_ASSIGN_OR_RETURN(loaded.checkpoint, Checkpoint::Open(path, open));
  if (args.target.empty()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(loaded.snapshot, Snapshot::Select(loaded.checkpoint, *selection));
    return loaded;
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(TargetSchema schema, TargetSchema::Load(args.target));
  ApplyOptions apply_options;
  apply_options.allow_partial = args.allow_partial;
  WEIGHTSTORE_ASSIGN_OR_RETURN(Applied applied, Apply(loaded.checkpoint, *selection, schema, apply_options));
  loaded.snapshot = applied.snapshot;
  loaded.applied = std::move(applied);
  return loaded;
}

// A one-line progress bar on stderr, redrawn at most 10 times a second.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled) : enabled_(enabled) {}
  ~ProgressBar() {
    if (drawn_) std::fputc('\n', stderr);
  }
  void Update(uint64_t done, uint64_t total) {
    if (!enabled_ || total == 0) return;
    auto now = std::chrono::steady_clock::now();
    if (drawn_ && done < total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    drawn_ = true;
    const int width = 30;
    int filled = static_cast<int>(width * static_cast<double>(done) / static_cast<double>(total));
    double seconds = std::chrono::duration<double>(now - start_).count();
    double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
    std::fprintf(stderr, "\r[%s%s] %5.1f%%  %s / %s  %s/s   ", std::string(filled, '#').c_str(),
                 std::string(width - filled, ' ').c_str(),
                 100.0 * static_cast<double>(done) / static_cast<double>(total), HumanBytes(done).c_str(),
                 HumanBytes(total).c_str(), HumanBytes(static_cast<uint64_t>(rate)).c_str());
    std::fflush(stderr);
  }

 private:
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_;
};

constexpr uint64_t kProgressThreshold = uint64_t{64} << 20;

}  // namespace

std::string HumanBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024 && unit < 4) {
    v /= 1024;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.*f %s", v < 10 ? 2 : 1, v, kUnits[unit]);
}

// What inspect prints, from a local snapshot or a remote listing.
struct InspectView {
  std::string path, format, container;
  Metadata metadata;
  std::string quantization;  // QuantizationConfig::Describe(), or empty
  size_t total_tensors = 0;
  std::vector<client::TensorDescription> tensors;
  std::optional<ApplyResult> apply_result;
};

void PrintInspect(const InspectView& v, bool json, std::FILE* out) {
  uint64_t total_bytes = 0;
  for (const auto& t : v.tensors) total_bytes += t.spec.byte_size();
  if (json) {
    nlohmann::ordered_json doc;
    doc["format"] = v.format;
    if (!v.container.empty()) doc["container"] = v.container;
    doc["metadata"] = nlohmann::json::object();
    for (const auto& [k, val] : v.metadata) doc["metadata"][k] = val;
    if (!v.quantization.empty()) doc["quantization"] = v.quantization;
    doc["tensors"] = nlohmann::json::array();
    for (const auto& t : v.tensors) {
      nlohmann::ordered_json j;
      j["name"] = t.spec.name;
      j["dtype"] = std::string(DTypeName(t.spec.dtype));
      j["shape"] = t.spec.shape;
      j["bytes"] = t.spec.byte_size();
      if (t.source_name != t.spec.name) j["source"] = t.source_name;
      if (!t.slice.empty()) {
        j["slice"] = t.slice.ToString(t.unsliced_shape);
        j["unsliced_shape"] = t.unsliced_shape;
      }
      if (!t.scale_of.empty()) {
        j["scale_of"] = t.scale_of;
        j["shares_scale_blocks"] = t.shares_scale_blocks;
        j["scale_block"] = t.scale_block;
      }
      if (!t.quantization.empty()) j["quantization"] = t.quantization;
      doc["tensors"].push_back(std::move(j));
    }
    std::fprintf(out, "%s\n", doc.dump(1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return;
  }
  std::string format = v.container.empty() ? v.format : absl::StrCat(v.format, " (", v.container, ")");
  std::fprintf(out, "%s\n  format:   %s\n  tensors:  %zu", v.path.c_str(), format.c_str(), v.tensors.size());
  if (v.tensors.size() != v.total_tensors) std::fprintf(out, " selected of %zu", v.total_tensors);
  std::fprintf(out, "\n  data:     %s (%llu bytes)\n", HumanBytes(total_bytes).c_str(),
               static_cast<unsigned long long>(total_bytes));
  if (!v.quantization.empty()) std::fprintf(out, "  quantized: %s\n", v.quantization.c_str());
  if (!v.metadata.empty()) {
    std::fprintf(out, "  metadata:\n");
    for (const auto& [k, val] : v.metadata) std::fprintf(out, "    %s: %s\n", k.c_str(), val.c_str());
  }
  size_t name_width = 4, shape_width = 5;
  for (const auto& t : v.tensors) {
    name_width = std::max(name_width, t.spec.name.size());
    shape_width = std::max(shape_width, ShapeToString(t.spec.shape).size());
  }
  name_width = std::min<size_t>(name_width, 80);
  std::fprintf(out, "\n%-*s  %-7s  %-*s  %12s\n", static_cast<int>(name_width), "NAME", "DTYPE",
               static_cast<int>(shape_width), "SHAPE", "BYTES");
  for (const auto& t : v.tensors) {
    std::fprintf(out, "%-*s  %-7s  %-*s  %12llu", static_cast<int>(name_width), t.spec.name.c_str(),
                 std::string(DTypeName(t.spec.dtype)).c_str(), static_cast<int>(shape_width),
                 ShapeToString(t.spec.shape).c_str(), static_cast<unsigned long long>(t.spec.byte_size()));
    if (!t.slice.empty()) {
      std::fprintf(out, "  %s of %s", t.slice.ToString(t.unsliced_shape).c_str(),
                   ShapeToString(t.unsliced_shape).c_str());
    }
    if (t.source_name != t.spec.name) std::fprintf(out, "  <- %s", t.source_name.c_str());
    if (!t.scale_of.empty()) {
      std::fprintf(out, "  scales of %s in blocks of %s%s", t.scale_of.c_str(),
                   absl::StrJoin(t.scale_block, "x").c_str(),
                   t.shares_scale_blocks ? " (a block shared with another rank)" : "");
    }
    if (!t.quantization.empty()) std::fprintf(out, "  %s", t.quantization.c_str());
    std::fprintf(out, "\n");
  }
  if (v.apply_result) std::fprintf(out, "\n%s", v.apply_result->Summary().c_str());
}

absl::StatusOr<client::Query> QueryFor(const SelectionArgs& args) {
  client::Query query;
  WEIGHTSTORE_ASSIGN_OR_RETURN(query.selection, ParseSelection(args));
  if (!args.target.empty()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(query.target, TargetSchema::Load(args.target));
  }
  query.allow_partial = args.allow_partial;
  return query;
}

// The store behind --server (gRPC) or --socket (same host); exactly one is set.
absl::StatusOr<std::unique_ptr<client::Store>> Connect(const std::string& server, const std::string& socket,
                                                       const RemoteArgs& remote) {
  if (server.empty() == socket.empty()) return absl::InvalidArgumentError("give either --server or --socket");
  if (!socket.empty()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto store, client::ConnectSharedMemoryStore(socket));
    return std::unique_ptr<client::Store>(std::move(store));
  }
  client::RemoteOptions options;
  options.tls_ca_file = remote.tls_ca;
  options.tls_cert_file = remote.tls_cert;
  options.tls_key_file = remote.tls_key;
  options.token = remote.token;
  if (options.token.empty()) {
    if (const char* env = std::getenv("WEIGHTSTORE_TOKEN")) options.token = env;
  }
  return client::ConnectRemoteStore(server, options);
}

absl::Status RunInspect(const InspectArgs& args, std::FILE* out) {
  InspectView view;
  if (!args.server.empty() || !args.socket.empty()) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(client::Query query, QueryFor(args.selection));
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto store, Connect(args.server, args.socket, args.remote));
    WEIGHTSTORE_ASSIGN_OR_RETURN(client::CheckpointSummary summary, store->GetCheckpoint(args.path));
    WEIGHTSTORE_ASSIGN_OR_RETURN(client::TensorListing listing, store->ListTensors(args.path, query));
    view = InspectView{absl::StrCat(args.server.empty() ? args.socket : args.server, "/", summary.name),
                       summary.format,
                       summary.container,
                       summary.metadata,
                       summary.quantization,
                       summary.tensor_count,
                       std::move(listing.tensors),
                       std::move(listing.apply_result)};
  } else {
    WEIGHTSTORE_ASSIGN_OR_RETURN(Loaded loaded, LoadForCli(args.path, args.selection));
    const Checkpoint& c = *loaded.checkpoint;
    view = InspectView{c.path(),
                       std::string(c.format().name),
                       c.detail(),
                       c.metadata(),
                       c.quantization() == nullptr ? "" : c.quantization()->Describe(),
                       c.size(),
                       {},
                       {}};
    for (const SnapshotTensor& t : loaded.snapshot->tensors()) {
      view.tensors.push_back(client::Describe(t));
    }
    if (loaded.applied) view.apply_result = loaded.applied->result;
  }
  PrintInspect(view, args.json, out);
  return absl::OkStatus();
}

absl::Status RunHealth(const HealthArgs& args, std::FILE* out) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                               wire::ChannelCredentialsFromPem(args.remote.tls_ca));
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(args.server, credentials));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(args.timeout_seconds * 1000)));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(args.service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&ctx, request, &response);
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat(args.server, ": ", status.error_message()));
  }
  const std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  std::fprintf(out, "%s\n", name.c_str());
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(args.server, " is ", name));
  }
  return absl::OkStatus();
}

absl::Status RunLs(const LsArgs& args, std::FILE* out) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto store, Connect(args.server, args.socket, args.remote));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<client::CheckpointSummary> list, store->ListCheckpoints());
  if (args.json) {
    nlohmann::ordered_json doc = nlohmann::json::array();
    for (const auto& c : list) {
      doc.push_back({{"name", c.name},
                     {"format", c.format},
                     {"tensors", c.tensor_count},
                     {"bytes", c.total_bytes},
                     {"version", c.version},
                     {"path", c.path}});
      if (c.follow.has_value()) {
        doc.back()["follow"] = {{"upstream", c.follow->upstream},
                                {"upstream_version", c.follow->upstream_version},
                                {"lag_versions", c.follow->lag_versions},
                                {"lag_seconds", c.follow->lag_seconds},
                                {"upstream_connected", c.follow->upstream_connected},
                                {"blocked", c.follow->blocked}};
      }
    }
    std::fprintf(out, "%s\n", doc.dump(1).c_str());
    return absl::OkStatus();
  }
  size_t width = 4;
  bool following = false;
  for (const auto& c : list) {
    width = std::max(width, c.name.size());
    following = following || c.follow.has_value();
  }
  std::fprintf(out, "%-*s  %-11s  %8s  %12s  %-32s%s\n", static_cast<int>(width), "NAME", "FORMAT", "TENSORS", "SIZE",
               "VERSION", following ? "  UPSTREAM" : "");
  for (const auto& c : list) {
    std::string upstream;
    if (c.follow.has_value()) {
      const auto& f = *c.follow;
      // Where it stands first, then the origin: "current", "2 behind (13 s, at v...)".
      upstream = !f.blocked.empty()    ? absl::StrCat("blocked (", f.blocked, ")")
                 : f.lag_versions == 0 ? std::string("current")
                                       : absl::StrFormat("%d behind (%.0f s; upstream at %s)", f.lag_versions,
                                                         f.lag_seconds, f.upstream_version);
      if (!f.upstream_connected) upstream += ", disconnected";
      absl::StrAppend(&upstream, "  ", f.upstream);
    }
    std::fprintf(out, "%-*s  %-11s  %8llu  %12s  %-32s%s%s\n", static_cast<int>(width), c.name.c_str(),
                 c.format.c_str(), static_cast<unsigned long long>(c.tensor_count), HumanBytes(c.total_bytes).c_str(),
                 c.version.c_str(), upstream.empty() ? "" : "  ", upstream.c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<const FormatSpec*> OutputFormat(const std::string& flag, const std::string& output) {
  if (IndexFormatForPath(output) != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write '", output,
                                                   "': an index of shards is not written here; write one file (",
                                                   FormatExtensions(/*writable_only=*/true), ")"));
  }
  const FormatSpec* f = flag.empty() ? FormatForPath(output) : FindFormat(flag);
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot tell the output format from '", output, "'; end it with ",
                                                   FormatExtensions(/*writable_only=*/true), ", or pass --format"));
  }
  if (!f->writable()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write '", output, "': ", f->name,
                                                   " files are read-only here; write ",
                                                   FormatExtensions(/*writable_only=*/true)));
  }
  if (!CanWrite(*f, output)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write '", output, "': ", f->name, " files are written as ",
                                                   absl::StrJoin(f->write_extensions, ", "),
                                                   " only (compress one yourself: gzip -n)"));
  }
  return f;
}

absl::StatusOr<Metadata> ParseMetadataFlags(const std::vector<std::string>& flags) {
  Metadata extra;
  for (const std::string& kv : flags) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--metadata '", kv, "' is not KEY=VALUE"));
    }
    extra[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return extra;
}

absl::Status RunFetch(const FetchArgs& args, std::FILE* out) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(const FormatSpec* format, OutputFormat(args.format, args.output));
  WEIGHTSTORE_ASSIGN_OR_RETURN(Metadata extra, ParseMetadataFlags(args.metadata));
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::Query query, QueryFor(args.selection));
  query.since_version = args.since;
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto store, Connect(args.server, args.socket, args.remote));
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::CheckpointSummary summary, store->GetCheckpoint(args.name));
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::TensorListing listing, store->ListTensors(args.name, query));
  query.version = listing.version;  // the file holds what was listed
  Metadata metadata = summary.metadata;
  for (auto& [k, v] : extra) metadata[k] = v;
  const bool delta = listing.delta.has_value() && listing.delta->delta;
  if (!args.since.empty()) {
    metadata["weightstore.version"] = listing.version;
    if (delta) metadata["weightstore.since_version"] = args.since;
    if (delta) {
      std::fprintf(out, "delta of '%s' from %s to %s: %llu changed tensors, %llu unchanged left out\n",
                   args.name.c_str(), args.since.c_str(), listing.version.c_str(),
                   static_cast<unsigned long long>(listing.delta->changed_tensors),
                   static_cast<unsigned long long>(listing.delta->unchanged_tensors));
    } else {
      std::fprintf(out, "full fetch of '%s' at %s: %s\n", args.name.c_str(), listing.version.c_str(),
                   listing.delta ? listing.delta->full_reason.c_str() : "this store does not tell what changed");
    }
  }
  std::vector<TensorSpec> specs;
  uint64_t total = 0;
  for (const auto& t : listing.tensors) {
    if (delta && t.unchanged) continue;
    specs.push_back(t.spec);
    total += t.spec.byte_size();
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto sink,
                               client::FileSink::Create(args.output, *format, specs, metadata, args.overwrite));
  ProgressBar bar(args.progress && ::isatty(STDERR_FILENO) && total >= kProgressThreshold);
  sink->set_progress([&bar](uint64_t done, uint64_t all) { bar.Update(done, all); });
  WEIGHTSTORE_RETURN_IF_ERROR(store->FetchTensors(args.name, query, sink.get()));
  return sink->Finish();
}

absl::Status RunWatch(const WatchArgs& args, std::FILE* out) {
  if (!args.name.empty() && !args.prefix.empty()) return absl::InvalidArgumentError("give NAME or --prefix, not both");
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto store, Connect(args.server, "", args.remote));
  int seen = 0;
  return store->Watch({.name = args.name, .prefix = args.prefix}, [&](const client::CheckpointEvent& e) {
    static constexpr const char* kKinds[] = {"added", "replaced", "removed", "synced"};
    const char* kind = kKinds[static_cast<int>(e.kind)];
    if (args.json) {
      nlohmann::ordered_json doc = {{"event", kind}};
      if (!e.name.empty()) doc["name"] = e.name;
      if (!e.old_version.empty()) doc["old_version"] = e.old_version;
      if (!e.new_version.empty()) doc["new_version"] = e.new_version;
      if (e.kind == client::CheckpointEvent::Kind::kReplaced) {
        doc["delta"] = e.delta;
        if (!e.delta) doc["full_reason"] = e.full_reason;
        doc["changed"] = e.changed;
        doc["added"] = e.added;
        doc["removed"] = e.removed;
        doc["unchanged_count"] = e.unchanged_count;
        if (e.names_omitted) doc["names_omitted"] = true;
      }
      std::fprintf(out, "%s\n", doc.dump().c_str());
    } else if (e.kind == client::CheckpointEvent::Kind::kSynced) {
      std::fprintf(out, "synced\n");
    } else if (e.kind == client::CheckpointEvent::Kind::kReplaced && e.delta) {
      std::fprintf(out, "replaced %s %s -> %s: %llu changed, %llu added, %llu removed, %llu unchanged\n",
                   e.name.c_str(), e.old_version.c_str(), e.new_version.c_str(),
                   static_cast<unsigned long long>(e.changed_count), static_cast<unsigned long long>(e.added_count),
                   static_cast<unsigned long long>(e.removed_count),
                   static_cast<unsigned long long>(e.unchanged_count));
    } else {
      std::fprintf(out, "%s %s %s%s%s%s\n", kind, e.name.c_str(), e.old_version.c_str(),
                   e.old_version.empty() || e.new_version.empty() ? "" : " -> ", e.new_version.c_str(),
                   e.full_reason.empty() ? "" : absl::StrCat(" (full: ", e.full_reason, ")").c_str());
    }
    std::fflush(out);
    return args.count == 0 || ++seen < args.count;
  });
}

absl::Status RunPush(const PushArgs& args, std::FILE* out) {
  OpenOptions open;
  open.record_layout = args.record_layout;
  // Every tensor of a file, as views of its mapping where it has one.
  auto read_all = [&](const std::string& path) -> absl::StatusOr<std::vector<SharedTensor>> {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> c, Checkpoint::Open(path, open));
    std::vector<SharedTensor> tensors;
    for (const CheckpointEntry& entry : c->entries()) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor t, c->Read(entry));
      tensors.push_back(std::move(t));
    }
    return tensors;
  };
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<SharedTensor> next, read_all(args.file));
  WEIGHTSTORE_ASSIGN_OR_RETURN(auto store, Connect(args.server, "", args.remote));
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::TensorListing served, store->ListTensors(args.name, {}));
  if (!args.only_changed) {
    for (auto& t : served.tensors) t.digest.clear();  // every tensor goes
  }
  // The local copy of the served version, for element patches.
  std::vector<SharedTensor> base;
  if (!args.base_file.empty() && args.only_changed) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(base, read_all(args.base_file));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::PushPlan plan, client::PlanPush(served, next, base));
  if (args.only_changed && !plan.digests) {
    std::fprintf(out, "the daemon computes no tensor digests: pushing every tensor\n");
  }
  const client::PushRequest& request = plan.request;
  WEIGHTSTORE_ASSIGN_OR_RETURN(client::CheckpointSummary pushed, store->Push(args.name, request));
  absl::flat_hash_set<std::string> in_file;
  for (const SharedTensor& t : next) in_file.insert(t.spec.name);
  size_t removed = 0;  // not counting the redefined
  for (const std::string& r : request.remove) removed += in_file.contains(r) ? 0 : 1;
  std::fprintf(out, "pushed %zu of %zu tensors (%s)", request.tensors.size() + request.patched.size(), next.size(),
               HumanBytes(plan.whole_bytes + plan.patch_bytes).c_str());
  if (!request.patched.empty()) {
    std::fprintf(out, ", %zu as element patches (%s)", request.patched.size(), HumanBytes(plan.patch_bytes).c_str());
  }
  std::fprintf(out, ", removed %zu: '%s' is now version %s (was %s)\n", removed, args.name.c_str(),
               pushed.version.c_str(), served.version.c_str());
  return absl::OkStatus();
}

absl::Status RunApply(const ApplyArgs& args, std::FILE* out) {
  if (args.selection.target.empty()) return absl::InvalidArgumentError("apply needs --target SCHEMA.json");
  WEIGHTSTORE_ASSIGN_OR_RETURN(Loaded loaded, LoadForCli(args.path, args.selection));
  const ApplyResult& r = loaded.applied->result;
  if (args.json) {
    nlohmann::ordered_json doc;
    doc["applied"] = r.applied;
    doc["skipped"] = r.skipped;
    doc["missing"] = r.missing;
    doc["unused"] = r.unused;
    doc["errors"] = nlohmann::json::array();
    for (const ApplyError& e : r.errors) {
      doc["errors"].push_back(
          {{"path", e.path},
           {"kind", e.kind == ApplyError::Kind::kShapeMismatch ? "shape_mismatch" : "dtype_mismatch"},
           {"message", e.message}});
    }
    doc["suggestions"] = r.suggestions;
    doc["ok"] = loaded.applied->status.ok();
    std::fprintf(out, "%s\n", doc.dump(1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::fprintf(out, "%s", r.Summary().c_str());
  }
  return loaded.applied->status;
}

absl::Status RunConvert(const ConvertArgs& args, std::FILE* out) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(const FormatSpec* format, OutputFormat(args.format, args.output));
  WEIGHTSTORE_ASSIGN_OR_RETURN(Metadata extra, ParseMetadataFlags(args.metadata));
  WEIGHTSTORE_ASSIGN_OR_RETURN(Loaded loaded, LoadForCli(args.input, args.selection));
  if (loaded.applied && !loaded.applied->status.ok()) {
    std::fprintf(stderr, "%s", loaded.applied->result.Summary().c_str());
    return loaded.applied->status;
  }
  Metadata metadata = loaded.checkpoint->metadata();
  for (auto& [k, v] : extra) metadata[k] = v;

  ProgressBar bar(args.progress && ::isatty(STDERR_FILENO) && loaded.snapshot->total_bytes() >= kProgressThreshold);
  WriteOptions options;
  options.overwrite = args.overwrite;
  options.progress = [&bar](uint64_t done, uint64_t total) { bar.Update(done, total); };
  if (!args.record_template.empty()) {
    if (!args.metadata.empty()) {
      return absl::InvalidArgumentError(
          "--metadata and --record-template: the template's metadata is written as it is");
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(options.plan, RecordTemplatePlan(*format, args.record_template));
  }
  return WriteSnapshot(*loaded.snapshot, args.output, *format, metadata, options);
}

absl::Status RunDiff(const DiffArgs& args, std::FILE* out) {
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> a, Checkpoint::Open(args.a));
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::shared_ptr<const Checkpoint> b, Checkpoint::Open(args.b));
  std::vector<std::string> only_a, only_b, dtype_diff, shape_diff, byte_diff;
  size_t same = 0;
  for (const CheckpointEntry& ea : a->entries()) {
    const CheckpointEntry* eb = b->Find(ea.spec.name);
    if (eb == nullptr) {
      only_a.push_back(ea.spec.name);
    } else if (ea.spec.dtype != eb->spec.dtype) {
      dtype_diff.push_back(
          absl::StrCat(ea.spec.name, " (", DTypeName(ea.spec.dtype), " vs ", DTypeName(eb->spec.dtype), ")"));
    } else if (ea.spec.shape != eb->spec.shape) {
      shape_diff.push_back(
          absl::StrCat(ea.spec.name, " (", ShapeToString(ea.spec.shape), " vs ", ShapeToString(eb->spec.shape), ")"));
    } else {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor ta, a->Read(ea));
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedTensor tb, b->Read(*eb));
      if (ta.bytes.view() != tb.bytes.view()) {
        byte_diff.push_back(ea.spec.name);
      } else {
        ++same;
      }
    }
  }
  for (const CheckpointEntry& eb : b->entries()) {
    if (a->Find(eb.spec.name) == nullptr) only_b.push_back(eb.spec.name);
  }
  auto section = [&](const char* title, const std::vector<std::string>& names) {
    if (names.empty()) return;
    std::fprintf(out, "%s (%zu):\n", title, names.size());
    for (const std::string& n : names) std::fprintf(out, "  %s\n", n.c_str());
  };
  section(absl::StrCat("only in ", args.a).c_str(), only_a);
  section(absl::StrCat("only in ", args.b).c_str(), only_b);
  section("dtype differs", dtype_diff);
  section("shape differs", shape_diff);
  section("bytes differ", byte_diff);
  const size_t differences = only_a.size() + only_b.size() + dtype_diff.size() + shape_diff.size() + byte_diff.size();
  std::fprintf(out, "%zu identical, %zu different\n", same, differences);
  if (differences > 0 && args.exit_code) return absl::FailedPreconditionError("checkpoints differ");
  return absl::OkStatus();
}

}  // namespace weightstore::cli
