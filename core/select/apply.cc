#include "core/select/apply.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/mapped_file.h"
#include "core/select/dtype_cast.h"
#include "core/select/pipeline.h"
#include "core/select/quantized_shard.h"
#include "core/status_macros.h"

namespace weightstore {
namespace {

bool IsNorm(absl::string_view module) {
  static const char* const kNorms[] = {"BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
                                       "LayerNorm", "GroupNorm",   "RmsNorm",     "RMSNorm"};
  for (const char* n : kNorms) {
    if (module == n) return true;
  }
  return false;
}

absl::string_view LastSegment(absl::string_view path) {
  size_t dot = path.rfind('.');
  return dot == absl::string_view::npos ? path : path.substr(dot + 1);
}

// burn-store's get_alternative_param_name: norm layers name their scale and
// shift gamma/beta in Burn and weight/bias in PyTorch.
std::optional<std::string> AlternativeName(absl::string_view path, absl::string_view module, Adapter adapter) {
  if (adapter == Adapter::kNone || !IsNorm(module)) return std::nullopt;
  const absl::string_view last = LastSegment(path);
  const absl::string_view stem = path.substr(0, path.size() - last.size());
  static const std::pair<const char*, const char*> kPairs[] = {{"gamma", "weight"}, {"beta", "bias"}};
  for (auto [burn, torch] : kPairs) {
    if (adapter == Adapter::kPyTorchToBurn && last == burn) return absl::StrCat(stem, torch);
    if (adapter == Adapter::kBurnToPyTorch && last == torch) return absl::StrCat(stem, burn);
  }
  return std::nullopt;
}

void AddSuggestions(ApplyResult* result, const std::vector<TargetParameter>& params,
                    const absl::flat_hash_map<std::string, size_t>& by_path, const Selection& selection,
                    const std::vector<std::pair<std::string, std::vector<uint64_t>>>& transposable) {
  // A prefix to strip: unused "model.fc.weight" where "fc.weight" is missing.
  // Only the first few segments are tried, so long dotted names cost linear time.
  constexpr int kMaxPrefixSegments = 4;
  std::map<std::string, int> strip, add;
  absl::flat_hash_set<absl::string_view> missing(result->missing.begin(), result->missing.end());
  absl::flat_hash_set<absl::string_view> unused(result->unused.begin(), result->unused.end());
  auto count_prefix = [](const std::vector<std::string>& names, const absl::flat_hash_set<absl::string_view>& others,
                         std::map<std::string, int>* counts) {
    for (const std::string& n : names) {
      const absl::string_view name = n;
      int segments = 0;
      for (size_t dot = name.find('.'); dot != absl::string_view::npos && segments < kMaxPrefixSegments;
           dot = name.find('.', dot + 1), ++segments) {
        if (others.contains(name.substr(dot + 1))) {
          ++(*counts)[std::string(name.substr(0, dot))];
          break;
        }
      }
    }
  };
  count_prefix(result->unused, missing, &strip);
  count_prefix(result->missing, unused, &add);
  auto best = [](const std::map<std::string, int>& counts) {
    return std::max_element(counts.begin(), counts.end(),
                            [](const auto& a, const auto& b) { return a.second < b.second; });
  };
  auto escape = [](absl::string_view prefix) {
    std::string out;
    for (char c : prefix) {
      if (c == '.') out += "\\";
      out.push_back(c);
    }
    return out;
  };
  if (!strip.empty()) {
    auto it = best(strip);
    result->suggestions.push_back(absl::StrCat(it->second, " unused tensors start with '", it->first,
                                               ".'; try --rename '^", escape(it->first), "\\.='"));
  }
  if (!add.empty()) {
    auto it = best(add);
    result->suggestions.push_back(absl::StrCat(it->second, " missing tensors would be found under the prefix '",
                                               it->first, ".'; try --rename '^=", it->first, ".'"));
  }
  bool norm_hint = false;
  for (const std::string& m : result->missing) {
    auto p = by_path.find(m);
    if (p == by_path.end()) continue;
    const TargetParameter& param = params[p->second];
    if (selection.options().adapter == Adapter::kNone && IsNorm(param.module) &&
        (LastSegment(m) == "gamma" || LastSegment(m) == "beta" || LastSegment(m) == "weight" ||
         LastSegment(m) == "bias")) {
      norm_hint = true;
    }
  }
  if (norm_hint) {
    result->suggestions.push_back(
        "norm layers name their parameters gamma/beta in Burn and weight/bias in PyTorch; try --adapter "
        "pytorch-to-burn (or burn-to-pytorch)");
  }
  if (!transposable.empty()) {
    result->suggestions.push_back(absl::StrCat(transposable.size(), " Linear weights have transposed shapes (e.g. '",
                                               transposable.front().first,
                                               "'); try --adapter pytorch-to-burn (or burn-to-pytorch)"));
  }
}

// A target comes with the request: bound what it makes Apply do.
absl::Status CheckTarget(const TargetSchema& target, const SelectionLimits& limits) {
  if (target.parameters.size() > limits.max_paths) {
    return absl::InvalidArgumentError(absl::StrCat("the target has ", target.parameters.size(), " parameters; at most ",
                                                   limits.max_paths, " are allowed"));
  }
  uint64_t bytes = 0;
  for (size_t i = 0; i < target.parameters.size(); ++i) {
    const TargetParameter& p = target.parameters[i];
    if (p.path.size() > limits.max_name_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("target parameter ", i, " has a path of ", p.path.size(),
                                                     " bytes; at most ", limits.max_name_bytes, " are allowed"));
    }
    if (p.shape.size() > kMaxRank) {
      return absl::InvalidArgumentError(absl::StrCat("target parameter '", p.path, "' has rank ", p.shape.size(),
                                                     "; at most ", kMaxRank, " dimensions are allowed"));
    }
    bytes += p.path.size() + p.module.size();
    if (bytes > limits.max_total_name_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the target's paths exceed ", limits.max_total_name_bytes, " bytes together"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Applied> Apply(std::shared_ptr<const Checkpoint> checkpoint, const Selection& selection,
                              const TargetSchema& target, const ApplyOptions& options) {
  WEIGHTSTORE_RETURN_IF_ERROR(CheckTarget(target, selection.limits()));
  // Names after the top-level key, rename and contiguous indices, before the filter.
  const std::vector<CheckpointEntry>& entries = checkpoint->entries();
  const SelectionDeadline deadline(selection.limits());
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<NamedEntry> named,
                               ResolveNames(*checkpoint, selection, /*applying_to_target=*/true, deadline));
  absl::flat_hash_map<std::string, size_t> source;  // name -> entry index
  source.reserve(named.size());
  for (const NamedEntry& n : named) source.emplace(n.name, n.entry);
  const Adapter adapter = selection.options().adapter;
  Applied out;
  ApplyResult& result = out.result;
  std::vector<SnapshotTensor> tensors;
  std::vector<bool> used(entries.size(), false);
  absl::flat_hash_map<std::string, size_t> by_path;
  std::vector<std::pair<std::string, std::vector<uint64_t>>> transposable;
  std::vector<SnapshotTensor> candidates;  // kept by the filter, in target order...
  std::vector<size_t> candidate_params;    // ...and their target parameters
  for (size_t p = 0; p < target.parameters.size(); ++p) {
    const TargetParameter& param = target.parameters[p];
    WEIGHTSTORE_RETURN_IF_ERROR(deadline.Check("applying to the target", param.path.size() + 1));
    by_path.emplace(param.path, p);
    auto it = source.find(param.path);
    if (it == source.end()) {
      if (auto alt = AlternativeName(param.path, param.module, adapter)) it = source.find(*alt);
    }
    if (it == source.end()) {
      result.missing.push_back(param.path);
      continue;
    }
    used[it->second] = true;
    WEIGHTSTORE_ASSIGN_OR_RETURN(bool kept, selection.Matches(param.path, deadline));
    if (!kept) {
      result.skipped.push_back(param.path);
      continue;
    }
    const CheckpointEntry& entry = entries[it->second];
    SnapshotTensor& t = candidates.emplace_back(StartTensor(*checkpoint, entry, param.path));
    if (adapter != Adapter::kNone && param.module == "Linear" && LastSegment(param.path) == "weight" &&
        entry.spec.shape.size() == 2) {
      t.transpose = true;
      t.spec.shape = {entry.spec.shape[1], entry.spec.shape[0]};
    }
    candidate_params.push_back(p);
  }
  // A rank loads its own experts (another rank's are skipped, and are not
  // unused in the checkpoint), and its part of each tensor: the shard rules
  // cut the weights, and each scale follows its weight.
  size_t kept_params = 0;
  WEIGHTSTORE_RETURN_IF_ERROR(CutTensors(*checkpoint, selection, deadline, &candidates, [&](size_t i, bool dropped) {
    if (dropped) {
      result.skipped.push_back(candidates[i].spec.name);
    } else {
      candidate_params[kept_params++] = candidate_params[i];
    }
  }));
  candidate_params.resize(kept_params);
  WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<bool> other_ranks,
                               OtherRanksExperts(selection, deadline, named.size(),
                                                 [&](size_t i) -> absl::string_view { return named[i].name; }));
  for (size_t i = 0; i < candidates.size(); ++i) {
    SnapshotTensor& t = candidates[i];
    const TargetParameter& param = target.parameters[candidate_params[i]];
    if (t.spec.shape != param.shape) {
      result.errors.push_back({ApplyError::Kind::kShapeMismatch, param.path,
                               absl::StrCat("shape ", ShapeToString(t.spec.shape), " in the source, ",
                                            ShapeToString(param.shape), " in the target")});
      if (param.module == "Linear" && t.spec.shape.size() == 2 && !t.transpose &&
          std::vector<uint64_t>{t.spec.shape[1], t.spec.shape[0]} == param.shape) {
        transposable.emplace_back(param.path, param.shape);
      }
      continue;
    }
    // The target's dtype, when asked, replaces the selection's (whose cast
    // need not be possible then).
    absl::Status selected = CastToSelectionDType(selection, &t);
    if (options.cast_to_target && param.dtype && *param.dtype != t.spec.dtype) {
      absl::Status cast = CheckCast(t.source->spec.dtype, *param.dtype);
      if (!cast.ok()) {
        result.errors.push_back({ApplyError::Kind::kDTypeMismatch, param.path, std::string(cast.message())});
        continue;
      }
      t.spec.dtype = *param.dtype;
    } else {
      WEIGHTSTORE_RETURN_IF_ERROR(selected);
    }
    result.applied.push_back(param.path);
    tensors.push_back(std::move(t));
  }
  absl::flat_hash_set<std::string> skipped(result.skipped.begin(), result.skipped.end());
  for (size_t i = 0; i < named.size(); ++i) {
    const NamedEntry& n = named[i];
    if (!used[n.entry] && !skipped.contains(n.name) && !other_ranks[i]) result.unused.push_back(n.name);
  }
  std::sort(result.skipped.begin(), result.skipped.end());
  std::sort(result.missing.begin(), result.missing.end());
  std::sort(result.unused.begin(), result.unused.end());
  AddSuggestions(&result, target.parameters, by_path, selection, transposable);

  WEIGHTSTORE_ASSIGN_OR_RETURN(out.snapshot, Snapshot::Create(std::move(checkpoint), std::move(tensors)));
  WEIGHTSTORE_RETURN_IF_ERROR(selection.CheckSlicesUsed(
      [&](absl::string_view name) { return out.snapshot->Find(name) != nullptr || by_path.contains(name); }));
  if (options.validate && !result.errors.empty()) {
    out.status =
        absl::FailedPreconditionError(absl::StrCat(result.errors.size(), " tensors could not be applied, e.g. '",
                                                   result.errors[0].path, "': ", result.errors[0].message));
  } else if (!options.allow_partial && !result.missing.empty()) {
    out.status =
        absl::FailedPreconditionError(absl::StrCat(result.missing.size(), " target tensors are missing, e.g. '",
                                                   result.missing[0], "' (use --allow-partial to load anyway)"));
  }
  return out;
}

double JaroSimilarity(absl::string_view a, absl::string_view b) {
  if (a.empty() && b.empty()) return 1.0;
  if (a.empty() || b.empty()) return 0.0;
  const size_t window = std::max<size_t>(std::max(a.size(), b.size()) / 2, 1) - 1;
  std::vector<bool> ma(a.size(), false), mb(b.size(), false);
  size_t matches = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const size_t lo = i > window ? i - window : 0, hi = std::min(b.size(), i + window + 1);
    for (size_t j = lo; j < hi; ++j) {
      if (!mb[j] && a[i] == b[j]) {
        ma[i] = mb[j] = true;
        ++matches;
        break;
      }
    }
  }
  if (matches == 0) return 0.0;
  size_t transpositions = 0;
  for (size_t i = 0, j = 0; i < a.size(); ++i) {
    if (!ma[i]) continue;
    while (!mb[j]) ++j;
    if (a[i] != b[j]) ++transpositions;
    ++j;
  }
  const double m = static_cast<double>(matches);
  return (m / a.size() + m / b.size() + (m - transpositions / 2.0) / m) / 3.0;
}

std::string ApplyResult::Summary() const {
  // "Did you mean" compares names pairwise (quadratic in their length): only
  // short names, against the first few thousand unused ones.
  constexpr size_t kMaxGuessBytes = 256, kMaxGuessCandidates = 2000;
  std::string out = absl::StrCat("Tensor loading summary\n", "  applied  ", applied.size(), "\n", "  skipped  ",
                                 skipped.size(), " (excluded by the filter)\n", "  missing  ", missing.size(),
                                 " (in the target, not in the source)\n", "  unused   ", unused.size(),
                                 " (in the source, not in the target)\n", "  errors   ", errors.size(), "\n");
  auto list = [&](absl::string_view title, const std::vector<std::string>& names, bool did_you_mean) {
    if (names.empty()) return;
    absl::StrAppend(&out, "\n", title, ":\n");
    for (size_t i = 0; i < names.size() && i < 10; ++i) {
      absl::StrAppend(&out, "  ", names[i]);
      if (did_you_mean && names[i].size() <= kMaxGuessBytes) {
        double best = 0.7;
        const std::string* guess = nullptr;
        for (size_t k = 0; k < unused.size() && k < kMaxGuessCandidates; ++k) {
          const std::string& u = unused[k];
          if (u.size() > kMaxGuessBytes) continue;
          double s = JaroSimilarity(names[i], u);
          if (s >= best) {
            best = s;
            guess = &u;
          }
        }
        if (guess != nullptr) absl::StrAppend(&out, "  (did you mean '", *guess, "'?)");
      }
      out += "\n";
    }
    if (names.size() > 10) absl::StrAppend(&out, "  ... and ", names.size() - 10, " more\n");
  };
  list("Missing", missing, true);
  list("Unused", unused, false);
  list("Skipped", skipped, false);
  if (!errors.empty()) {
    absl::StrAppend(&out, "\nErrors:\n");
    for (size_t i = 0; i < errors.size() && i < 10; ++i) {
      absl::StrAppend(&out, "  ", errors[i].path, ": ", errors[i].message, "\n");
    }
    if (errors.size() > 10) absl::StrAppend(&out, "  ... and ", errors.size() - 10, " more\n");
  }
  if (!suggestions.empty()) {
    absl::StrAppend(&out, "\nSuggestions:\n");
    for (const std::string& s : suggestions) absl::StrAppend(&out, "  ", s, "\n");
  }
  return out;
}

}  // namespace weightstore
