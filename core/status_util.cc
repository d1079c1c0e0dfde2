#include "core/status_util.h"

#include <boost/interprocess/exceptions.hpp>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace weightstore {

absl::Status StatusFromErrno(int error_number, absl::string_view context) {
  std::string message = absl::StrCat(context, ": ", std::strerror(error_number));
  switch (error_number) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(message);
    case EINVAL:
    case ENAMETOOLONG:
    case EISDIR:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status InterprocessErrorToStatus(const boost::interprocess::interprocess_exception& e,
                                       absl::string_view context) {
  int native = e.get_native_error();
  if (native != 0) return StatusFromErrno(native, context);
  return absl::InternalError(absl::StrCat(context, ": ", e.what()));
}

std::string ShortForError(absl::string_view name) {
  constexpr size_t kMaxQuotedBytes = 200;
  if (name.size() <= kMaxQuotedBytes) return std::string(name);
  size_t cut = kMaxQuotedBytes;
  while (cut > 0 && (static_cast<uint8_t>(name[cut]) & 0xC0) == 0x80) --cut;  // not inside a character
  return absl::StrCat(name.substr(0, cut), "...");
}

}  // namespace weightstore
