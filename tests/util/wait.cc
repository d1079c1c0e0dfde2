#include "tests/util/wait.h"

#include <chrono>
#include <thread>

namespace weightstore::testing {

bool WaitUntil(const std::function<bool()>& condition, absl::Duration deadline) {
  const auto give_up = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(deadline);
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

}  // namespace weightstore::testing
