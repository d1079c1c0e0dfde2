// Hugging Face hub caches: the folders huggingface_hub writes
// (models--ORG--NAME/{blobs,snapshots,refs}) seen as served checkpoints named
// by repo id.
//
// A repo folder serves:
//   ORG/NAME          the snapshot refs/main names;
//   ORG/NAME@REF      every other ref (a branch or tag, "refs/pr/1");
//   ORG/NAME@COMMIT   every snapshot present, by its folder name.
// In a snapshot the weights transformers loads are the checkpoint itself
// (model.safetensors.index.json, else model.safetensors, else
// pytorch_model.bin); any other checkpoint file in it is served below that
// name ("ORG/NAME/original/consolidated"). Files that are not weights
// (config.json, tokenizers) are not checkpoints. Snapshot files are symlinks
// into blobs/: they are followed only when they resolve inside the repo
// folder. What cannot be served (a dangling link, a link out of the repo, a
// ref to a missing snapshot) is one error line naming the path, and the rest
// of the repo is served all the same.
#ifndef WEIGHTSTORE_CORE_CATALOG_HUB_CACHE_H_
#define WEIGHTSTORE_CORE_CATALOG_HUB_CACHE_H_

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace weightstore {

struct HubCheckpoint {
  std::string name;  // "ORG/NAME", "ORG/NAME@v1.0", ...
  std::string path;  // the snapshot's file (a symlink into blobs/), or its index
};

struct HubRepoScan {
  std::vector<HubCheckpoint> checkpoints;
  // What was not served: "path: reason".
  std::vector<std::string> errors;
};

// Bounds on what one repo folder may make the scan do.
struct HubCacheLimits {
  size_t max_refs = 1024;       // ref files read
  size_t max_snapshots = 1024;  // snapshot folders looked at
  size_t max_files_per_snapshot = 4096;
  size_t max_depth = 8;  // folders below a snapshot (and below refs/)
};

// The kind of hub repo `dir` is, from its folder name and contents: "models",
// "datasets" or "spaces" for a folder named KIND--... that holds snapshots/;
// nullopt for any other folder (scanned as usual).
std::optional<std::string> HubRepoKind(const std::string& dir);

// The repo id a repo folder stands for ("models--acme--tiny-llm" ->
// "acme/tiny-llm", "models--gpt2" -> "gpt2"); nullopt for a name no repo has.
std::optional<std::string> HubRepoId(const std::string& folder_name);

// The checkpoints of the model repo folder `dir` (HubRepoKind "models").
HubRepoScan ScanHubRepo(const std::string& dir, const HubCacheLimits& limits = {});

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_CATALOG_HUB_CACHE_H_
