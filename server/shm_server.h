// ShmServer: weightstored's same-host socket. Processes on the host connect to a
// Unix domain socket, send a checkpoint name and a selection, and receive the
// tensor table plus descriptors (SCM_RIGHTS) to map read-only: the checkpoint
// files themselves where their bytes can be used as stored, and sealed memfds
// holding what had to be materialized (strided tensors, casts, transposes).
// The protocol is in proto/weightstore/v1/shm.proto.
//
// Access: the socket file has mode 0660 and every connection's peer
// credentials (SO_PEERCRED, and SO_PEERGROUPS for supplementary groups) are
// checked against the allowed uids and gids.
// Derived segments are built once per (checkpoint version, transformation) and
// shared by every client; they live in the SegmentCache under its budget. A
// client's mapping stays valid after eviction, unload or a daemon crash.
//
// One thread per connection (at most max_connections); a client that stalls
// mid-frame or stops reading is dropped after io_timeout. Thread-safe.
#ifndef WEIGHTSTORE_SERVER_SHM_SERVER_H_
#define WEIGHTSTORE_SERVER_SHM_SERVER_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/catalog/pull.h"
#include "core/catalog/registry.h"
#include "core/select/selection.h"
#include "core/shm/segment_cache.h"
#include "core/shm/unix_socket.h"
#include "server/admission_gate.h"
#include "server/options.h"
#include "weightstore/v1/shm.pb.h"

namespace weightstore::server {

// A connected socket peer, from SO_PEERCRED and SO_PEERGROUPS.
struct ShmPeer {
  pid_t pid = 0;  // 0 when the peer's pid namespace hides it
  uid_t uid = 0;
  std::vector<gid_t> gids;  // primary and supplementary
  std::string name;         // "unix:pid=...,uid=...,gid=..." for logs
};

// True when `peer` could open the file behind `fd` for writing (see
// FileSegments::kAuto): false only for a read-only mount, an fs-verity file,
// an immutable file (chattr +i) whose peer visibly holds no capability that
// clears the flag, or a peer that is neither root nor the owner, gets no
// write bit or ACL, and visibly holds no capability that gets around them.
// Errs towards true when it cannot tell.
bool PeerCouldWrite(int fd, const ShmPeer& peer);

class ShmServer {
 public:
  struct Stats {
    uint64_t requests = 0;
    uint64_t refused_connections = 0;  // peer credentials or connection limit
    uint64_t bytes_mapped = 0;         // tensor bytes described by MapTensors answers
    int active_connections = 0;
  };

  // Binds `options.path` and starts accepting. `registry`, `cache` and
  // `puller` (may be null: no origin; else a checkpoint a request names that
  // the daemon lacks is pulled first, on the connection's thread) must outlive
  // the server. AlreadyExists if a live daemon listens on the path,
  // FailedPrecondition if something other than a socket is there.
  // `selection_gate` (may be null: none) admits the selections that run
  // patterns or a target, by the peer's uid: the gRPC port's gate, so that
  // both transports together are held to --max-concurrent-selections.
  static absl::StatusOr<std::unique_ptr<ShmServer>> Start(const CheckpointRegistry* registry, SegmentCache* cache,
                                                          ShmServerOptions options, Puller* puller = nullptr,
                                                          AdmissionGate* selection_gate = nullptr);
  ~ShmServer();  // Stop()s

  // Stops accepting, closes every connection, removes the socket file. Mappings
  // already handed out stay valid. Idempotent.
  void Stop();

  const std::string& path() const { return options_.path; }
  Stats stats() const;

 private:
  ShmServer(const CheckpointRegistry* registry, SegmentCache* cache, ShmServerOptions options, Puller* puller,
            AdmissionGate* selection_gate)
      : registry_(registry),
        cache_(cache),
        puller_(puller),
        selection_gate_(selection_gate),
        options_(std::move(options)) {}
  void AcceptLoop();
  // Answers one request: fills `response` and the descriptors to send with it
  // (owned by the segments `keep` holds alive, or by `leases`: the per-client
  // descriptors of checkpoint files).
  void Handle(const v1::ShmRequest& request, const ShmPeer& peer, v1::ShmResponse* response, std::vector<int>* fds,
              std::vector<UniqueFd>* leases, std::vector<std::shared_ptr<const MappedFile>>* keep);
  void Serve(int connection, const ShmPeer& peer);
  // One structured log line per request (server/log.h).
  static void LogRequest(const v1::ShmRequest& request, const v1::ShmResponse& response, const std::string& peer,
                         std::chrono::steady_clock::duration elapsed);
  // `gids`: the peer's primary and supplementary groups.
  bool Allowed(uid_t uid, const std::vector<gid_t>& gids) const;
  absl::Status MapTensors(const v1::MapTensorsRequest& request, const ShmPeer& peer, v1::MapTensorsResponse* response,
                          std::vector<std::shared_ptr<const MappedFile>>* segments);
  void Reap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether `file` may go to `peer` as itself (options_.file_segments), decided
  // once per file and request in `decided`.
  bool MayPassFile(const MappedFile& file, const ShmPeer& peer,
                   absl::flat_hash_map<const MappedFile*, bool>* decided) const;

  const CheckpointRegistry* registry_;
  SegmentCache* cache_;
  // Whether copies of files a peer could write are filled a tensor at a
  // time (core/shm/filled_memfd.h); false once the kernel said it cannot,
  // or with WEIGHTSTORE_FILLED_COPIES=0 in the environment (to measure it,
  // or to step around a kernel's bug): then each request's copy is its own,
  // sealed whole.
  std::atomic<bool> filled_copies_{FilledCopiesAllowed()};
  static bool FilledCopiesAllowed();
  Puller* puller_;
  AdmissionGate* selection_gate_;
  const ShmServerOptions options_;
  UniqueFd listener_;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> requests_{0}, refused_{0}, bytes_mapped_{0};

  struct Connection {
    int fd;  // -1 once its thread closed it
    std::thread thread;
    bool done = false;
    std::string peer_key, uid_key;  // for the per-peer and per-uid shares
  };
  mutable absl::Mutex mu_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int> per_peer_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;

  // CRC32C of each derived segment's tensors, by segment key.
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_SHM_SERVER_H_
