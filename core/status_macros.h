// Propagation macros for absl::Status / absl::StatusOr. Abseil 20220623 (Debian 12)
// has no ABSL_RETURN_IF_ERROR; switch to it when our Abseil does.
#ifndef WEIGHTSTORE_CORE_STATUS_MACROS_H_
#define WEIGHTSTORE_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define WEIGHTSTORE_CONCAT_INNER_(a, b) a##b
#define WEIGHTSTORE_CONCAT_(a, b) WEIGHTSTORE_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the caller if not OK.
#define WEIGHTSTORE_RETURN_IF_ERROR(expr)                      \
  do {                                                         \
    ::absl::Status weightstore_status_ = (expr);               \
    if (!weightstore_status_.ok()) return weightstore_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else
// move-assigns the value to `lhs` (which may be a declaration).
#define WEIGHTSTORE_ASSIGN_OR_RETURN(lhs, rexpr) \
  WEIGHTSTORE_ASSIGN_OR_RETURN_IMPL_(WEIGHTSTORE_CONCAT_(weightstore_sor_, __COUNTER__), lhs, rexpr)

#define WEIGHTSTORE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                       \
  if (!tmp.ok()) return std::move(tmp).status();            \
  lhs = std::move(tmp).value()

#endif  // WEIGHTSTORE_CORE_STATUS_MACROS_H_
