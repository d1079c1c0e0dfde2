#include "core/catalog/pull.h"

#include <memory>

#include "absl/synchronization/mutex.h"

namespace weightstore {

absl::StatusOr<PullResult> Puller::Pull(const std::string& name) {
  struct Outcome {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::StatusOr<PullResult> result ABSL_GUARDED_BY(mu);
  };
  auto outcome = std::make_shared<Outcome>();
  PullAsync(name, [outcome](absl::StatusOr<PullResult> result) {
    absl::MutexLock lock(&outcome->mu);
    outcome->result = std::move(result);
    outcome->done = true;
  });
  absl::MutexLock lock(&outcome->mu);
  outcome->mu.Await(absl::Condition(&outcome->done));
  return outcome->result;
}

}  // namespace weightstore
