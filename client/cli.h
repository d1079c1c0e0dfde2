// The `weightstore` command line: subcommands over core (and, later, servers).
//
// Each Run* function prints its report to `out`, returns absl::OkStatus() on
// success, and an error whose message names the file, tensor or field on bad
// input. main() maps errors to exit status 1 and usage errors to 2.
#ifndef WEIGHTSTORE_CLIENT_CLI_H_
#define WEIGHTSTORE_CLIENT_CLI_H_

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace weightstore::cli {

// The selection flags shared by inspect, convert and apply.
struct SelectionArgs {
  std::string top_level_key;
  std::vector<std::string> include, paths, exclude;
  std::vector<std::string> renames;  // FROM=TO, in order
  bool contiguous_indices = false, no_contiguous_indices = false;
  std::string adapter;  // "", "pytorch-to-burn", "burn-to-pytorch"
  std::string dtype;    // "", "f16", "bf16", "f32", "f64"
  std::string target;   // target schema JSON
  bool allow_partial = false;
  std::string shard;                       // "R/N": rank R of N
  std::vector<std::string> shard_dims;     // REGEX=DIM[xK][:uneven]
  std::vector<std::string> shard_scales;   // REGEX=WEIGHT[:BLOCKxBLOCK...]
  std::vector<std::string> shard_experts;  // REGEX with the expert index as its first group
  bool no_scale_detection = false;
  std::vector<std::string> slices;  // NAME=[a:b, :]
  // How to read the file rather than what to select: a Burn bincode record's
  // layout (OpenOptions::record_layout).
  std::string record_layout;
};

// How to reach a remote weightstored (--server): TLS files and a bearer token
// (--token, or the WEIGHTSTORE_TOKEN environment variable).
struct RemoteArgs {
  std::string tls_ca, tls_cert, tls_key, token;
};

struct InspectArgs {
  std::string path;    // a file, or a checkpoint name with --server/--socket
  std::string server;  // host:port of weightstored
  std::string socket;  // weightstored's same-host socket
  RemoteArgs remote;
  bool json = false;
  SelectionArgs selection;
};

struct ApplyArgs {
  std::string path;
  bool json = false;
  SelectionArgs selection;
};

struct ConvertArgs {
  std::string input;
  std::string output;
  std::string format;  // "", "safetensors" or "burnpack"
  SelectionArgs selection;
  bool overwrite = false;
  std::vector<std::string> metadata;  // KEY=VALUE
  bool progress = true;               // shown only when stderr is a terminal
  std::string record_template;        // a Burn record laid out as OUT is to be
};

struct LsArgs {
  std::string server;
  std::string socket;
  RemoteArgs remote;
  bool json = false;
};

struct WatchArgs {
  std::string server;
  RemoteArgs remote;
  std::string name;    // one checkpoint; empty: every one under prefix
  std::string prefix;  // with no name
  bool json = false;   // one JSON object per line
  int count = 0;       // exit after this many events; 0: never
};

// Follows checkpoints as they change, printing one line per event.
absl::Status RunWatch(const WatchArgs& args, std::FILE* out);

struct FetchArgs {
  std::string server;
  std::string socket;
  RemoteArgs remote;
  std::string name;
  // Write only the tensors changed since this version (a delta); a version
  // the daemon keeps no digests of writes them all, and says so.
  std::string since;
  std::string output;
  std::string format;  // "", "safetensors" or "burnpack"
  bool overwrite = false;
  std::vector<std::string> metadata;  // KEY=VALUE
  bool progress = true;
  SelectionArgs selection;
};

struct PushArgs {
  std::string server;
  RemoteArgs remote;
  std::string name;           // the served checkpoint (the base)
  std::string file;           // the new version, a checkpoint file of any format
  bool only_changed = false;  // push only tensors whose digest, dtype or shape differ
  std::string record_layout;  // FILE is a Burn bincode record read with this layout
  // With only_changed: the served version as a file here (the trainer's last
  // push): a changed tensor whose bytes there are the served ones goes as an
  // element patch against them where that is smaller.
  std::string base_file;
};

// Publishes FILE as the next version of NAME: its tensors (with
// --only-changed, those that differ from the served version), the base's
// tensors FILE lacks removed, and new ones added.
absl::Status RunPush(const PushArgs& args, std::FILE* out);

struct DiffArgs {
  std::string a;
  std::string b;
  bool exit_code = false;  // return DiffersError() when they differ
};

absl::Status RunInspect(const InspectArgs& args, std::FILE* out);
absl::Status RunConvert(const ConvertArgs& args, std::FILE* out);
absl::Status RunLs(const LsArgs& args, std::FILE* out);

struct HealthArgs {
  std::string server;
  std::string service;  // "" for the whole server
  RemoteArgs remote;
  double timeout_seconds = 5;
};
// Asks grpc.health.v1.Health/Check; OK only when SERVING, Unavailable otherwise
// (for container health checks and scripts).
absl::Status RunHealth(const HealthArgs& args, std::FILE* out);
absl::Status RunFetch(const FetchArgs& args, std::FILE* out);
// Prints the load result; returns FailedPrecondition when it fails the load.
absl::Status RunApply(const ApplyArgs& args, std::FILE* out);
// Returns FailedPrecondition("differ") when args.exit_code is set and A != B.
absl::Status RunDiff(const DiffArgs& args, std::FILE* out);

// Formats a byte count for people: "512 B", "1.5 KiB", "2.00 GiB".
std::string HumanBytes(uint64_t bytes);

}  // namespace weightstore::cli

#endif  // WEIGHTSTORE_CLIENT_CLI_H_
