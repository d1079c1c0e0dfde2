// weightstore: inspect, convert and compare checkpoints.
//
// Exit status: 0 on success, 1 on bad input or failure (one message on stderr),
// 2 on a usage error.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "client/cli.h"
#include "client/store.h"
#include "core/format.h"

namespace {

using ::weightstore::FormatExtensions;
using ::weightstore::FormatNames;

// Names of the formats a file can be written in, for --format.
std::vector<std::string> WritableFormats() {
  std::vector<std::string> names;
  for (const weightstore::FormatSpec* f : weightstore::Formats()) {
    if (f->writable()) names.emplace_back(f->name);
  }
  return names;
}

// Adds the selection flags (shared by inspect, convert and apply) to `cmd`.
void AddRemoteFlags(CLI::App* cmd, weightstore::cli::RemoteArgs* args) {
  cmd->add_option("--tls-ca", args->tls_ca, "With --server: verify the server with this CA (PEM); enables TLS");
  cmd->add_option("--tls-cert", args->tls_cert, "With --server: client certificate for mutual TLS (PEM)");
  cmd->add_option("--tls-key", args->tls_key, "With --server: the client certificate's key (PEM)");
  cmd->add_option("--token", args->token, "With --server: bearer token (default: $WEIGHTSTORE_TOKEN)");
}

void AddSelectionFlags(CLI::App* cmd, weightstore::cli::SelectionArgs* s) {
  cmd->add_option("--record-layout", s->record_layout,
                  "Read a Burn bincode record (.bin, .bin.gz) with this layout: the target-schema JSON "
                  "({\"parameters\": [{\"path\", \"shape\"}]}, in the module's declaration order)");
  cmd->add_option("--top-level-key", s->top_level_key,
                  "PyTorch: read the state dict under this root key (e.g. model_state_dict)");
  cmd->add_option("--include", s->include, "Keep tensors whose name matches this regex (RE2, unanchored; repeatable)");
  cmd->add_option("--path", s->paths, "Keep the tensor with exactly this name (repeatable)");
  cmd->add_option("--exclude", s->exclude, "Drop tensors whose name matches this regex (repeatable)");
  cmd->add_option("--rename", s->renames,
                  "Rename with a regex: FROM=TO, replace-all, $1/${name} captures; repeatable, applied in order "
                  "before the filter");
  cmd->add_flag(
      "--contiguous-indices", s->contiguous_indices,
      "Renumber numeric path segments 0, 1, 2... per prefix (default when loading a PyTorch source into --target)");
  cmd->add_flag("--no-contiguous-indices", s->no_contiguous_indices, "Keep numeric path segments as they are");
  cmd->add_option("--adapter", s->adapter, "Adapt between frameworks (needs --target)")
      ->check(CLI::IsMember({"pytorch-to-burn", "burn-to-pytorch", "none"}));
  cmd->add_option("--dtype", s->dtype, "Cast floating-point tensors (round to nearest even)")
      ->check(CLI::IsMember({"f16", "bf16", "f32", "f64", "f8_e4m3", "f8_e5m2", "f8_e4m3fnuz", "f8_e5m2fnuz"}));
  cmd->add_option("--target", s->target,
                  "Target schema JSON ({\"parameters\": [{\"path\", \"shape\", \"dtype\", \"module\"}]}): "
                  "load into it and report applied/missing/unused");
  cmd->add_flag("--allow-partial", s->allow_partial, "With --target: missing tensors are not an error");
  cmd->add_option("--shard", s->shard,
                  "Tensor parallelism: serve rank R of N its shard of each tensor a --shard-dim rule matches (R/N)");
  cmd->add_option("--shard-dim", s->shard_dims,
                  "With --shard: REGEX=DIM shards the tensors the regex matches along DIM; REGEX=DIMxK when DIM "
                  "holds K fused parts (QKV: x3); ':uneven' allows torch.tensor_split sizes (repeatable)");
  cmd->add_option("--shard-scale", s->shard_scales,
                  "With --shard: REGEX=WEIGHT names scale tensors that follow their weight's shard (WEIGHT "
                  "replaces REGEX in the scale's name, as a rename); ':128x128' gives the block a scale element "
                  "covers per dimension (default: the weight's size over the scale's). Repeatable");
  cmd->add_flag("--no-scale-detection", s->no_scale_detection,
                "With --shard: follow only --shard-scale's scales, not the standard names (X.weight_scale_inv, "
                "X.weight_scale, X.scale of X.weight; X_scales of X_blocks)");
  cmd->add_option("--shard-experts", s->shard_experts,
                  "With --shard: expert parallelism; a REGEX whose first group is the expert index "
                  "('experts\\.(\\d+)\\.'): rank R of N gets its share of each group's experts (repeatable)");
  cmd->add_option("--slice", s->slices,
                  "Serve part of one tensor: NAME=[a:b, :] per dimension, by served name (repeatable)");
}

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

int Report(const absl::Status& status) {
  if (status.ok()) return 0;
  std::fprintf(stderr, "weightstore: %s\n", std::string(status.message()).c_str());
  return kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  namespace cli = weightstore::cli;
  weightstore::client::TuneAllocatorForStreaming();
  const std::string about = absl::StrCat("weightstore: inspect, convert and compare model checkpoints (", FormatNames(),
                                         ": ", FormatExtensions(), ")");
  CLI::App app{about};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");

  cli::InspectArgs inspect;
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "Show format, metadata and every tensor's name, dtype, shape and size, without reading tensor data");
  inspect_cmd
      ->add_option("FILE", inspect.path, "Checkpoint file, sharded index or folder; with --server, a checkpoint name")
      ->required();
  auto* inspect_server =
      inspect_cmd->add_option("--server", inspect.server, "Ask weightstored at host:port instead of reading a file");
  inspect_cmd->add_option("--socket", inspect.socket, "Ask weightstored through its same-host socket")
      ->excludes(inspect_server);
  AddRemoteFlags(inspect_cmd, &inspect.remote);
  inspect_cmd->add_flag("--json", inspect.json,
                        "Print JSON: {format, metadata, tensors: [{name, dtype, shape, bytes}]}");
  AddSelectionFlags(inspect_cmd, &inspect.selection);

  cli::ConvertArgs convert;
  CLI::App* convert_cmd = app.add_subcommand(
      "convert", absl::StrCat("Convert a checkpoint to a writable format (", FormatNames(/*writable_only=*/true),
                              "), atomically (OUT appears complete or not at all)"));
  convert_cmd->add_option("IN", convert.input, "Input checkpoint")->required();
  convert_cmd
      ->add_option(
          "OUT", convert.output,
          absl::StrCat("Output file; its extension (", FormatExtensions(/*writable_only=*/true), ") picks the format"))
      ->required();
  convert_cmd->add_option("--format", convert.format, "Output format, overriding OUT's extension")
      ->check(CLI::IsMember(WritableFormats()));
  AddSelectionFlags(convert_cmd, &convert.selection);
  convert_cmd->add_flag("--overwrite", convert.overwrite, "Replace OUT if it exists");
  convert_cmd->add_option("--metadata", convert.metadata, "Add or replace a metadata entry (KEY=VALUE, repeatable)");
  convert_cmd->add_flag("!--no-progress", convert.progress, "Never draw a progress bar");
  convert_cmd->add_option("--record-template", convert.record_template,
                          "Write a Burn record (.mpk) laid out as this one: a record your Burn application saved "
                          "from its model (Burn 0.14 or later). Its ParamIds, constants, metadata and encodings "
                          "are kept; only the tensors' bytes are replaced, matched by name, dtype and shape");

  cli::ApplyArgs apply;
  CLI::App* apply_cmd = app.add_subcommand(
      "apply",
      "Load a checkpoint into a target schema and print the result: applied, skipped, missing, unused, errors");
  apply_cmd->add_option("FILE", apply.path, "Checkpoint")->required();
  apply_cmd->add_flag("--json", apply.json, "Print the result as JSON");
  AddSelectionFlags(apply_cmd, &apply.selection);

  cli::LsArgs ls;
  CLI::App* ls_cmd = app.add_subcommand("ls", "List the checkpoints a weightstored serves");
  auto* ls_server = ls_cmd->add_option("--server", ls.server, "weightstored address, host:port");
  auto* ls_socket = ls_cmd->add_option("--socket", ls.socket, "weightstored's same-host socket");
  ls_server->excludes(ls_socket);
  ls_cmd->add_flag("--json", ls.json, "Print JSON");
  AddRemoteFlags(ls_cmd, &ls.remote);

  cli::HealthArgs health;
  CLI::App* health_cmd = app.add_subcommand(
      "health", "Ask a weightstored whether it is serving (grpc.health.v1); exit 0 only when SERVING");
  health_cmd->add_option("--server", health.server, "weightstored address (its --health-listen port, or the main one)")
      ->required();
  health_cmd->add_option("--service", health.service, "A service name (default: the whole server)");
  health_cmd->add_option("--timeout", health.timeout_seconds, "Seconds to wait")->capture_default_str();
  health_cmd->add_option("--tls-ca", health.remote.tls_ca, "Verify the server with this CA (PEM); enables TLS");

  cli::FetchArgs fetch;
  CLI::App* fetch_cmd = app.add_subcommand(
      "fetch", "Download a checkpoint (or a selection of it) from weightstored into a file, atomically");
  auto* fetch_server = fetch_cmd->add_option("--server", fetch.server, "weightstored address, host:port");
  fetch_cmd->add_option("--socket", fetch.socket, "weightstored's same-host socket: copies out of shared mappings")
      ->excludes(fetch_server);
  fetch_cmd->add_option("NAME", fetch.name, "Checkpoint name (see 'weightstore ls')")->required();
  fetch_cmd
      ->add_option(
          "OUT", fetch.output,
          absl::StrCat("Output file; its extension (", FormatExtensions(/*writable_only=*/true), ") picks the format"))
      ->required();
  fetch_cmd->add_option("--format", fetch.format, "Output format, overriding OUT's extension")
      ->check(CLI::IsMember(WritableFormats()));
  fetch_cmd->add_flag("--overwrite", fetch.overwrite, "Replace OUT if it exists");
  AddRemoteFlags(fetch_cmd, &fetch.remote);
  fetch_cmd->add_option("--metadata", fetch.metadata, "Add or replace a metadata entry (KEY=VALUE, repeatable)");
  fetch_cmd->add_flag("!--no-progress", fetch.progress, "Never draw a progress bar");
  AddSelectionFlags(fetch_cmd, &fetch.selection);
  fetch_cmd->add_option("--since", fetch.since,
                        "Write only the tensors changed since this version (from 'ls' or 'watch'); a version the "
                        "daemon keeps no digests of writes them all, and says so");

  cli::PushArgs push;
  CLI::App* push_cmd = app.add_subcommand(
      "push",
      "Publish FILE as the next version of the served checkpoint NAME (admin), written by the daemon "
      "atomically in NAME's format");
  push_cmd->add_option("--server", push.server, "weightstored address, host:port")->required();
  push_cmd->add_option("NAME", push.name, "The served checkpoint (see 'weightstore ls')")->required();
  push_cmd->add_option("FILE", push.file, "The new version: a checkpoint file of any format")->required();
  push_cmd->add_flag("--only-changed", push.only_changed,
                     "Send only the tensors whose bytes, dtype or shape differ from the served version (by digest)");
  push_cmd
      ->add_option("--base", push.base_file,
                   "With --only-changed: the served version as a local file (any format); a changed tensor whose "
                   "bytes there are the served ones is sent as its changed elements where that is smaller")
      ->needs("--only-changed");
  AddRemoteFlags(push_cmd, &push.remote);

  cli::WatchArgs watch;
  CLI::App* watch_cmd = app.add_subcommand(
      "watch", "Follow checkpoints as they are added, replaced (naming the tensors that changed) and removed");
  watch_cmd->add_option("--server", watch.server, "weightstored address, host:port")->required();
  watch_cmd->add_option("NAME", watch.name, "Watch this checkpoint only");
  watch_cmd->add_option("--prefix", watch.prefix, "Watch the checkpoints whose names start with this");
  watch_cmd->add_flag("--json", watch.json, "Print one JSON object per event and line");
  watch_cmd->add_option("--count", watch.count, "Exit after this many events (synced included)")
      ->check(CLI::NonNegativeNumber);
  AddRemoteFlags(watch_cmd, &watch.remote);

  cli::DiffArgs diff;
  CLI::App* diff_cmd = app.add_subcommand(
      "diff",
      "Compare two checkpoints of any formats: tensors only in one, and those whose dtype, shape or bytes differ");
  diff_cmd->add_option("A", diff.a, "First checkpoint")->required();
  diff_cmd->add_option("B", diff.b, "Second checkpoint")->required();
  diff_cmd->add_flag("--exit-code", diff.exit_code, "Exit with status 1 when they differ");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "weightstore: %s\nRun 'weightstore --help' for usage.\n", e.what());
    return kExitUsage;
  }
  if (*inspect_cmd) return Report(cli::RunInspect(inspect, stdout));
  if (*convert_cmd) return Report(cli::RunConvert(convert, stdout));
  if (*ls_cmd) return Report(cli::RunLs(ls, stdout));
  if (*health_cmd) return Report(cli::RunHealth(health, stdout));
  if (*fetch_cmd) return Report(cli::RunFetch(fetch, stdout));
  if (*watch_cmd) return Report(cli::RunWatch(watch, stdout));
  if (*push_cmd) return Report(cli::RunPush(push, stdout));
  if (*apply_cmd) {
    absl::Status status = cli::RunApply(apply, stdout);
    if (absl::IsFailedPrecondition(status)) {
      std::fprintf(stderr, "weightstore: %s\n", std::string(status.message()).c_str());
      return kExitFailure;
    }
    return Report(status);
  }
  if (*diff_cmd) {
    absl::Status status = cli::RunDiff(diff, stdout);
    if (absl::IsFailedPrecondition(status)) return kExitFailure;  // --exit-code: they differ
    return Report(status);
  }
  return kExitUsage;
}
