// WatchHub: the WatchCheckpoints streams of one service. Each stream drives a
// WatchCursor (core/catalog/watch_cursor.h) from a registry listener and writes one
// event at a time; the hub bounds how many there are and ends them all when
// the daemon shuts down (they would otherwise hold it for their whole grace).
// A publish only marks the watchers: their events are made on the hub's own
// thread, each step's diff and serialized event once for all its watchers
// (who hold references to the one buffer, not copies). Thread-safe.
#ifndef WEIGHTSTORE_SERVER_WATCH_H_
#define WEIGHTSTORE_SERVER_WATCH_H_

#include <grpcpp/support/byte_buffer.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/catalog/registry.h"
#include "core/catalog/watch_cursor.h"
#include "server/admission_gate.h"
#include "server/auth.h"
#include "server/options.h"
#include "weightstore/v1/weight_store.grpc.pb.h"

namespace weightstore::server {

class WatchReactor;

class WatchHub {
 public:
  // `client_status` turns an error into what a client is told (paths hidden).
  WatchHub(CheckpointRegistry* registry, const Authenticator* auth, WatchLimits limits,
           std::function<grpc::Status(const absl::Status&)> client_status);
  ~WatchHub();

  // Starts serving one WatchCheckpoints call (a serialized request).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Start(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request);
  // Ends every stream with UNAVAILABLE and refuses new ones.
  void Stop();
  int active() const;
  // The serialized event of `update`, made once per step for all watchers.
  std::shared_ptr<const grpc::ByteBuffer> Event(const CheckpointUpdate& update);
  // Bytes the hub keeps for watchers: serialized events and diffs. Given
  // back (to the system too) once the last watch ends.
  uint64_t cached_bytes() const;

 private:
  friend class WatchReactor;
  // Admits `reactor`, from `peer`: its slot, or ResourceExhausted naming the
  // limit (Unavailable once stopped).
  absl::StatusOr<GateTicket> Add(WatchReactor* reactor, absl::string_view peer);
  void Remove(WatchReactor* reactor, GateTicket slot);
  // Runs `work` on the hub's thread (a watcher to wake), in order.
  void Schedule(std::function<void()> work);
  void RunScheduled();
  // Lets the kept events and diffs go and returns freed heap to the system:
  // on the hub's thread, once no watch is left.
  void ReleaseCaches();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(work_mu_) { return work_stop_ || !work_.empty(); }

  CheckpointRegistry* registry_;
  const Authenticator* auth_;
  const WatchLimits limits_;
  std::function<grpc::Status(const absl::Status&)> client_status_;
  AdmissionGate streams_;  // counts, per client address too
  DiffCache diffs_;
  mutable absl::Mutex mu_;
  std::set<WatchReactor*> reactors_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // Events made, by step; the oldest dropped past kMaxEvents or kMaxEventBytes.
  mutable absl::Mutex events_mu_;
  std::map<std::string, std::shared_ptr<const grpc::ByteBuffer>> events_ ABSL_GUARDED_BY(events_mu_);
  std::deque<std::string> event_order_ ABSL_GUARDED_BY(events_mu_);
  uint64_t event_bytes_ ABSL_GUARDED_BY(events_mu_) = 0;
  mutable absl::Mutex work_mu_;
  std::deque<std::function<void()>> work_ ABSL_GUARDED_BY(work_mu_);
  bool work_stop_ ABSL_GUARDED_BY(work_mu_) = false;
  std::thread worker_;  // last: started once the rest is ready
};

// Fills `out` from a cursor's update, leaving the tensor names out (counts
// kept) when they would pass `max_name_bytes` together.
void ToProto(const CheckpointUpdate& update, v1::CheckpointEvent* out, size_t max_name_bytes = 1 << 20);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_WATCH_H_
