// UTF-8 validation for names read from files (they become CLI and gRPC keys).
#ifndef WEIGHTSTORE_CORE_UTF8_H_
#define WEIGHTSTORE_CORE_UTF8_H_

#include "absl/strings/string_view.h"

namespace weightstore {

// True if `s` is well-formed UTF-8 (no overlong forms, surrogates or values
// above U+10FFFF).
bool IsValidUtf8(absl::string_view s);

}  // namespace weightstore

#endif  // WEIGHTSTORE_CORE_UTF8_H_
