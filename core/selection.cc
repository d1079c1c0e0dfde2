#include "core/selection.h"

#include <re2/re2.h>

#include <algorithm>
#include <map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

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

absl::StatusOr<std::unique_ptr<re2::RE2>> CompilePattern(const std::string& pattern, absl::string_view role,
                                                         const SelectionLimits& limits) {
  re2::RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(limits.max_regex_memory);
  auto re = std::make_unique<re2::RE2>(pattern, options);
  if (!re->ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bad ", role, " pattern '", pattern, "': ", re->error()));
  }
  if (re->ProgramSize() > limits.max_program_size || re->ReverseProgramSize() > limits.max_program_size) {
    return absl::InvalidArgumentError(absl::StrCat(role, " pattern '", pattern, "' is too large (", re->ProgramSize(),
                                                   " instructions; the limit is ", limits.max_program_size, ")"));
  }
  return re;
}

bool IsIdentChar(char c) { return c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// Length of the UTF-8 character starting at s[i] (1 for invalid bytes).
size_t CharLength(absl::string_view s, size_t i) {
  const unsigned char c = s[i];
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size() - i);
}

}  // namespace

namespace {

// Returns nullopt when `re` does not match `text` at all.
std::optional<std::string> ReplaceAllIfMatched(const re2::RE2& re, absl::string_view text,
                                               absl::string_view replacement) {
  const int groups = re.NumberOfCapturingGroups();
  const re2::StringPiece input(text.data(), text.size());
  std::vector<re2::StringPiece> match(groups + 1);
  std::string out;
  size_t pos = 0, copied = 0;
  int64_t last_end = -1;
  bool matched = false;
  while (pos <= text.size()) {
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
      if (index >= 0 && index <= groups && match[index].data() != nullptr) out.append(match[index].data(), match[index].size());
      i = next - 1;
    }
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
  if (!matched) return std::nullopt;
  if (copied < text.size()) absl::StrAppend(&out, text.substr(copied));
  return out;
}

}  // namespace

std::string ReplaceAll(const re2::RE2& re, absl::string_view text, absl::string_view replacement) {
  std::optional<std::string> out = ReplaceAllIfMatched(re, text, replacement);
  return out ? *std::move(out) : std::string(text);
}

bool ReplaceAllInPlace(const re2::RE2& re, std::string* text, absl::string_view replacement) {
  std::optional<std::string> out = ReplaceAllIfMatched(re, *text, replacement);
  if (!out) return false;
  *text = *std::move(out);
  return true;
}

namespace {

// Joins already-validated patterns into "(?:p1)|(?:p2)|...".
absl::StatusOr<std::unique_ptr<re2::RE2>> CompileAny(const std::vector<std::string>& patterns, absl::string_view role,
                                                     const SelectionLimits& limits) {
  if (patterns.empty()) return nullptr;
  std::string joined;
  for (const std::string& p : patterns) absl::StrAppend(&joined, joined.empty() ? "" : "|", "(?:", p, ")");
  SelectionLimits combined = limits;
  combined.max_program_size = limits.max_program_size * static_cast<int>(patterns.size());
  combined.max_regex_memory = limits.max_regex_memory * static_cast<int64_t>(patterns.size());
  return CompilePattern(joined, role, combined);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Selection>> Selection::Compile(const SelectionOptions& options,
                                                                    const SelectionLimits& limits) {
  if (options.include.size() + options.exclude.size() + options.renames.size() > limits.max_patterns) {
    return absl::InvalidArgumentError(absl::StrCat("more than ", limits.max_patterns, " patterns"));
  }
  if (options.dtype && !IsFloatingPoint(*options.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("dtype ", DTypeName(*options.dtype),
                                                   " is not a floating-point type (f16, bf16, f32, f64)"));
  }
  if (options.dtype && (*options.dtype == DType::kF8E4M3 || *options.dtype == DType::kF8E5M2)) {
    return absl::InvalidArgumentError("casting to F8 types is not supported");
  }
  std::shared_ptr<Selection> selection(new Selection());
  selection->options_ = options;
  // Each pattern alone first, so an error names the pattern at fault.
  for (const std::string& p : options.include) {
    if (auto re = CompilePattern(p, "include", limits); !re.ok()) return re.status();
  }
  for (const std::string& p : options.exclude) {
    if (auto re = CompilePattern(p, "exclude", limits); !re.ok()) return re.status();
  }
  auto include = CompileAny(options.include, "include", limits);
  if (!include.ok()) return include.status();
  selection->include_any_ = *std::move(include);
  auto exclude = CompileAny(options.exclude, "exclude", limits);
  if (!exclude.ok()) return exclude.status();
  selection->exclude_any_ = *std::move(exclude);
  for (const RenameRule& rule : options.renames) {
    auto re = CompilePattern(rule.pattern, "rename", limits);
    if (!re.ok()) return re.status();
    selection->rename_.push_back(*std::move(re));
  }
  return std::shared_ptr<const Selection>(std::move(selection));
}

Selection::~Selection() = default;

std::string Selection::Rename(absl::string_view name) const {
  std::string current(name);
  for (size_t i = 0; i < rename_.size(); ++i) ReplaceAllInPlace(*rename_[i], &current, options_.renames[i].replacement);
  return current;
}

bool Selection::Matches(absl::string_view name) const {
  const re2::StringPiece piece(name.data(), name.size());
  bool keep = include_any_ == nullptr && options_.paths.empty();
  if (!keep && include_any_ != nullptr) keep = re2::RE2::PartialMatch(piece, *include_any_);
  for (size_t i = 0; !keep && i < options_.paths.size(); ++i) keep = options_.paths[i] == name;
  if (!keep) return false;
  return exclude_any_ == nullptr || !re2::RE2::PartialMatch(piece, *exclude_any_);
}

bool Selection::UsesContiguousIndices(Format format, bool applying_to_target) const {
  return options_.contiguous_indices.value_or(applying_to_target && format == Format::kPyTorch);
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
  // Position key (original prefix with trailing dot) -> sorted distinct indices.
  absl::flat_hash_map<std::string, std::vector<uint64_t>> seen;
  std::vector<std::vector<absl::string_view>> split;
  split.reserve(names.size());
  for (const std::string& name : names) {
    split.push_back(absl::StrSplit(name, '.'));
    std::string prefix;
    for (absl::string_view segment : split.back()) {
      if (auto index = ParseIndex(segment)) seen[prefix].push_back(*index);
      absl::StrAppend(&prefix, segment, ".");
    }
  }
  for (auto& [prefix, indices] : seen) {
    std::sort(indices.begin(), indices.end());
    indices.erase(std::unique(indices.begin(), indices.end()), indices.end());
  }
  std::vector<std::string> out;
  out.reserve(names.size());
  for (const auto& segments : split) {
    std::string prefix, renamed;
    for (size_t i = 0; i < segments.size(); ++i) {
      absl::string_view segment = segments[i];
      if (i > 0) renamed.push_back('.');
      if (auto index = ParseIndex(segment)) {
        const std::vector<uint64_t>& indices = seen[prefix];
        absl::StrAppend(&renamed, std::lower_bound(indices.begin(), indices.end(), *index) - indices.begin());
      } else {
        absl::StrAppend(&renamed, segment);
      }
      absl::StrAppend(&prefix, segment, ".");
    }
    out.push_back(std::move(renamed));
  }
  return out;
}

}  // namespace weightstore
