#include "core/select/selection.h"

#include <re2/re2.h>

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/select/dtype_cast.h"
#include "core/status_macros.h"

namespace weightstore {

absl::string_view AdapterName(Adapter adapter) {
  switch (adapter) {
    case Adapter::kNone:
      return "none";
    case Adapter::kPyTorchToBurn:
      return "pytorch-to-burn";
    case Adapter::kBurnToPyTorch:
      return "burn-to-pytorch";
  }
  return "none";
}

std::optional<Adapter> ParseAdapter(absl::string_view name) {
  for (Adapter a : {Adapter::kNone, Adapter::kPyTorchToBurn, Adapter::kBurnToPyTorch}) {
    if (name == AdapterName(a)) return a;
  }
  return std::nullopt;
}

namespace {

// Compiles one pattern with at most `max_mem` bytes of RE2 memory.
absl::StatusOr<std::unique_ptr<re2::RE2>> CompilePattern(const std::string& pattern, absl::string_view role,
                                                         int max_program_size, int64_t max_mem) {
  re2::RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(max_mem);
  auto re = std::make_unique<re2::RE2>(pattern, options);
  if (!re->ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bad ", role, " pattern '", pattern, "': ", re->error()));
  }
  if (re->ProgramSize() > max_program_size) {
    return absl::InvalidArgumentError(absl::StrCat(role, " pattern '", pattern, "' is too large (", re->ProgramSize(),
                                                   " instructions; the limit is ", max_program_size, ")"));
  }
  return re;
}

bool IsIdentChar(char c) {
  return c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

// Length of the UTF-8 character starting at s[i] (1 for invalid bytes).
size_t CharLength(absl::string_view s, size_t i) {
  const unsigned char c = s[i];
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size() - i);
}

}  // namespace

namespace {

// Writes the replaced text to `out`. Stops with kTooLong once `out` would pass
// `max_bytes`, so a hostile rule costs at most that much memory. Charges
// `deadline` (when given) the bytes each search may read, the rest of the text
// from where it starts, and stops with its status in `*spent` once it is spent:
// a rule that matches everywhere but grows nothing can cost a long name its
// length squared.
ReplaceOutcome ReplaceAllBounded(const re2::RE2& re, absl::string_view text, absl::string_view replacement,
                                 size_t max_bytes, std::string* out_text, const SelectionDeadline* deadline = nullptr,
                                 absl::Status* spent = nullptr) {
  std::string& out = *out_text;
  const int groups = re.NumberOfCapturingGroups();
  const re2::StringPiece input(text.data(), text.size());
  std::vector<re2::StringPiece> match(groups + 1);
  out.clear();
  size_t pos = 0, copied = 0;
  int64_t last_end = -1;
  bool matched = false;
  while (pos <= text.size()) {
    if (deadline != nullptr) {
      *spent = deadline->Check("renaming", text.size() - pos + 1);
      if (!spent->ok()) return ReplaceOutcome::kNoMatch;
    }
    if (!re.Match(input, pos, text.size(), re2::RE2::UNANCHORED, match.data(), groups + 1)) break;
    matched = true;
    const size_t begin = match[0].data() - text.data(), end = begin + match[0].size();
    if (begin == end && static_cast<int64_t>(begin) == last_end) {
      // An empty match right where the previous match ended is not reported.
      if (pos >= text.size()) break;
      pos += CharLength(text, pos);
      continue;
    }
    absl::StrAppend(&out, text.substr(copied, begin - copied));
    if (out.size() > max_bytes) return ReplaceOutcome::kTooLong;
    for (size_t i = 0; i < replacement.size(); ++i) {
      if (replacement[i] != '$' || i + 1 >= replacement.size()) {
        out.push_back(replacement[i]);
        continue;
      }
      if (replacement[i + 1] == '$') {
        out.push_back('$');
        ++i;
        continue;
      }
      std::string name;
      size_t next = i + 1;
      if (replacement[next] == '{') {
        size_t close = replacement.find('}', next);
        if (close == absl::string_view::npos) {
          out.push_back('$');
          continue;
        }
        name = std::string(replacement.substr(next + 1, close - next - 1));
        next = close + 1;
      } else {
        while (next < replacement.size() && IsIdentChar(replacement[next])) name.push_back(replacement[next++]);
        if (name.empty()) {
          out.push_back('$');
          continue;
        }
      }
      int index = -1;
      if (!absl::SimpleAtoi(name, &index)) {
        auto it = re.NamedCapturingGroups().find(name);
        index = it == re.NamedCapturingGroups().end() ? -1 : it->second;
      }
      if (index >= 0 && index <= groups && match[index].data() != nullptr)
        out.append(match[index].data(), match[index].size());
      i = next - 1;
      if (out.size() > max_bytes) return ReplaceOutcome::kTooLong;
    }
    if (out.size() > max_bytes) return ReplaceOutcome::kTooLong;
    copied = end;
    last_end = static_cast<int64_t>(end);
    if (end > pos) {
      pos = end;
    } else {
      if (pos >= text.size()) break;
      absl::StrAppend(&out, text.substr(copied, CharLength(text, pos)));
      pos += CharLength(text, pos);
      copied = pos;
    }
  }
  if (!matched) return ReplaceOutcome::kNoMatch;
  if (copied < text.size()) absl::StrAppend(&out, text.substr(copied));
  return out.size() > max_bytes ? ReplaceOutcome::kTooLong : ReplaceOutcome::kReplaced;
}

}  // namespace

std::string ReplaceAll(const re2::RE2& re, absl::string_view text, absl::string_view replacement) {
  std::string out;
  if (ReplaceAllBounded(re, text, replacement, std::numeric_limits<size_t>::max(), &out) == ReplaceOutcome::kNoMatch) {
    return std::string(text);
  }
  return out;
}

ReplaceOutcome ReplaceAllInPlace(const re2::RE2& re, std::string* text, absl::string_view replacement,
                                 size_t max_bytes) {
  std::string out;
  const ReplaceOutcome outcome = ReplaceAllBounded(re, *text, replacement, max_bytes, &out);
  if (outcome == ReplaceOutcome::kReplaced) *text = std::move(out);
  return outcome;
}

namespace {

// RE2 memory of one compiled object: an equal share of the selection's budget,
// at least the floor small patterns need (a program and a little DFA).
constexpr int64_t kMinRegexMemory = 64 << 10;
int64_t MemoryShare(const SelectionLimits& limits, size_t objects) {
  return limits.max_regex_memory / static_cast<int64_t>(std::max<size_t>(objects, 1));
}

// Joins already-validated patterns into "(?:p1)|(?:p2)|...".
absl::StatusOr<std::unique_ptr<re2::RE2>> CompileAny(const std::vector<std::string>& patterns, absl::string_view role,
                                                     const SelectionLimits& limits, int64_t max_mem) {
  if (patterns.empty()) return nullptr;
  std::string joined;
  for (const std::string& p : patterns) absl::StrAppend(&joined, joined.empty() ? "" : "|", "(?:", p, ")");
  const int64_t budget = std::min<int64_t>(limits.max_total_program_size, std::numeric_limits<int>::max());
  return CompilePattern(joined, role, static_cast<int>(budget), max_mem);
}

// Checks the sizes and counts a request controls before anything is compiled.
absl::Status CheckSizes(const SelectionOptions& options, const SelectionLimits& limits) {
  const size_t patterns = options.include.size() + options.exclude.size() + options.renames.size() +
                          options.shard.rules.size() + options.shard.scales.size() + options.shard.experts.size();
  if (patterns > limits.max_patterns) {
    return absl::InvalidArgumentError(
        absl::StrCat("the selection has ", patterns, " patterns; at most ", limits.max_patterns, " are allowed"));
  }
  if (options.slices.size() > limits.max_paths) {
    return absl::InvalidArgumentError(absl::StrCat("the selection has ", options.slices.size(),
                                                   " explicit slices; at most ", limits.max_paths, " are allowed"));
  }
  if (options.paths.size() > limits.max_paths) {
    return absl::InvalidArgumentError(absl::StrCat("the selection has ", options.paths.size(), " exact paths; at most ",
                                                   limits.max_paths, " are allowed"));
  }
  auto check = [&](absl::string_view role, size_t i, const std::string& value) -> absl::Status {
    if (value.size() <= limits.max_pattern_bytes) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(role, "[", i, "] is ", value.size(), " bytes; at most ",
                                                   limits.max_pattern_bytes, " are allowed"));
  };
  WEIGHTSTORE_RETURN_IF_ERROR(check("top_level_key", 0, options.top_level_key));
  for (size_t i = 0; i < options.include.size(); ++i)
    WEIGHTSTORE_RETURN_IF_ERROR(check("include", i, options.include[i]));
  for (size_t i = 0; i < options.exclude.size(); ++i)
    WEIGHTSTORE_RETURN_IF_ERROR(check("exclude", i, options.exclude[i]));
  for (size_t i = 0; i < options.paths.size(); ++i) WEIGHTSTORE_RETURN_IF_ERROR(check("paths", i, options.paths[i]));
  for (size_t i = 0; i < options.renames.size(); ++i) {
    WEIGHTSTORE_RETURN_IF_ERROR(check("renames.pattern", i, options.renames[i].pattern));
    WEIGHTSTORE_RETURN_IF_ERROR(check("renames.replacement", i, options.renames[i].replacement));
  }
  for (size_t i = 0; i < options.shard.rules.size(); ++i) {
    WEIGHTSTORE_RETURN_IF_ERROR(check("shard.rules.pattern", i, options.shard.rules[i].pattern));
  }
  for (size_t i = 0; i < options.shard.scales.size(); ++i) {
    WEIGHTSTORE_RETURN_IF_ERROR(check("shard.scales.pattern", i, options.shard.scales[i].pattern));
    WEIGHTSTORE_RETURN_IF_ERROR(check("shard.scales.weight", i, options.shard.scales[i].weight));
    const std::vector<uint64_t>& block = options.shard.scales[i].block;
    if (block.size() > kMaxRank || std::find(block.begin(), block.end(), 0) != block.end()) {
      return absl::InvalidArgumentError(absl::StrCat("shard.scales[", i, "] ('", options.shard.scales[i].pattern,
                                                     "'): a block needs 1 to ", kMaxRank, " sizes, each at least 1"));
    }
  }
  for (size_t i = 0; i < options.shard.experts.size(); ++i) {
    WEIGHTSTORE_RETURN_IF_ERROR(check("shard.experts", i, options.shard.experts[i]));
  }
  for (size_t i = 0; i < options.slices.size(); ++i) {
    WEIGHTSTORE_RETURN_IF_ERROR(check("slices.name", i, options.slices[i].name));
  }
  return absl::OkStatus();
}

// Checks the shard spec and the explicit slices, naming the field at fault.
absl::Status CheckShardAndSlices(const SelectionOptions& options, const SelectionLimits& limits) {
  const ShardSpec& shard = options.shard;
  if (shard.world_size == 0 && !shard.rules.empty()) {
    return absl::InvalidArgumentError("shard rules need a world size (shard.world_size)");
  }
  if (shard.world_size > limits.max_world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard.world_size ", shard.world_size, " exceeds the limit of ", limits.max_world_size));
  }
  if (shard.world_size > 0 && shard.rank >= shard.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("shard.rank ", shard.rank, " is out of range for world size ",
                                                   shard.world_size, " (ranks are 0 to ", shard.world_size - 1, ")"));
  }
  for (size_t i = 0; i < shard.rules.size(); ++i) {
    const ShardSplit& split = shard.rules[i].split;
    if (split.dim >= kMaxRank) {
      return absl::InvalidArgumentError(absl::StrCat("shard rule '", shard.rules[i].pattern, "': dimension ", split.dim,
                                                     " is past the largest rank (", kMaxRank, ")"));
    }
    if (split.parts > limits.max_fused_parts) {  // 0 is one part, as 1
      return absl::InvalidArgumentError(absl::StrCat("shard rule '", shard.rules[i].pattern, "': ", split.parts,
                                                     " fused parts; 1 to ", limits.max_fused_parts, " are allowed"));
    }
  }
  for (size_t i = 0; i < options.slices.size(); ++i) {
    const NamedSlice& slice = options.slices[i];
    if (slice.bounds.size() > kMaxRank) {
      return absl::InvalidArgumentError(absl::StrCat("the slice of '", slice.name, "' has ", slice.bounds.size(),
                                                     " dimensions; at most ", kMaxRank, " are allowed"));
    }
    for (size_t d = 0; d < slice.bounds.size(); ++d) {
      const SliceBound& b = slice.bounds[d];
      if (b.start && b.stop && *b.start > *b.stop) {
        return absl::InvalidArgumentError(absl::StrCat("the slice of '", slice.name, "' starts dimension ", d, " at ",
                                                       *b.start, ", past its stop ", *b.stop));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Selection>> Selection::Compile(const SelectionOptions& options,
                                                                    const SelectionLimits& limits) {
  WEIGHTSTORE_RETURN_IF_ERROR(CheckSizes(options, limits));
  WEIGHTSTORE_RETURN_IF_ERROR(CheckShardAndSlices(options, limits));
  if (options.dtype && !IsCastTarget(*options.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", DTypeName(*options.dtype), " is not one tensors cast to (", kCastTargets, ")"));
  }
  std::shared_ptr<Selection> selection(new Selection());
  selection->options_ = options;
  selection->limits_ = limits;
  selection->paths_.insert(options.paths.begin(), options.paths.end());
  for (size_t i = 0; i < options.slices.size(); ++i) {
    if (!selection->slices_.emplace(options.slices[i].name, i).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", options.slices[i].name, "' has two explicit slices"));
    }
  }
  // Kept objects: the include and exclude alternations and one per rename and
  // shard rule; the memory budget is shared among them.
  const int64_t share = MemoryShare(limits, 2 + options.renames.size() + options.shard.rules.size() +
                                                options.shard.scales.size() + options.shard.experts.size());
  if (share < kMinRegexMemory) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.renames.size(), " rename rules and ", options.shard.rules.size(),
                     " shard rules do not fit the regex memory budget of ", limits.max_regex_memory, " bytes"));
  }
  int64_t total_program = 0;
  auto spend = [&](const re2::RE2& re, absl::string_view role, const std::string& pattern) -> absl::Status {
    total_program += re.ProgramSize();
    if (total_program <= limits.max_total_program_size) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "the selection's patterns compile to more than ", limits.max_total_program_size,
        " RE2 instructions together (the request's regex budget), reached at ", role, " pattern '", pattern, "'"));
  };
  // Each pattern alone first, so an error names the pattern at fault.
  for (const auto& [role, list] :
       {std::pair<absl::string_view, const std::vector<std::string>*>{"include", &options.include},
        {"exclude", &options.exclude}}) {
    for (const std::string& p : *list) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(auto re, CompilePattern(p, role, limits.max_program_size, share));
      WEIGHTSTORE_RETURN_IF_ERROR(spend(*re, role, p));
    }
  }
  for (const RenameRule& rule : options.renames) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto re, CompilePattern(rule.pattern, "rename", limits.max_program_size, share));
    WEIGHTSTORE_RETURN_IF_ERROR(spend(*re, "rename", rule.pattern));
    selection->rename_.push_back(std::move(re));
  }
  for (const ShardRule& rule : options.shard.rules) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto re, CompilePattern(rule.pattern, "shard rule", limits.max_program_size, share));
    WEIGHTSTORE_RETURN_IF_ERROR(spend(*re, "shard rule", rule.pattern));
    selection->shard_rules_.push_back(std::move(re));
  }
  for (const ScaleRule& rule : options.shard.scales) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto re, CompilePattern(rule.pattern, "scale rule", limits.max_program_size, share));
    WEIGHTSTORE_RETURN_IF_ERROR(spend(*re, "scale rule", rule.pattern));
    selection->scale_rules_.push_back(std::move(re));
  }
  for (const std::string& pattern : options.shard.experts) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(auto re, CompilePattern(pattern, "expert", limits.max_program_size, share));
    WEIGHTSTORE_RETURN_IF_ERROR(spend(*re, "expert", pattern));
    if (re->NumberOfCapturingGroups() < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert pattern '", pattern, "' needs a capture group: the expert's index"));
    }
    selection->expert_rules_.push_back(std::move(re));
  }
  WEIGHTSTORE_ASSIGN_OR_RETURN(selection->include_any_, CompileAny(options.include, "include", limits, share));
  WEIGHTSTORE_ASSIGN_OR_RETURN(selection->exclude_any_, CompileAny(options.exclude, "exclude", limits, share));
  return std::shared_ptr<const Selection>(std::move(selection));
}

Selection::~Selection() = default;

absl::Status SelectionDeadline::CheckSpent(absl::string_view what) const {
  if (work_ > max_work_) {
    return absl::ResourceExhaustedError(absl::StrCat("the selection's patterns scanned more than ", max_work_,
                                                     " bytes of names (", what, "); simplify its patterns"));
  }
  if (cancelled_ && cancelled_()) return absl::CancelledError(absl::StrCat("the selection was cancelled (", what, ")"));
  if (std::chrono::steady_clock::now() < end_) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("the selection took more than ", budget_.count(), " ms (", what, "); simplify its patterns"));
}

absl::StatusOr<std::string> Selection::Rename(absl::string_view name, const SelectionDeadline* deadline) const {
  std::string current(name);
  absl::Status spent;
  std::string out;
  for (size_t i = 0; i < rename_.size(); ++i) {
    const ReplaceOutcome outcome = ReplaceAllBounded(*rename_[i], current, options_.renames[i].replacement,
                                                     limits_.max_name_bytes, &out, deadline, &spent);
    WEIGHTSTORE_RETURN_IF_ERROR(spent);
    if (outcome == ReplaceOutcome::kReplaced) std::swap(current, out);
    if (outcome == ReplaceOutcome::kTooLong) {
      return absl::InvalidArgumentError(absl::StrCat("rename rule ", i, " ('", options_.renames[i].pattern,
                                                     "') grows tensor '", name, "' past ", limits_.max_name_bytes,
                                                     " bytes"));
    }
  }
  return current;
}

bool Selection::Matches(absl::string_view name) const {
  const re2::StringPiece piece(name.data(), name.size());
  bool keep = include_any_ == nullptr && options_.paths.empty();
  if (!keep && include_any_ != nullptr) keep = re2::RE2::PartialMatch(piece, *include_any_);
  if (!keep) keep = paths_.contains(name);
  if (!keep) return false;
  return exclude_any_ == nullptr || !re2::RE2::PartialMatch(piece, *exclude_any_);
}

absl::StatusOr<bool> Selection::Matches(absl::string_view name, const SelectionDeadline& deadline) const {
  // Each of the two alternations may scan the whole name.
  const uint64_t scans = (include_any_ != nullptr) + (exclude_any_ != nullptr);
  if (scans > 0) WEIGHTSTORE_RETURN_IF_ERROR(deadline.Check("filtering", scans * (name.size() + 1)));
  return Matches(name);
}

absl::StatusOr<TensorSlice> Selection::SliceOf(absl::string_view name, std::span<const uint64_t> shape,
                                               const SelectionDeadline* deadline) const {
  const ShardSpec& shard = options_.shard;
  // The first rule that matches, and any other that disagrees with it.
  const ShardRule* rule = nullptr;
  const re2::StringPiece piece(name.data(), name.size());
  for (size_t i = 0; i < shard_rules_.size(); ++i) {
    if (deadline != nullptr) WEIGHTSTORE_RETURN_IF_ERROR(deadline->Check("matching shard rules", name.size() + 1));
    if (!re2::RE2::PartialMatch(piece, *shard_rules_[i])) continue;
    const ShardRule& match = shard.rules[i];
    if (rule == nullptr) {
      rule = &match;
    } else if (!(rule->split == match.split)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' matches shard rules '", rule->pattern, "=",
                                                     ShardSplitToString(rule->split), "' and '", match.pattern, "=",
                                                     ShardSplitToString(match.split), "', which disagree"));
    }
  }
  if (auto it = slices_.find(name); it != slices_.end()) {
    if (rule != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name,
                                                     "' has an explicit slice and matches shard rule '", rule->pattern,
                                                     "'; give it one or the other"));
    }
    return ExplicitSlice(shape, options_.slices[it->second].bounds, name);
  }
  if (rule == nullptr) return TensorSlice{};
  return ShardSlice(shape, rule->split, shard.rank, shard.world_size, name);
}

absl::StatusOr<std::optional<Selection::ScaleOf>> Selection::ScaleRuleOf(absl::string_view name,
                                                                         const SelectionDeadline& deadline) const {
  for (size_t i = 0; i < scale_rules_.size(); ++i) {
    std::string weight;
    absl::Status spent;
    const ReplaceOutcome outcome = ReplaceAllBounded(*scale_rules_[i], name, options_.shard.scales[i].weight,
                                                     limits_.max_name_bytes, &weight, &deadline, &spent);
    WEIGHTSTORE_RETURN_IF_ERROR(spent);
    if (outcome == ReplaceOutcome::kTooLong) {
      return absl::InvalidArgumentError(absl::StrCat("scale rule '", options_.shard.scales[i].pattern,
                                                     "' grows tensor '", name, "' past ", limits_.max_name_bytes,
                                                     " bytes"));
    }
    if (outcome == ReplaceOutcome::kReplaced) return ScaleOf{std::move(weight), &options_.shard.scales[i]};
  }
  return std::nullopt;
}

absl::StatusOr<std::optional<Selection::ExpertOf>> Selection::ExpertOfName(absl::string_view name,
                                                                           const SelectionDeadline& deadline) const {
  const re2::StringPiece piece(name.data(), name.size());
  for (size_t i = 0; i < expert_rules_.size(); ++i) {
    WEIGHTSTORE_RETURN_IF_ERROR(deadline.Check("matching experts", name.size() + 1));
    re2::StringPiece index;
    if (!re2::RE2::PartialMatch(piece, *expert_rules_[i], &index)) continue;
    uint64_t value = 0;
    if (index.empty() || !absl::SimpleAtoi(absl::string_view(index.data(), index.size()), &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "' matches expert pattern '", options_.shard.experts[i], "', whose capture '",
                       absl::string_view(index.data(), index.size()), "' is not an expert index"));
    }
    const size_t at = static_cast<size_t>(index.data() - name.data());
    return ExpertOf{value, absl::StrCat(i, ":", name.substr(0, at), "#", name.substr(at + index.size()))};
  }
  return std::nullopt;
}

absl::Status Selection::CheckSlicesUsed(const std::function<bool(absl::string_view)>& served) const {
  for (const NamedSlice& slice : options_.slices) {
    if (!served(slice.name)) {
      return absl::NotFoundError(
          absl::StrCat("the selection has a slice of '", slice.name, "', but serves no tensor of that name"));
    }
  }
  return absl::OkStatus();
}

bool Selection::UsesContiguousIndices(const FormatSpec& format, bool applying_to_target) const {
  return options_.contiguous_indices.value_or(applying_to_target && format.contiguous_indices_when_applying);
}

namespace {

// burn-store parses a segment as usize: optional '+', then decimal digits.
std::optional<uint64_t> ParseIndex(absl::string_view segment) {
  if (segment.empty()) return std::nullopt;
  absl::string_view digits = segment.front() == '+' ? segment.substr(1) : segment;
  if (digits.empty()) return std::nullopt;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  uint64_t value;
  if (!absl::SimpleAtoi(digits, &value)) return std::nullopt;
  return value;
}

}  // namespace

std::vector<std::string> MapIndicesContiguous(const std::vector<std::string>& names) {
  std::vector<std::vector<absl::string_view>> split;
  split.reserve(names.size());
  size_t segments = 0;
  for (const std::string& name : names) {
    split.push_back(absl::StrSplit(name, '.'));
    segments += split.back().size();
  }
  // A prefix is a node of a trie over path segments (0 is the empty prefix), so
  // the work is linear in the names' bytes however many segments they have.
  absl::flat_hash_map<std::pair<uint32_t, absl::string_view>, uint32_t> child;
  child.reserve(segments);
  // Every numeric segment: its position (the prefix node before it), its value,
  // and where it occurs (name, segment).
  struct Occurrence {
    uint32_t position;
    uint64_t index;
    uint32_t name, segment;
  };
  std::vector<Occurrence> numeric;
  for (uint32_t n = 0; n < split.size(); ++n) {
    uint32_t node = 0;
    for (uint32_t k = 0; k < split[n].size(); ++k) {
      const absl::string_view segment = split[n][k];
      if (auto index = ParseIndex(segment)) numeric.push_back({node, *index, n, k});
      node = child.try_emplace({node, segment}, static_cast<uint32_t>(child.size() + 1)).first->second;
    }
  }
  // Sorted by position then value, an occurrence's new index is the count of
  // distinct values before it at its position.
  std::sort(numeric.begin(), numeric.end(), [](const Occurrence& a, const Occurrence& b) {
    return std::tie(a.position, a.index) < std::tie(b.position, b.index);
  });
  std::vector<std::vector<uint64_t>> renumbered(split.size());
  for (size_t n = 0; n < split.size(); ++n) renumbered[n].assign(split[n].size(), UINT64_MAX);
  uint64_t rank = 0;
  for (size_t i = 0; i < numeric.size(); ++i) {
    if (i > 0 && numeric[i].position != numeric[i - 1].position) {
      rank = 0;
    } else if (i > 0 && numeric[i].index != numeric[i - 1].index) {
      ++rank;
    }
    renumbered[numeric[i].name][numeric[i].segment] = rank;
  }
  std::vector<std::string> out;
  out.reserve(names.size());
  for (size_t n = 0; n < split.size(); ++n) {
    std::string renamed;
    for (size_t k = 0; k < split[n].size(); ++k) {
      if (k > 0) renamed.push_back('.');
      if (renumbered[n][k] != UINT64_MAX) {
        absl::StrAppend(&renamed, renumbered[n][k]);
      } else {
        absl::StrAppend(&renamed, split[n][k]);
      }
    }
    out.push_back(std::move(renamed));
  }
  return out;
}

}  // namespace weightstore
