// Waiting on events in tests: polls a condition, never asserts how soon it holds.
#ifndef WEIGHTSTORE_TESTS_UTIL_WAIT_H_
#define WEIGHTSTORE_TESTS_UTIL_WAIT_H_

#include <functional>

#include "absl/time/time.h"

namespace weightstore::testing {

// Polls `condition` every 20 ms; returns true as soon as it holds, false once
// `deadline` has passed without it. The deadline only catches what never
// happens (a loaded machine under a sanitizer may take long), so keep it
// generous and never read it as a bound on how soon things happen.
bool WaitUntil(const std::function<bool()>& condition, absl::Duration deadline = absl::Seconds(60));

}  // namespace weightstore::testing

#endif  // WEIGHTSTORE_TESTS_UTIL_WAIT_H_
