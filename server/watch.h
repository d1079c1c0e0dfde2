// WatchHub: the WatchCheckpoints streams of one service. Each stream drives a
// WatchCursor (core/watch_cursor.h) from a registry listener and writes one
// event at a time; the hub bounds how many there are and ends them all when
// the daemon shuts down (they would otherwise hold it for their whole grace).
// Thread-safe.
#ifndef WEIGHTSTORE_SERVER_WATCH_H_
#define WEIGHTSTORE_SERVER_WATCH_H_

#include <functional>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/registry.h"
#include "core/watch_cursor.h"
#include "server/auth.h"
#include "server/options.h"
#include "server/stream_governor.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::server {

class WatchReactor;

class WatchHub {
 public:
  // `client_status` turns an error into what a client is told (paths hidden).
  WatchHub(CheckpointRegistry* registry, const Authenticator* auth, WatchLimits limits,
           std::function<grpc::Status(const absl::Status&)> client_status);
  ~WatchHub();

  // Starts serving one WatchCheckpoints call.
  grpc::ServerWriteReactor<v1::CheckpointEvent>* Start(grpc::CallbackServerContext* ctx,
                                                       const v1::WatchCheckpointsRequest* request);
  // Ends every stream with UNAVAILABLE and refuses new ones.
  void Stop();
  int active() const;

 private:
  friend class WatchReactor;
  // Admits `reactor`, from `peer`: a governor ticket, or ResourceExhausted
  // naming the limit (Unavailable once stopped).
  absl::StatusOr<uint64_t> Add(WatchReactor* reactor, absl::string_view peer);
  void Remove(WatchReactor* reactor, uint64_t ticket);

  CheckpointRegistry* registry_;
  const Authenticator* auth_;
  const WatchLimits limits_;
  std::function<grpc::Status(const absl::Status&)> client_status_;
  StreamGovernor streams_;  // counts, per client address too
  mutable absl::Mutex mu_;
  std::set<WatchReactor*> reactors_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

// Fills `out` from a cursor's update, leaving the tensor names out (counts
// kept) when they would pass `max_name_bytes` together.
void ToProto(const CheckpointUpdate& update, v1::CheckpointEvent* out, size_t max_name_bytes = 1 << 20);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_WATCH_H_
