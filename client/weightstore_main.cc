// weightstore: inspect, convert and compare checkpoints.
//
// Exit status: 0 on success, 1 on bad input or failure (one message on stderr),
// 2 on a usage error.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "client/cli.h"

namespace {

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
  CLI::App app{"weightstore: inspect, convert and compare model checkpoints "
               "(SafeTensors, PyTorch .pt/.pth, Burnpack .bpk)"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");

  cli::InspectArgs inspect;
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "Show format, metadata and every tensor's name, dtype, shape and size, without reading tensor data");
  inspect_cmd->add_option("FILE", inspect.path, "Checkpoint file, sharded index, or folder")->required();
  inspect_cmd->add_flag("--json", inspect.json, "Print JSON: {format, metadata, tensors: [{name, dtype, shape, bytes}]}");
  inspect_cmd->add_option("--top-level-key", inspect.top_level_key,
                          "PyTorch: read the state dict under this root key (e.g. model_state_dict)");

  cli::ConvertArgs convert;
  CLI::App* convert_cmd = app.add_subcommand(
      "convert", "Convert a checkpoint to SafeTensors or Burnpack, atomically (OUT appears complete or not at all)");
  convert_cmd->add_option("IN", convert.input, "Input checkpoint")->required();
  convert_cmd->add_option("OUT", convert.output, "Output file; its extension (.safetensors, .bpk) picks the format")
      ->required();
  convert_cmd->add_option("--format", convert.format, "Output format, overriding OUT's extension")
      ->check(CLI::IsMember({"safetensors", "burnpack"}));
  convert_cmd->add_option("--top-level-key", convert.top_level_key, "PyTorch: convert the state dict under this root key");
  convert_cmd->add_flag("--overwrite", convert.overwrite, "Replace OUT if it exists");
  convert_cmd->add_option("--metadata", convert.metadata, "Add or replace a metadata entry (KEY=VALUE, repeatable)");
  convert_cmd->add_flag("!--no-progress", convert.progress, "Never draw a progress bar");

  cli::DiffArgs diff;
  CLI::App* diff_cmd = app.add_subcommand(
      "diff", "Compare two checkpoints of any formats: tensors only in one, and those whose dtype, shape or bytes differ");
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
  if (*diff_cmd) {
    absl::Status status = cli::RunDiff(diff, stdout);
    if (absl::IsFailedPrecondition(status)) return kExitFailure;  // --exit-code: they differ
    return Report(status);
  }
  return kExitUsage;
}
