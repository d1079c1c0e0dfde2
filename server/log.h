// Structured logs: one JSON object per line on stderr, with a level threshold.
//
//   Log(LogLevel::kInfo, "request", {{"method", m}, {"bytes", 42}});
//   -> {"ts":"2026-11-22T11:00:00.123Z","level":"info","msg":"request","method":"...","bytes":42}
//
// Never pass secrets (tokens, keys) as fields. Thread-safe: each line is written
// with a single write(2).
#ifndef WEIGHTSTORE_SERVER_LOG_H_
#define WEIGHTSTORE_SERVER_LOG_H_

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace weightstore::server {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Parses "debug", "info", "warning" (or "warn"), "error".
std::optional<LogLevel> ParseLogLevel(absl::string_view name);
// Lines below `level` are dropped. Default: info.
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);
void Log(LogLevel level, absl::string_view message, nlohmann::ordered_json fields = nlohmann::ordered_json::object());

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_LOG_H_
