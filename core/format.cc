#include "core/format.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"

namespace weightstore {
namespace {

// The ending of `lower` that `format` recognizes, or an empty view.
absl::string_view MatchedEnding(const FormatSpec& format, absl::string_view lower, bool named) {
  if (!format.index_suffix.empty() && absl::EndsWith(lower, format.index_suffix)) return format.index_suffix;
  for (absl::string_view ext : format.extensions) {
    if (absl::EndsWith(lower, ext)) return ext;
  }
  if (named) {
    for (absl::string_view ext : format.named_extensions) {
      if (absl::EndsWith(lower, ext)) return ext;
    }
  }
  return {};
}

}  // namespace

const FormatSpec* FindFormat(absl::string_view name) {
  for (const FormatSpec* format : Formats()) {
    if (format->name == name) return format;
  }
  return nullptr;
}

const FormatSpec* FormatForPath(absl::string_view path, bool named) {
  const std::string lower = absl::AsciiStrToLower(path);
  for (const FormatSpec* format : Formats()) {
    if (!MatchedEnding(*format, lower, named).empty()) return format;
  }
  return nullptr;
}

const FormatSpec* IndexFormatForPath(absl::string_view path) {
  const std::string lower = absl::AsciiStrToLower(path);
  for (const FormatSpec* format : Formats()) {
    if (!format->index_suffix.empty() && absl::EndsWith(lower, format->index_suffix)) return format;
  }
  return nullptr;
}

std::optional<std::string> StripFormatExtension(absl::string_view path) {
  const std::string lower = absl::AsciiStrToLower(path);
  for (const FormatSpec* format : Formats()) {
    absl::string_view ending = MatchedEnding(*format, lower, /*named=*/false);
    if (!ending.empty()) return std::string(path.substr(0, path.size() - ending.size()));
  }
  return std::nullopt;
}

const FormatSpec* DetectFormat(absl::string_view file) {
  for (const FormatSpec* format : Formats()) {
    if (format->detect != nullptr && format->detect(file)) return format;
  }
  return nullptr;
}

std::string FormatNames(bool writable_only) {
  std::vector<absl::string_view> names;
  for (const FormatSpec* format : Formats()) {
    if (!writable_only || format->writable()) names.push_back(format->name);
  }
  return absl::StrJoin(names, ", ");
}

std::string FormatExtensions(bool writable_only) {
  std::vector<absl::string_view> all;
  for (const FormatSpec* format : Formats()) {
    if (writable_only && !format->writable()) continue;
    const auto& endings =
        writable_only && !format->write_extensions.empty() ? format->write_extensions : format->extensions;
    all.insert(all.end(), endings.begin(), endings.end());
  }
  return absl::StrJoin(all, ", ");
}

bool CanWrite(const FormatSpec& format, absl::string_view path) {
  if (!format.writable()) return false;
  if (format.write_extensions.empty()) return true;
  for (absl::string_view e : format.write_extensions) {
    if (absl::EndsWithIgnoreCase(path, e)) return true;
  }
  return false;
}

}  // namespace weightstore
