// QuantizationConfig: what a checkpoint's quantization config says about how
// its weights are stored, read from the checkpoint's folder when it has one:
// `hf_quant_config.json` (NVIDIA ModelOpt) first, else the
// `quantization_config` of `config.json` (transformers: "fp8" with
// `weight_block_size`, "mxfp4", "modelopt", "compressed-tensors").
//
// Facts only, in the config's terms (values, not bytes); core/select turns a
// scheme's block into the elements a scale covers in a weight's stored dtype.
// Immutable after reading: thread-safe.
#ifndef WEIGHTSTORE_CORE_QUANT_CONFIG_H_
#define WEIGHTSTORE_CORE_QUANT_CONFIG_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace re2 {
class RE2;
}

namespace weightstore {

// How one layer's weights are quantized.
struct QuantScheme {
  // The config's name for it, upper case: "NVFP4", "MXFP4", "FP8", "MXFP8",
  // "FP8_BLOCK", "INT4", ...
  std::string algo;
  // Bits of one quantized value; 0: the config does not say. A weight stored
  // in a wider integer dtype packs several values per element, the first in
  // the low bits (two FP4 values per U8 byte).
  uint32_t value_bits = 0;
  // Values one scale element covers along the weight's last two dimensions
  // (rows, columns): {1, 16} for NVFP4, {128, 128} for DeepSeek's FP8 blocks.
  // Empty: the config names no block (per tensor or per channel).
  std::vector<uint64_t> block;

  friend bool operator==(const QuantScheme&, const QuantScheme&) = default;
};

// "NVFP4, 4-bit values, blocks of 1x16".
std::string DescribeQuantScheme(const QuantScheme& scheme);

class QuantizationConfig {
 public:
  // Bounds on what a config may hold; a file past them is refused.
  static constexpr uint64_t kMaxFileBytes = uint64_t{16} << 20;
  static constexpr size_t kMaxPatterns = 4096;  // module names and patterns in all
  static constexpr size_t kMaxWildcards = 16;   // of them globs and regexes (each tried per module)
  static constexpr size_t kMaxNameBytes = 256;  // one name or pattern
  static constexpr size_t kMaxNameParts = 16;   // dotted parts of a plain name
  static constexpr int kMaxProgramSize = 500;   // RE2 instructions of a wildcard
  // Longer module names are matched by plain names only (no real module's is).
  static constexpr size_t kMaxWildcardNameBytes = 1024;
  static constexpr uint64_t kMaxBlock = uint64_t{1} << 20;
  // The files ReadBeside reads from a checkpoint's folder, in the order it
  // tries them: what a node pulls beside a checkpoint kept apart.
  static constexpr std::array<absl::string_view, 2> kFileNames = {"hf_quant_config.json", "config.json"};

  // Reads the config of the checkpoint at `checkpoint_path` (a file, an index
  // or a folder): nullopt when its folder has neither file, or config.json has
  // no quantization_config. Returns InvalidArgument naming the file and the
  // field when the file is not JSON, a field has the wrong type, or a bound is
  // passed; NotFound never (an unreadable file is InvalidArgument too).
  static absl::StatusOr<std::optional<std::shared_ptr<const QuantizationConfig>>> ReadBeside(
      const std::string& checkpoint_path);
  // Parses `json`, the contents of `file_name` ("hf_quant_config.json" or
  // "config.json"); for tests and for configs that arrive by other means.
  static absl::StatusOr<std::optional<std::shared_ptr<const QuantizationConfig>>> Parse(absl::string_view file_name,
                                                                                        absl::string_view json);

  ~QuantizationConfig();

  // The file it came from, relative to the checkpoint's folder.
  const std::string& source() const { return source_; }
  // "modelopt", "fp8", "mxfp4", "compressed-tensors", ...
  const std::string& method() const { return method_; }
  // The scheme of layers the config does not name.
  const QuantScheme& scheme() const { return scheme_; }
  // Modules it leaves unquantized, as the config spells them.
  const std::vector<std::string>& excluded() const { return excluded_; }

  // The scheme of the module holding tensor `name` (its name without the last
  // dotted part: "model.layers.0.mlp.down_proj" of ".weight"), or nullptr when
  // the config leaves that module unquantized. A plain module name in the
  // config covers that module, the modules under it, and the same path under
  // another root ("lm_head" covers "model.lm_head"); a glob ('*', '?')
  // matches the whole name of the module or of one it is under; an RE2 ("re:"
  // prefix, compressed-tensors' spelling) matches from the start. Cost: at
  // most 2 * kMaxNameParts hash lookups of kMaxNameBytes, and one DFA match
  // per wildcard (at most kMaxWildcards) of a name up to
  // kMaxWildcardNameBytes. Checkpoint caches it per tensor at open.
  const QuantScheme* SchemeOf(absl::string_view name) const;

  // "NVFP4, 4-bit values, blocks of 1x16 (hf_quant_config.json; 3 layers
  // their own, 2 modules excluded)".
  std::string Describe() const;

 private:
  struct Pattern;
  QuantizationConfig();
  absl::Status AddPattern(std::string spelling, std::optional<QuantScheme> scheme, absl::string_view field);
  static bool Matches(const Pattern& pattern, absl::string_view module);

  std::string source_;
  std::string method_;
  QuantScheme scheme_;
  std::vector<std::string> excluded_;
  // Layers with their own scheme or none (excluded), by module name...
  absl::flat_hash_map<std::string, std::optional<QuantScheme>> exact_;
  size_t max_exact_parts_ = 0;  // the most dotted parts of a name in exact_
  // ...then by wildcard, in the config's order: the first that matches wins.
  std::vector<Pattern> patterns_;
};

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_QUANT_CONFIG_H_
