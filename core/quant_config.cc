#include "core/quant_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "re2/re2.h"

namespace weightstore {

// A wildcard of the config (a glob, or an RE2 with a "re:" prefix), compiled.
struct QuantizationConfig::Pattern {
  std::string spelling;
  std::unique_ptr<RE2> regex;
  std::optional<QuantScheme> scheme;  // nullopt: excluded
};

namespace {

using Json = nlohmann::json;
constexpr int kMaxJsonDepth = 32;

std::string ListOf(const std::vector<uint64_t>& block) { return absl::StrJoin(block, "x"); }

// True when no bracket of `text` outside its strings opens deeper than
// `max_depth`; a text that is not JSON may pass (the parser refuses it).
bool NestedWithin(absl::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

// Reads the fields of one JSON object, naming `path` in every error.
class Fields {
 public:
  Fields(absl::string_view file, const Json& object, std::string path)
      : file_(file), object_(object), path_(std::move(path)) {}

  absl::Status Bad(absl::string_view key, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("quantization config '", file_, "': ", Path(key), " ", what));
  }
  std::string Path(absl::string_view key) const { return path_.empty() ? std::string(key) : StrPath(key); }
  const Json* Get(absl::string_view key) const {
    auto it = object_.find(std::string(key));
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  absl::StatusOr<std::optional<std::string>> String(absl::string_view key) const {
    const Json* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) return Bad(key, "must be a string");
    return v->get<std::string>();
  }
  absl::StatusOr<std::optional<uint64_t>> Count(absl::string_view key) const {
    const Json* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_unsigned() || v->get<uint64_t>() == 0 || v->get<uint64_t>() > QuantizationConfig::kMaxBlock) {
      return Bad(key, absl::StrCat("must be a whole number from 1 to ", QuantizationConfig::kMaxBlock));
    }
    return v->get<uint64_t>();
  }
  absl::StatusOr<std::vector<std::string>> Strings(absl::string_view key) const {
    std::vector<std::string> out;
    const Json* v = Get(key);
    if (v == nullptr) return out;
    if (!v->is_array()) return Bad(key, "must be a list of strings");
    if (v->size() > QuantizationConfig::kMaxPatterns) {
      return Bad(key, absl::StrCat("lists ", v->size(), " entries; at most ", QuantizationConfig::kMaxPatterns));
    }
    for (const Json& s : *v) {
      if (!s.is_string()) return Bad(key, "must be a list of strings");
      out.push_back(s.get<std::string>());
    }
    return out;
  }
  // A list of two block sizes ("weight_block_size": [128, 128]).
  absl::StatusOr<std::vector<uint64_t>> Block(absl::string_view key) const {
    const Json* v = Get(key);
    if (v == nullptr) return std::vector<uint64_t>{};
    if (!v->is_array() || v->size() != 2) return Bad(key, "must be a list of two block sizes");
    std::vector<uint64_t> block;
    for (const Json& b : *v) {
      if (!b.is_number_unsigned() || b.get<uint64_t>() == 0 || b.get<uint64_t>() > QuantizationConfig::kMaxBlock) {
        return Bad(key, absl::StrCat("must be a list of two whole numbers from 1 to ", QuantizationConfig::kMaxBlock));
      }
      block.push_back(b.get<uint64_t>());
    }
    return block;
  }
  absl::StatusOr<const Json*> Object(absl::string_view key) const {
    const Json* v = Get(key);
    if (v != nullptr && !v->is_object()) return Bad(key, "must be an object");
    return v;
  }
  Fields Nested(const Json& object, absl::string_view key) const { return Fields(file_, object, StrPath(key)); }

 private:
  std::string StrPath(absl::string_view key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", key);
  }
  absl::string_view file_;
  const Json& object_;
  std::string path_;
};

// ModelOpt's quant_algo ("NVFP4", "MXFP4", "FP8", "INT4_AWQ", ...) and
// group_size, as a scheme. An algorithm whose layout is not known here keeps
// its name and no block: the scale's shape decides, as without a config.
QuantScheme ModelOptScheme(absl::string_view algo, std::optional<uint64_t> group) {
  QuantScheme s;
  s.algo = absl::AsciiStrToUpper(algo);
  if (absl::StrContains(s.algo, "NVFP4")) {
    s.value_bits = 4;
    s.block = {1, group.value_or(16)};
  } else if (absl::StrContains(s.algo, "MXFP4")) {
    s.value_bits = 4;
    s.block = {1, group.value_or(32)};
  } else if (absl::StrContains(s.algo, "MXFP8")) {
    s.value_bits = 8;
    s.block = {1, group.value_or(32)};
  } else if (absl::StartsWith(s.algo, "FP8")) {
    s.value_bits = 8;  // per tensor or channel; FP8_PB_WO's 4-D scales are not a weight's blocks
  } else if (absl::StrContains(s.algo, "INT4") || absl::StartsWith(s.algo, "W4A")) {
    s.value_bits = 4;
    s.block = {1, group.value_or(128)};
  } else if (absl::StrContains(s.algo, "INT8") || absl::StartsWith(s.algo, "W8A")) {
    s.value_bits = 8;
  }
  return s;
}

}  // namespace

QuantizationConfig::QuantizationConfig() = default;
QuantizationConfig::~QuantizationConfig() = default;

std::string DescribeQuantScheme(const QuantScheme& scheme) {
  std::string out = scheme.algo.empty() ? "unnamed" : scheme.algo;
  if (scheme.value_bits != 0) absl::StrAppend(&out, ", ", scheme.value_bits, "-bit values");
  if (!scheme.block.empty()) absl::StrAppend(&out, ", blocks of ", ListOf(scheme.block));
  return out;
}

absl::Status QuantizationConfig::AddPattern(std::string spelling, std::optional<QuantScheme> scheme,
                                            absl::string_view field) {
  if (exact_.size() + patterns_.size() >= kMaxPatterns) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantization config '", source_, "': ", field, ": more than ", kMaxPatterns, " module patterns"));
  }
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("quantization config '", source_, "': ", field, ": pattern '",
                                                   absl::string_view(spelling).substr(0, 200),
                                                   spelling.size() > 200 ? "...' " : "' ", what));
  };
  if (spelling.size() > kMaxNameBytes) {
    return bad(absl::StrCat("is ", spelling.size(), " bytes; at most ", kMaxNameBytes));
  }
  const bool regex = absl::StartsWith(spelling, "re:");
  if (!regex && spelling.find_first_of("*?") == std::string::npos) {
    const size_t parts = static_cast<size_t>(std::count(spelling.begin(), spelling.end(), '.')) + 1;
    if (parts > kMaxNameParts) return bad(absl::StrCat("has ", parts, " dotted parts; at most ", kMaxNameParts));
    max_exact_parts_ = std::max(max_exact_parts_, parts);
    exact_.emplace(std::move(spelling), std::move(scheme));  // the first spelling of a name wins
    return absl::OkStatus();
  }
  if (patterns_.size() >= kMaxWildcards) {
    return absl::InvalidArgumentError(absl::StrCat("quantization config '", source_, "': ", field, ": more than ",
                                                   kMaxWildcards, " wildcard patterns"));
  }
  // Both become RE2s (linear time): a glob matches the whole name of the
  // module or of one it is under ('*' any run, '?' one character:
  // "model.layers.*.self_attn" covers "...self_attn.q_proj"); a "re:" pattern
  // matches from the name's start, as compressed-tensors' re.match does.
  RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(1 << 20);
  std::string re;
  if (regex) {
    // The body must be a whole expression on its own ("zzz)|(.*" is not).
    const RE2 body(absl::string_view(spelling).substr(3).data(), options);
    if (!body.ok()) return bad(absl::StrCat("is not a valid regular expression: ", body.error()));
    re = absl::StrCat("^(?:", absl::string_view(spelling).substr(3), ")");
  } else {
    re = "^";
    for (char c : spelling) {
      if (c == '*') {
        re += ".*";
      } else if (c == '?') {
        re += ".";
      } else {
        re += RE2::QuoteMeta(re2::StringPiece(&c, 1));
      }
    }
    re += "(?:\\..*)?$";
  }
  Pattern p;
  p.regex = std::make_unique<RE2>(re, options);
  if (!p.regex->ok()) return bad(absl::StrCat("is not a valid regular expression: ", p.regex->error()));
  // A small program runs on RE2's DFA, linear in the name; a large one (a
  // counted repetition) could fall back on the slow NFA for every module.
  if (p.regex->ProgramSize() > kMaxProgramSize) {
    return bad(absl::StrCat("compiles to ", p.regex->ProgramSize(), " RE2 instructions; at most ", kMaxProgramSize));
  }
  p.spelling = std::move(spelling);
  p.scheme = std::move(scheme);
  patterns_.push_back(std::move(p));
  return absl::OkStatus();
}

bool QuantizationConfig::Matches(const Pattern& p, absl::string_view module) {
  return RE2::PartialMatch(re2::StringPiece(module.data(), module.size()), *p.regex);
}

const QuantScheme* QuantizationConfig::SchemeOf(absl::string_view name) const {
  const size_t dot = name.rfind('.');
  const absl::string_view module = dot == absl::string_view::npos ? name : name.substr(0, dot);
  if (!exact_.empty()) {
    // A plain name covers the module of that name and the modules under it
    // (a prefix of whole dotted parts), and the same path under another root
    // ("lm_head" covers "model.lm_head": a suffix of whole parts). Only runs
    // of at most max_exact_parts_ parts and kMaxNameBytes bytes can match, so
    // at most 2 * kMaxNameParts lookups of kMaxNameBytes each.
    auto find = [&](absl::string_view run) -> std::optional<const QuantScheme*> {
      if (run.size() > kMaxNameBytes) return std::nullopt;
      auto it = exact_.find(run);
      if (it == exact_.end()) return std::nullopt;
      return it->second ? &*it->second : nullptr;
    };
    size_t end = module.size();  // prefixes, longest first
    std::vector<size_t> dots;
    for (size_t i = 0; i < module.size() && dots.size() < max_exact_parts_; ++i) {
      if (module[i] == '.') dots.push_back(i);
    }
    if (auto hit = find(module)) return *hit;
    for (auto it = dots.rbegin(); it != dots.rend(); ++it) {
      if (auto hit = find(module.substr(0, *it))) return *hit;
    }
    size_t parts = 1;  // suffixes, shortest first
    for (end = module.size(); end > 0 && parts <= max_exact_parts_; ++parts) {
      const size_t at = module.rfind('.', end - 1);
      if (at == absl::string_view::npos) break;
      if (auto hit = find(module.substr(at + 1))) return *hit;
      end = at;
    }
  }
  if (module.size() <= kMaxWildcardNameBytes) {
    for (const Pattern& p : patterns_) {
      if (Matches(p, module)) return p.scheme ? &*p.scheme : nullptr;
    }
  }
  return &scheme_;
}

std::string QuantizationConfig::Describe() const {
  std::string out = absl::StrCat(DescribeQuantScheme(scheme_), " (", source_);
  size_t own = 0, excluded = 0;
  for (const Pattern& p : patterns_) (p.scheme ? own : excluded)++;
  for (const auto& [name, scheme] : exact_) (scheme ? own : excluded)++;
  if (own > 0) absl::StrAppend(&out, "; ", own, own == 1 ? " layer" : " layers", " their own");
  if (excluded > 0) absl::StrAppend(&out, "; ", excluded, excluded == 1 ? " module" : " modules", " excluded");
  return absl::StrCat(out, ")");
}

absl::StatusOr<std::optional<std::shared_ptr<const QuantizationConfig>>> QuantizationConfig::Parse(
    absl::string_view file_name, absl::string_view text) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("quantization config '", file_name, "': ", what));
  };
  if (text.size() > kMaxFileBytes) {
    return bad(absl::StrCat(text.size(), " bytes; at most ", kMaxFileBytes, " are read"));
  }
  // The depth is checked by a scan of brackets outside strings, before the
  // parser builds anything (nlohmann's parse callback costs quadratic time
  // on long arrays of objects).
  if (!NestedWithin(text, kMaxJsonDepth)) return bad(absl::StrCat("JSON nested deeper than ", kMaxJsonDepth));
  const Json root = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return bad("not valid JSON");
  if (!root.is_object()) return bad("not a JSON object");

  std::shared_ptr<QuantizationConfig> config(new QuantizationConfig());
  config->source_ = std::string(file_name);
  const Fields top(file_name, root, "");

  // ModelOpt's fields, at "quantization" of hf_quant_config.json or in a
  // config.json's quantization_config with quant_method "modelopt".
  auto read_modelopt = [&](const Fields& q) -> absl::Status {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<std::string> algo, q.String("quant_algo"));
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<uint64_t> group, q.Count("group_size"));
    config->scheme_ = ModelOptScheme(algo.value_or(""), group);
    WEIGHTSTORE_ASSIGN_OR_RETURN(const Json* layers, q.Object("quantized_layers"));
    if (layers != nullptr) {
      if (layers->size() > kMaxPatterns) {
        return q.Bad("quantized_layers", absl::StrCat("lists ", layers->size(), " layers; at most ", kMaxPatterns));
      }
      for (const auto& [module, entry] : layers->items()) {
        if (!entry.is_object()) return q.Bad(absl::StrCat("quantized_layers.", module), "must be an object");
        const Fields layer = q.Nested(entry, absl::StrCat("quantized_layers.", module));
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<std::string> layer_algo, layer.String("quant_algo"));
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<uint64_t> layer_group, layer.Count("group_size"));
        WEIGHTSTORE_RETURN_IF_ERROR(config->AddPattern(module, ModelOptScheme(layer_algo.value_or(""), layer_group),
                                                       q.Path("quantized_layers")));
      }
    }
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<std::string> excluded, q.Strings("exclude_modules"));
    for (std::string& m : excluded) {
      WEIGHTSTORE_RETURN_IF_ERROR(config->AddPattern(m, std::nullopt, q.Path("exclude_modules")));
      config->excluded_.push_back(std::move(m));
    }
    return absl::OkStatus();
  };

  if (file_name == "hf_quant_config.json") {
    WEIGHTSTORE_ASSIGN_OR_RETURN(const Json* q, top.Object("quantization"));
    if (q == nullptr) return bad("no \"quantization\" object");
    config->method_ = "modelopt";
    WEIGHTSTORE_RETURN_IF_ERROR(read_modelopt(top.Nested(*q, "quantization")));
    return std::optional<std::shared_ptr<const QuantizationConfig>>(std::move(config));
  }

  WEIGHTSTORE_ASSIGN_OR_RETURN(const Json* qc, top.Object("quantization_config"));
  if (qc == nullptr) return std::optional<std::shared_ptr<const QuantizationConfig>>();
  const Fields q = top.Nested(*qc, "quantization_config");
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<std::string> method, q.String("quant_method"));
  config->method_ = absl::AsciiStrToLower(method.value_or(""));
  // Modules left in their float dtype, by each method's name for the list.
  for (absl::string_view key : {"modules_to_not_convert", "ignored_layers", "ignore"}) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<std::string> excluded, q.Strings(key));
    for (std::string& m : excluded) {
      WEIGHTSTORE_RETURN_IF_ERROR(config->AddPattern(m, std::nullopt, q.Path(key)));
      config->excluded_.push_back(std::move(m));
    }
  }
  if (config->method_ == "fp8") {  // transformers' FineGrainedFP8 (DeepSeek-V3, Qwen3 FP8)
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<uint64_t> block, q.Block("weight_block_size"));
    config->scheme_ = QuantScheme{block.empty() ? "FP8" : "FP8_BLOCK", 8, std::move(block)};
  } else if (config->method_ == "mxfp4") {  // gpt-oss
    config->scheme_ = QuantScheme{"MXFP4", 4, {1, 32}};
  } else if (config->method_ == "modelopt") {  // ModelOpt's fields, exclude_modules too
    WEIGHTSTORE_RETURN_IF_ERROR(read_modelopt(q));
  } else if (config->method_ == "compressed-tensors") {
    WEIGHTSTORE_ASSIGN_OR_RETURN(const Json* groups, q.Object("config_groups"));
    bool have_default = false;
    if (groups != nullptr) {
      if (groups->size() > kMaxPatterns) {
        return q.Bad("config_groups", absl::StrCat("lists ", groups->size(), " groups; at most ", kMaxPatterns));
      }
      for (const auto& [name, group] : groups->items()) {
        const std::string path = absl::StrCat("config_groups.", name);
        if (!group.is_object()) return q.Bad(path, "must be an object");
        const Fields g = q.Nested(group, path);
        WEIGHTSTORE_ASSIGN_OR_RETURN(const Json* weights, g.Object("weights"));
        if (weights == nullptr) continue;  // activations only
        const Fields w = g.Nested(*weights, "weights");
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<uint64_t> bits, w.Count("num_bits"));
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<std::string> type, w.String("type"));
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<std::string> strategy, w.String("strategy"));
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::optional<uint64_t> group_size, w.Count("group_size"));
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<uint64_t> block_structure, w.Block("block_structure"));
        if (bits && *bits > 64) return w.Bad("num_bits", "must be at most 64");
        QuantScheme s;
        s.value_bits = static_cast<uint32_t>(bits.value_or(0));
        const bool is_float = type.value_or("int") == "float";
        const std::string kind = is_float ? "FP" : "INT";
        s.algo = absl::StrCat(kind, s.value_bits);
        if ((strategy == "group" || strategy == "tensor_group") && group_size) {
          s.block = {1, *group_size};
          if (is_float && s.value_bits == 4) s.algo = *group_size == 16 ? "NVFP4" : "MXFP4";
        } else if (strategy == "block" && !block_structure.empty()) {
          s.block = block_structure;
          s.algo = absl::StrCat(s.algo, "_BLOCK");
        }
        WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<std::string> targets, g.Strings("targets"));
        for (std::string& t : targets) {
          if (absl::StartsWith(t, "re:") || absl::StrContains(t, ".")) {
            WEIGHTSTORE_RETURN_IF_ERROR(config->AddPattern(std::move(t), s, g.Path("targets")));
          } else if (!have_default) {  // a module class ("Linear"): every layer of it
            config->scheme_ = s;
            have_default = true;
          }
        }
      }
    }
    if (!have_default) config->scheme_.algo = "COMPRESSED-TENSORS";
  } else {
    // A method whose layout is not known here (gptq, awq, bitsandbytes, ...):
    // named, with no block; the scale shapes decide, as without a config.
    config->scheme_.algo = absl::AsciiStrToUpper(config->method_);
  }
  return std::optional<std::shared_ptr<const QuantizationConfig>>(std::move(config));
}

absl::StatusOr<std::optional<std::shared_ptr<const QuantizationConfig>>> QuantizationConfig::ReadBeside(
    const std::string& checkpoint_path) {
  std::error_code ec;
  const std::filesystem::path at(checkpoint_path);
  const std::filesystem::path folder = std::filesystem::is_directory(at, ec) ? at : at.parent_path();
  for (absl::string_view name : kFileNames) {
    const std::filesystem::path file = (folder.empty() ? std::filesystem::path(".") : folder) / std::string(name);
    if (!std::filesystem::is_regular_file(file, ec)) continue;
    const uintmax_t size = std::filesystem::file_size(file, ec);
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat("quantization config '", file.string(), "': ", ec.message()));
    }
    if (size > kMaxFileBytes) {
      return absl::InvalidArgumentError(absl::StrCat("quantization config '", file.string(), "': ", size,
                                                     " bytes; at most ", kMaxFileBytes, " are read"));
    }
    std::ifstream in(file, std::ios::binary);
    std::string text(size, '\0');
    if (!in.read(text.data(), static_cast<std::streamsize>(size))) {
      return absl::InvalidArgumentError(absl::StrCat("quantization config '", file.string(), "': cannot be read"));
    }
    absl::StatusOr<std::optional<std::shared_ptr<const QuantizationConfig>>> config = Parse(name, text);
    if (!config.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(config.status().message(), " (", file.string(), ")"));
    }
    if (config->has_value() || name == "config.json") return config;
  }
  return std::optional<std::shared_ptr<const QuantizationConfig>>();
}

}  // namespace weightstore
