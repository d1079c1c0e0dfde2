// Conversions from errno and Boost.Interprocess exceptions to absl::Status,
// and what an error may quote of a name an outsider chose.
#ifndef WEIGHTSTORE_CORE_STATUS_UTIL_H_
#define WEIGHTSTORE_CORE_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace boost::interprocess {
class interprocess_exception;
}

namespace weightstore {

// Returns a status whose code follows errno (ENOENT -> NotFound, EACCES ->
// PermissionDenied, EEXIST -> AlreadyExists, ENOSPC -> ResourceExhausted, ...) and
// whose message is "<context>: <strerror>".
absl::Status StatusFromErrno(int error_number, absl::string_view context);

// Converts an exception thrown by Boost.Interprocess at the call site.
absl::Status InterprocessErrorToStatus(const boost::interprocess::interprocess_exception& e, absl::string_view context);

// `name` as an error quotes it: whole up to 200 bytes, else its first 200
// (never cutting a UTF-8 character) and "...".
std::string ShortForError(absl::string_view name);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_STATUS_UTIL_H_
