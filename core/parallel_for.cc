#include "core/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace weightstore {

absl::Status ParallelFor(size_t n, unsigned threads, const std::function<absl::Status(size_t)>& work) {
  std::atomic<size_t> next{0};
  absl::Mutex mu;
  absl::Status failure;
  auto loop = [&] {
    for (size_t i = next++; i < n; i = next++) {
      // An exception (bad_alloc) must not leave a helper's thread: it
      // becomes the item's error.
      absl::Status status;
      try {
        status = work(i);
      } catch (const std::bad_alloc&) {
        status = absl::ResourceExhaustedError("out of memory");
      } catch (const std::exception& e) {
        status = absl::InternalError(e.what());
      }
      if (status.ok()) continue;
      absl::MutexLock lock(&mu);
      if (failure.ok()) failure = std::move(status);
      next = n;
    }
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < std::min<size_t>(threads, n); ++t) {
    try {
      helpers.emplace_back(loop);
    } catch (const std::system_error&) {
      break;  // no thread to spare: the caller's does the rest
    }
  }
  loop();
  for (std::thread& t : helpers) t.join();
  return failure;
}

}  // namespace weightstore
