// The options of weightstored's parts, in one header: what weightstored_main
// fills from its flags, without seeing the parts themselves.
#ifndef WEIGHTSTORE_SERVER_OPTIONS_H_
#define WEIGHTSTORE_SERVER_OPTIONS_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/catalog/pull.h"
#include "core/catalog/registry.h"
#include "core/select/selection.h"
#include "server/admission_gate.h"

namespace weightstore::server {

// WatchCheckpoints streams (server/watch.h).
struct WatchLimits {
  // Streams open at once, and from one client address; more are refused
  // RESOURCE_EXHAUSTED. Default: 256 and 32.
  int max_watches = 256;
  int max_watches_per_peer = 32;
  // Versions one request may say it holds. Default: 10,000.
  int max_known = 10000;
};

struct ServiceOptions {
  // Largest tensor chunk payload. Default: 1 MiB (tensorstore's read chunk).
  uint32_t chunk_bytes = 1 << 20;
  // FetchTensors streams: at most this many at once and per client address
  // (more get RESOURCE_EXHAUSTED), and one that stalls is cancelled.
  StreamLimits streams;
  // Folders (the models folder, the load roots) taken out of the paths in
  // error messages to clients. Set by WeightStoreServer.
  std::vector<std::string> hidden_folders;
  // PutCheckpoint uploads, the same way. Default: 4 at once, 2 per address.
  StreamLimits uploads = {.total = 4,
                          .per_peer = 2,
                          .what = "PutCheckpoint uploads",
                          .total_flag = "--max-concurrent-uploads",
                          .per_peer_flag = "--max-uploads-per-peer"};
  // FetchTensors streams waiting for their checkpoint to be pulled (a node
  // with an origin) hold a slot of their own here, not a serving one: so
  // that fetches of a checkpoint still on its way cannot lock out those of
  // checkpoints here. Once it arrives a stream takes a serving slot (or gets
  // RESOURCE_EXHAUSTED). Never cancelled for stalling: the pull is watched.
  StreamLimits pull_waits = {.total = 32,
                             .per_peer = 8,
                             .what = "FetchTensors streams waiting on a pull",
                             .total_flag = "--max-fetches-waiting-on-pulls",
                             .per_peer_flag = "--max-fetches-waiting-on-pulls-per-peer"};
  // Selections that run regexes or a target (include, exclude, renames, shard
  // rules, a target schema) over a checkpoint's names: at most this many at
  // once, and per client address (more get RESOURCE_EXHAUSTED). They run on
  // selection_threads workers, never on gRPC's threads, so that what one
  // client's selections cost cannot take the threads or the cores every
  // other call needs. Plain fetches and listings are not counted.
  StreamLimits selection_work = {.total = 4,
                                 .per_peer = 2,
                                 .min_bytes = 0,
                                 .what = "selections with patterns or a target being resolved",
                                 .total_flag = "--max-concurrent-selections",
                                 .per_peer_flag = "--max-selections-per-peer"};
  // Workers that resolve those selections; admitted ones beyond this wait
  // their turn. 0: half the cores, at least one, so that selections leave
  // the other half to serving.
  int selection_threads = 0;
  // What a request's selection may cost.
  SelectionLimits selection_limits;
  // Payload slices point into the mapping. False copies each chunk into a
  // protobuf message and serializes it, as a typed handler would: only for
  // measuring what zero-copy saves. Default: true.
  bool zero_copy = true;
  // WatchCheckpoints streams.
  WatchLimits watches;
  // Workers for calls that read whole tensors or files for their checksums
  // (ListTensors with_checksums, ListCheckpointFiles), and how many such
  // calls may wait for one (more get RESOURCE_EXHAUSTED). More workers than
  // cores: a worker may wait for another computing the same checksum.
  int background_threads = 4;
  size_t max_background_queue = 1024;
  // Workers that compose element patches for fetches several versions
  // behind (core/catalog/version_patches.h), off gRPC's threads; a stream
  // waits for its composition holding no thread. Streams beyond what the
  // queue holds (streams.total) get the tensor whole. Default: 2.
  int composition_threads = 2;
};

// How the socket hands out tensors stored as-is in a checkpoint file.
enum class FileSegments {
  // The file itself to a peer that could not open it writable anyway (a
  // read-only mount, fs-verity, an immutable file and a peer without the
  // capabilities that clear the flag, or a peer that is neither root, nor the
  // file's owner, nor granted write by its mode or an ACL: PeerCouldWrite);
  // a sealed copy to any other peer,
  // which could otherwise reopen the descriptor through /proc for writing.
  kAuto,
  // The file itself to every allowed peer: they are trusted with it.
  kAlways,
  // Always a sealed copy.
  kNever,
};

struct ShmServerOptions {
  // Socket path. Required. A stale socket left by a crashed daemon is replaced;
  // one a live daemon listens on is an error.
  std::string path;
  // Mode of the socket file. Default: 0660.
  mode_t mode = 0660;
  // Peers allowed to connect, by uid or by any of their groups (primary or
  // supplementary, as of connect()). Both empty: only the daemon's own
  // effective uid.
  std::set<uid_t> allowed_uids;
  std::set<gid_t> allowed_gids;
  // Connections served at once; more are answered RESOURCE_EXHAUSTED. Default: 256.
  int max_connections = 256;
  // Connections of one peer process (of one uid when its pid is not visible
  // from the daemon's pid namespace). Default: 32.
  int max_connections_per_peer = 32;
  // Connections of all processes of one uid. Default: 128.
  int max_connections_per_uid = 128;
  // How tensors stored as-is are handed out. Default: kAuto.
  FileSegments file_segments = FileSegments::kAuto;
  // Largest request frame (a target schema can be large). Default: 4 MiB, as
  // the gRPC port's request limit.
  uint32_t max_request_bytes = 4 << 20;
  // What a request's selection may cost.
  SelectionLimits selection_limits;
  // Folders taken out of the paths in error messages (as the gRPC service's).
  std::vector<std::string> hidden_folders;
  // A connection idle or stalled this long is closed. Default: 60 s.
  std::chrono::milliseconds io_timeout{60 * 1000};
};

// The data lane (server/data_lane.h).
struct DataLaneOptions {
  // "host:port" of a plain TCP port that fetches asking for it receive their
  // tensors' bytes on, beside their gRPC stream; port 0 picks one. Off when
  // empty; refused with TLS, as its bytes go in the clear.
  std::string listen;
  // Connections that have not yet sent a ticket, at once, and from one
  // address (an IPv6 address's /64) once half of max_handshakes are taken;
  // more are closed (their clients fetch over gRPC instead).
  int max_handshakes = 64;
  int max_handshakes_per_address = 8;
  // How long a connection may take to send its hello and ticket.
  std::chrono::milliseconds handshake_time{2000};
  // How long a ticket waits for its connection.
  std::chrono::milliseconds ticket_life{10000};
};

struct ServerOptions {
  // Address to listen on, "host:port". Default: 127.0.0.1:50051.
  std::string listen = "127.0.0.1:50051";
  RegistryOptions registry;
  ServiceOptions service;
  // Largest request message. Default: 4 MiB (PutCheckpoint data comes in chunks).
  int max_receive_message_bytes = 4 << 20;
  // Largest response message: a chunk plus headroom. Default: 8 MiB.
  int max_send_message_bytes = 8 << 20;
  // HTTP/2 streams per connection. Default: 100.
  int max_concurrent_streams_per_connection = 100;
  // Same-host socket (ShmServer). Off while socket.path is empty.
  ShmServerOptions socket;
  // Shared memory for derived segments and preloads. Default: 4 GiB.
  uint64_t shm_budget_bytes = uint64_t{4} << 30;
  // Prometheus text on http://<metrics_listen>/metrics. Off when empty.
  std::string metrics_listen;
  // A second gRPC port serving only grpc.health.v1.Health, plaintext and never
  // authenticated, for probes. Off when empty.
  std::string health_listen;
  // TLS on the main port when cert_file is set (PEM files); mutual TLS, requiring
  // and verifying a client certificate, when client_ca_file is set too.
  struct Tls {
    std::string cert_file, key_file, client_ca_file;
  } tls;
  DataLaneOptions data_lane;
  // Bearer tokens (server/auth.h). Off when empty: keep the port private.
  std::string tokens_file;
  // The origin tier: makes the puller (origin/node_cache.h) once the registry
  // exists. A name not served is then pulled on first use (read-through), and
  // PullCheckpoint works. Off when empty.
  std::function<absl::StatusOr<std::unique_ptr<Puller>>(CheckpointRegistry*)> make_puller;
  // Checkpoints to pull in the background once serving (weightstored --pull).
  std::vector<std::string> prefetch;
};

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_OPTIONS_H_
