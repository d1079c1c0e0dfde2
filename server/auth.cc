#include "server/auth.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace weightstore::server {
namespace {

// Compares without an early exit, so timing does not reveal a prefix.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? a[i] : 0, y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<Authenticator> Authenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the tokens file '", path, "'"));
  Authenticator auth;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || absl::StartsWith(text, "#")) continue;
    std::vector<absl::string_view> parts = absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (parts.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": expected '<scope> <token>' (scope: read or admin)"));
    }
    Token token;
    if (parts[0] == "read") {
      token.scope = Scope::kRead;
    } else if (parts[0] == "admin") {
      token.scope = Scope::kAdmin;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": unknown scope '", parts[0], "' (expected read or admin)"));
    }
    if (parts[1].size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": tokens must be at least 16 characters"));
    }
    token.value = std::string(parts[1]);
    auth.tokens_.push_back(std::move(token));
  }
  if (auth.tokens_.empty()) return absl::InvalidArgumentError(absl::StrCat("'", path, "' holds no tokens"));
  return auth;
}

absl::Status Authenticator::Check(const grpc::ServerContextBase& context, Scope needed) const {
  if (tokens_.empty()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return absl::UnauthenticatedError("the authorization metadata is not 'Bearer <token>'");
  }
  const Token* match = nullptr;
  for (const Token& t : tokens_) {
    if (ConstantTimeEquals(value, t.value)) match = &t;
  }
  if (match == nullptr) return absl::UnauthenticatedError("unknown bearer token");
  if (needed == Scope::kAdmin && match->scope != Scope::kAdmin) {
    return absl::PermissionDeniedError("this call needs a token with the admin scope; the one sent has read scope");
  }
  return absl::OkStatus();
}

}  // namespace weightstore::server
