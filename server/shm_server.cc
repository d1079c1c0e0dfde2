#include "server/shm_server.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/un.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <system_error>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "boost/icl/interval_set.hpp"
#include "core/crc32c.h"
#include "core/dtype.h"
#include "core/host_buffer.h"
#include "core/parallel_for.h"
#include "core/select/served.h"
#include "core/shm/filled_memfd.h"
#include "core/shm/sealed_memfd.h"
#include "core/status_macros.h"
#include "core/status_util.h"
#include "server/grpc_status.h"
#include "server/log.h"
#include "server/observability.h"
#include "server/proto_convert.h"
#include "server/resolve.h"

namespace weightstore::server {
namespace {

// The descriptor of `file` to send one client. A checkpoint file goes out as a
// new open file description (through /proc/self/fd) holding a shared flock,
// kept in `leases` until sent: the client's mapping keeps the description, and
// so the lock, alive until it is unmapped and closed, which is how the node
// cache (origin/node_cache.h) tells a file still mapped on this host. A sealed
// memfd (a segment, evicted by the segment cache on its own terms) goes out as
// it is.
int LeaseDescriptor(const MappedFile& file, std::vector<UniqueFd>* leases) {
  if (::fcntl(file.fd(), F_GET_SEALS) >= 0) return file.fd();
  UniqueFd fd(::open(absl::StrCat("/proc/self/fd/", file.fd()).c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return file.fd();
  // Never waits: a local process holding an exclusive lock on the file must
  // not stall the socket. Without the shared lock the mapping is still valid;
  // only the cache's in-use probe cannot see it (it then sees that process's
  // lock instead).
  (void)::flock(fd.get(), LOCK_SH | LOCK_NB);
  leases->push_back(std::move(fd));
  return leases->back().get();
}

// The peer's primary group and, where the kernel reports them (SO_PEERGROUPS,
// Linux 4.13), its supplementary groups, as they were when it connected.
std::vector<gid_t> PeerGroups(int fd, gid_t primary) {
  std::vector<gid_t> groups(64);
  socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) != 0) {
    if (errno != ERANGE) return {primary};
    groups.resize(len / sizeof(gid_t));  // the kernel said how many
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) != 0) return {primary};
  }
  groups.resize(len / sizeof(gid_t));
  groups.push_back(primary);
  return groups;
}

// The effective capabilities of a visible process, or nullopt.
std::optional<uint64_t> EffectiveCapabilities(pid_t pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string text;
  while (std::getline(in, text)) {
    absl::string_view line = text;
    uint64_t caps = 0;
    if (absl::ConsumePrefix(&line, "CapEff:") && absl::SimpleHexAtoi(absl::StripAsciiWhitespace(line), &caps)) {
      return caps;
    }
  }
  return std::nullopt;
}

// Materialized tensors are produced into a buffer of this size, then written
// into their segment: small enough to stay in cache, a multiple of every
// element size.
constexpr uint64_t kStagingBytes = 1 << 20;
// Derived tensors start on this boundary inside their segment.
constexpr uint64_t kAlignment = 64;

void SetStatus(const absl::Status& status, v1::ShmResponse* response) {
  response->Clear();
  response->set_code(static_cast<int>(status.code()));
  response->set_message(BoundedMessage(status.message()));
}

// Removes a socket file no daemon listens on; refuses to touch anything else.
absl::Status ClearStaleSocket(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return StatusFromErrno(errno, absl::StrCat("cannot stat '", path, "'"));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("'", path, "' exists and is not a socket; not replacing it"));
  }
  absl::StatusOr<UniqueFd> probe = ConnectUnixSocket(path);
  if (probe.ok()) return absl::AlreadyExistsError(absl::StrCat("another daemon is listening on '", path, "'"));
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return StatusFromErrno(errno, absl::StrCat("cannot remove the stale socket '", path, "'"));
  }
  return absl::OkStatus();
}

// The element patches a MapTensors answer sends instead of changed tensors.
struct MappedPatches {
  std::shared_ptr<const MappedFile> segment;
  absl::flat_hash_map<size_t, std::pair<ElementPatch, uint64_t>> at;  // by tensor index: the patch, its offset
};

// The patches of `chain` for `resolved`'s changed tensors served as stored,
// in one sealed memfd of `cache`, keyed by the versions they join and each
// patch, so the workers of a host that follow a checkpoint share one copy.
// ResourceExhausted when they do not fit the cache's budget.
absl::StatusOr<MappedPatches> MapPatches(SegmentCache& cache, const Resolved& resolved, const PatchChain& chain,
                                         const std::string& name) {
  const Snapshot& snapshot = *resolved.snapshot;
  const CheckpointVersion& version = *resolved.version;
  MappedPatches out;
  std::vector<std::pair<size_t, ElementPatch>> patched;
  for (size_t i = 0; i < snapshot.size(); ++i) {
    const SnapshotTensor& t = snapshot.tensors()[i];
    if (resolved.Unchanged(t)) continue;
    if (std::optional<ElementPatch> patch = ServedPatch(&chain, snapshot, PlanServedTensor(snapshot, t))) {
      patched.emplace_back(i, *std::move(patch));
    }
  }
  if (patched.empty()) return out;
  std::string key = absl::StrCat("patches|", version.name().size(), ":", version.name(), "|", resolved.since_version,
                                 "|", version.version(), "|", version.file_version());
  std::vector<uint64_t> offsets;
  uint64_t size = 0;
  for (const auto& [i, patch] : patched) {
    const std::string& source = snapshot.tensors()[i].source->spec.name;
    absl::StrAppend(&key, "|", source.size(), ":", source, ":", static_cast<int>(patch.encoding), ":", patch.changed,
                    ":", patch.body.size());
    size = (size + kAlignment - 1) / kAlignment * kAlignment;
    offsets.push_back(size);
    size += patch.body.size();
  }
  auto fill = [&](SegmentWriter& writer) -> absl::Status {
    for (size_t k = 0; k < patched.size(); ++k) {
      WEIGHTSTORE_RETURN_IF_ERROR(writer.Write(offsets[k], patched[k].second.body.span()));
    }
    return absl::OkStatus();
  };
  WEIGHTSTORE_ASSIGN_OR_RETURN(
      out.segment, cache.GetOrCreate(key, size, absl::StrCat(name, ": ", patched.size(), " element patches"), fill));
  if (out.segment->size() != size) {
    return absl::InternalError(absl::StrCat("the cached patches of '", name, "' are ", out.segment->size(),
                                            " bytes where ", size, " were made"));
  }
  for (size_t k = 0; k < patched.size(); ++k) {
    out.at.emplace(patched[k].first, std::make_pair(std::move(patched[k].second), offsets[k]));
  }
  return out;
}

// A tensor of a checkpoint file that goes out as a copy of that file (a peer
// could write the file): its bytes, and where they lie in the file.
struct CopiedTensor {
  size_t index = 0;  // in the snapshot
  FilledMemfd::Range range;
  ServedTensorPlan plan;
};

// Copies pieces of at most this many bytes, the workers taking them in turn.
constexpr uint64_t kCopyPieceBytes = 4 << 20;

// Makes sure `tensors`' bytes of `file` (the version's `file_index`th) are in
// the version's filled copy of that file in `cache` (core/shm/filled_memfd.h),
// copying the ones no request copied before on two workers, and returns the
// copy as it is handed out. Bytes copied are charged to the budget in whole
// pages, each page once, and are finished only once the version's files are
// seen unchanged after the copy and each tensor this request copied whole
// matches the version's checksum of it (or gives it one): `crcs` receives
// those tensors' CRC32C, by position in `tensors`.
absl::StatusOr<std::shared_ptr<const MappedFile>> FillFileCopy(SegmentCache& cache, const Resolved& resolved,
                                                               const MappedFile& file, size_t file_index,
                                                               std::span<const CopiedTensor> tensors,
                                                               const std::function<bool()>& cancelled,
                                                               std::vector<std::optional<uint32_t>>* crcs) {
  const CheckpointVersion& version = *resolved.version;
  const ChecksumCache& checksums = version.checksums();
  const std::string key = absl::StrCat("filled|", version.name().size(), ":", version.name(), "|", version.version(),
                                       "|", version.file_version(), "|", file_index);
  const std::string what = absl::StrCat("'", version.name(), "': copy of file ", file_index);
  WEIGHTSTORE_ASSIGN_OR_RETURN(SegmentCache::FilledLease lease, cache.GetOrCreateFilled(key, file.size(), what));
  FilledMemfd& copy = lease.segment();
  if (copy.size() != file.size()) {
    return absl::InternalError(absl::StrCat(what, " is ", copy.size(), " bytes where the file has ", file.size()));
  }
  std::vector<FilledMemfd::Range> wanted;
  wanted.reserve(tensors.size());
  for (const CopiedTensor& t : tensors) wanted.push_back(t.range);
  crcs->assign(tensors.size(), std::nullopt);
  const SharedBytes source = file.bytes();
  // A filler that fails gives its ranges up; a waiter then claims them. Three
  // rounds bound what one request retries.
  for (int round = 0; round < 3; ++round) {
    WEIGHTSTORE_ASSIGN_OR_RETURN(std::vector<FilledMemfd::Range> mine, copy.Claim(wanted));
    if (!mine.empty()) {
      absl::Cleanup give_up = [&] { copy.Finish(mine, /*written=*/false); };
      WEIGHTSTORE_RETURN_IF_ERROR(cache.Grow(lease, copy.UnchargedBytes(mine), what));
      copy.MarkCharged(mine);
      std::vector<FilledMemfd::Range> pieces;
      boost::icl::interval_set<uint64_t> claimed;
      for (const FilledMemfd::Range& r : mine) {
        claimed.add(boost::icl::interval<uint64_t>::right_open(r.offset, r.offset + r.length));
        for (uint64_t at = 0; at < r.length; at += kCopyPieceBytes) {
          pieces.push_back({r.offset + at, std::min(kCopyPieceBytes, r.length - at)});
        }
      }
      WEIGHTSTORE_RETURN_IF_ERROR(ParallelFor(pieces.size(), 2, [&](size_t k) {
        const std::span<std::byte> out = copy.Writable(pieces[k]);
        PrefaultForWriting(out);
        std::memcpy(out.data(), source.data() + pieces[k].offset, out.size());
        return absl::OkStatus();
      }));
      // The bytes must be the file as opened: its size and times unchanged
      // (a truncation under the copy reads as zeros and marks it faulted),
      // and each tensor copied whole equal to its checksum where one is known.
      WEIGHTSTORE_RETURN_IF_ERROR(version.CheckUnchanged());
      for (size_t k = 0; k < tensors.size(); ++k) {
        const FilledMemfd::Range& r = tensors[k].range;
        if (!boost::icl::contains(claimed, boost::icl::interval<uint64_t>::right_open(r.offset, r.offset + r.length))) {
          continue;
        }
        const std::span<std::byte> bytes = copy.Writable(r);
        const uint32_t crc = Crc32c(absl::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
        if (std::optional<uint32_t> known = checksums.Find(tensors[k].plan.key); known && *known != crc) {
          return absl::DataLossError(absl::StrCat("tensor '", tensors[k].plan.tensor->spec.name, "' of '",
                                                  version.name(), "' copied with CRC32C ", crc, ", not ", *known,
                                                  ": its file changed in place under the copy"));
        }
        (*crcs)[k] = crc;
      }
      std::move(give_up).Cancel();
      copy.Finish(mine, /*written=*/true);
    }
    switch (copy.WaitFilled(wanted, cancelled)) {
      case FilledMemfd::Wait::kFilled:
        for (size_t k = 0; k < tensors.size(); ++k) {
          if ((*crcs)[k] && !checksums.Find(tensors[k].plan.key)) {
            WEIGHTSTORE_RETURN_IF_ERROR(checksums.Store(tensors[k].plan.key, *(*crcs)[k]));
          }
        }
        return copy.view();
      case FilledMemfd::Wait::kCancelled:
        return absl::CancelledError(absl::StrCat(what, ": the daemon is stopping"));
      case FilledMemfd::Wait::kGivenUp:
        break;
    }
  }
  return absl::UnavailableError(absl::StrCat(what, ": the requests copying its tensors kept failing; ask again"));
}

}  // namespace

bool PeerCouldWrite(int fd, const ShmPeer& peer) {
  struct statvfs fs;
  if (::fstatvfs(fd, &fs) == 0 && (fs.f_flag & ST_RDONLY) != 0) return false;  // EROFS for everyone
  struct statx sx;
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, &sx) == 0) {
    const auto has = [&sx](uint64_t attribute) {
      return (sx.stx_attributes_mask & attribute) != 0 && (sx.stx_attributes & attribute) != 0;
    };
    // fs-verity: the file's contents can never be written again, by anyone.
    if (has(STATX_ATTR_VERITY)) return false;
    // Immutable (chattr +i): no one writes it, root and the owner included,
    // until a holder of CAP_LINUX_IMMUTABLE (9) clears the flag; also
    // refused a peer with CAP_SYS_RAWIO (17) or CAP_SYS_ADMIN (21), which
    // reach the device or the mount under it, and one whose capabilities
    // the daemon cannot see.
    if (has(STATX_ATTR_IMMUTABLE)) {
      constexpr uint64_t kUnlock = (uint64_t{1} << 9) | (uint64_t{1} << 17) | (uint64_t{1} << 21);
      std::optional<uint64_t> caps = EffectiveCapabilities(peer.pid);
      return !caps.has_value() || (*caps & kUnlock) != 0;
    }
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) return true;
  if (peer.uid == 0 || peer.uid == st.st_uid) return true;  // root, or the owner (who may chmod)
  if ((st.st_mode & S_IWOTH) != 0) return true;
  if ((st.st_mode & S_IWGRP) != 0 && std::find(peer.gids.begin(), peer.gids.end(), st.st_gid) != peer.gids.end()) {
    return true;
  }
  // An ACL may grant write to anyone: do not try to read it, assume it does.
  if (::fgetxattr(fd, "system.posix_acl_access", nullptr, 0) >= 0) return true;
  // Capabilities that get around the file's owner and mode: CAP_CHOWN (0),
  // CAP_DAC_OVERRIDE (1), CAP_FOWNER (3), CAP_SETGID (6), CAP_SETUID (7),
  // CAP_SYS_ADMIN (21). A peer whose pid the daemon cannot see (another pid
  // namespace) might hold any of them.
  constexpr uint64_t kWriteAnything = (uint64_t{1} << 0) | (uint64_t{1} << 1) | (uint64_t{1} << 3) |
                                      (uint64_t{1} << 6) | (uint64_t{1} << 7) | (uint64_t{1} << 21);
  std::optional<uint64_t> caps = EffectiveCapabilities(peer.pid);
  return !caps.has_value() || (*caps & kWriteAnything) != 0;
}

absl::StatusOr<std::unique_ptr<ShmServer>> ShmServer::Start(const CheckpointRegistry* registry, SegmentCache* cache,
                                                            ShmServerOptions options, Puller* puller,
                                                            AdmissionGate* selection_gate) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.path.empty() || options.path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", options.path, "' must be 1 to ", sizeof(addr.sun_path) - 1, " bytes"));
  }
  absl::Status cleared = ClearStaleSocket(options.path);
  if (!cleared.ok()) return cleared;
  std::memcpy(addr.sun_path, options.path.data(), options.path.size());
  std::unique_ptr<ShmServer> server(new ShmServer(registry, cache, std::move(options), puller, selection_gate));
  const std::string& path = server->options_.path;
  server->listener_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!server->listener_.valid()) return StatusFromErrno(errno, "socket(AF_UNIX)");
  if (::bind(server->listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return StatusFromErrno(errno, absl::StrCat("cannot bind '", path, "'"));
  }
  // Peer credentials are checked on every connection too, so the moment between
  // bind and chmod grants nothing.
  if (::chmod(path.c_str(), server->options_.mode) != 0 || ::listen(server->listener_.get(), 128) != 0) {
    absl::Status status = StatusFromErrno(errno, absl::StrCat("cannot listen on '", path, "'"));
    ::unlink(path.c_str());
    return status;
  }
  server->acceptor_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

ShmServer::~ShmServer() { Stop(); }

bool ShmServer::FilledCopiesAllowed() {
  const char* value = std::getenv("WEIGHTSTORE_FILLED_COPIES");
  return value == nullptr || absl::string_view(value) != "0";
}

void ShmServer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  stopping_ = true;
  ::shutdown(listener_.get(), SHUT_RDWR);  // wakes accept()
  if (acceptor_.joinable()) acceptor_.join();
  ::unlink(options_.path.c_str());
  std::list<Connection> connections;
  {
    absl::MutexLock lock(&mu_);
    for (Connection& c : connections_) {
      if (c.fd >= 0) ::shutdown(c.fd, SHUT_RDWR);
    }
    connections.swap(connections_);
  }
  for (Connection& c : connections) c.thread.join();
}

bool ShmServer::MayPassFile(const MappedFile& file, const ShmPeer& peer,
                            absl::flat_hash_map<const MappedFile*, bool>* decided) const {
  auto [it, added] = decided->try_emplace(&file, false);
  if (!added) return it->second;
  switch (options_.file_segments) {
    case FileSegments::kAlways:
      it->second = true;
      break;
    case FileSegments::kNever:
      it->second = CheckSealed(file.fd(), file.path()).ok();
      break;
    case FileSegments::kAuto:
      it->second = CheckSealed(file.fd(), file.path()).ok() || !PeerCouldWrite(file.fd(), peer);
      break;
  }
  return it->second;
}

ShmServer::Stats ShmServer::stats() const {
  Stats s;
  s.requests = requests_.load();
  s.refused_connections = refused_.load();
  s.bytes_mapped = bytes_mapped_.load();
  absl::MutexLock lock(&mu_);
  for (const Connection& c : connections_) s.active_connections += c.done ? 0 : 1;
  return s;
}

bool ShmServer::Allowed(uid_t uid, const std::vector<gid_t>& gids) const {
  if (options_.allowed_uids.empty() && options_.allowed_gids.empty()) return uid == ::geteuid();
  if (options_.allowed_uids.contains(uid)) return true;
  return std::any_of(gids.begin(), gids.end(), [&](gid_t g) { return options_.allowed_gids.contains(g); });
}

void ShmServer::Reap() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (!it->done) {
      ++it;
      continue;
    }
    it->thread.join();
    it = connections_.erase(it);
  }
}

void ShmServer::AcceptLoop() {
  while (!stopping_) {
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (stopping_) return;
      if (errno == EMFILE || errno == ENFILE || errno == ENOMEM) {  // back off, keep serving
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      return;
    }
    UniqueFd connection(fd);
    (void)SetSocketTimeouts(fd, options_.io_timeout);
    auto refuse = [&](const absl::Status& status) {
      ++refused_;
      v1::ShmResponse response;
      SetStatus(status, &response);
      (void)SendFrame(fd, response.SerializeAsString());
    };
    ucred peer{};
    socklen_t len = sizeof(peer);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
      refuse(absl::PermissionDeniedError("cannot read the peer's credentials"));
      continue;
    }
    const std::vector<gid_t> groups = PeerGroups(fd, peer.gid);
    if (!Allowed(peer.uid, groups)) {
      refuse(absl::PermissionDeniedError(absl::StrCat("uid ", peer.uid, " gid ", peer.gid, " (groups ",
                                                      absl::StrJoin(groups, ","), "; pid ", peer.pid, ") may not use '",
                                                      options_.path, "'")));
      continue;
    }
    absl::MutexLock lock(&mu_);
    Reap();
    if (stopped_) return;
    if (static_cast<int>(connections_.size()) >= options_.max_connections) {
      refuse(absl::ResourceExhaustedError(
          absl::StrCat(options_.max_connections, " connections are open on '", options_.path, "'; retry later")));
      continue;
    }
    // A process's share (a peer in another pid namespace shows as pid 0: its
    // uid's), and its uid's, which forked processes share.
    std::string key = peer.pid > 0 ? absl::StrCat("pid ", peer.pid) : absl::StrCat("uid ", peer.uid);
    const std::string uid_key = absl::StrCat("all of uid ", peer.uid);
    if (per_peer_[key] >= options_.max_connections_per_peer) {
      refuse(absl::ResourceExhaustedError(
          absl::StrCat(key, " has ", per_peer_[key], " connections open on '", options_.path, "'; retry later")));
      continue;
    }
    if (per_peer_[uid_key] >= options_.max_connections_per_uid) {
      refuse(absl::ResourceExhaustedError(absl::StrCat("uid ", peer.uid, " has ", per_peer_[uid_key],
                                                       " connections open on '", options_.path, "'; retry later")));
      continue;
    }
    ++per_peer_[key];
    ++per_peer_[uid_key];
    Connection& c = connections_.emplace_back();
    c.fd = connection.release();
    c.peer_key = key;
    c.uid_key = uid_key;
    ShmPeer who{peer.pid, peer.uid, groups, absl::StrCat("unix:pid=", peer.pid, ",uid=", peer.uid, ",gid=", peer.gid)};
    c.thread = std::thread([this, &c, fd = c.fd, who = std::move(who)] {
      Serve(fd, who);
      absl::MutexLock lock(&mu_);  // closed under the lock: Stop() never shuts down a reused number
      ::close(fd);
      c.fd = -1;
      c.done = true;
      if (--per_peer_[c.peer_key] <= 0) per_peer_.erase(c.peer_key);
      if (--per_peer_[c.uid_key] <= 0) per_peer_.erase(c.uid_key);
    });
  }
}

void ShmServer::Serve(int connection, const ShmPeer& peer) {
  while (!stopping_) {
    std::string frame;
    std::vector<UniqueFd> received;
    absl::Status status = RecvFrame(connection, options_.max_request_bytes, &frame, &received);
    v1::ShmResponse response;
    if (absl::IsOutOfRange(status) || absl::IsDataLoss(status) || absl::IsDeadlineExceeded(status) ||
        absl::IsUnavailable(status)) {
      return;  // the client left, cut a frame short, or stalled
    }
    if (!status.ok()) {  // an absurd length: the stream cannot be followed any further
      SetStatus(status, &response);
      (void)SendFrame(connection, response.SerializeAsString());
      return;
    }
    ++requests_;
    const auto start = std::chrono::steady_clock::now();
    v1::ShmRequest request;
    std::vector<int> fds;
    std::vector<UniqueFd> leases;
    std::vector<std::shared_ptr<const MappedFile>> keep;
    if (!received.empty()) {
      SetStatus(absl::InvalidArgumentError("requests must not carry file descriptors"), &response);
    } else if (!request.ParseFromString(frame)) {
      SetStatus(absl::InvalidArgumentError(absl::StrCat("a ", frame.size(), "-byte frame that is not a ShmRequest")),
                &response);
    } else {
      Handle(request, peer, &response, &fds, &leases, &keep);
    }
    LogRequest(request, response, peer.name, std::chrono::steady_clock::now() - start);
    if (!SendFrame(connection, response.SerializeAsString(), fds).ok()) return;
  }
}

void ShmServer::LogRequest(const v1::ShmRequest& request, const v1::ShmResponse& response, const std::string& peer,
                           std::chrono::steady_clock::duration elapsed) {
  const LogLevel level = response.code() == 0 ? LogLevel::kInfo : LogLevel::kWarning;
  if (!LogEnabled(level)) return;
  nlohmann::ordered_json fields;
  std::string checkpoint;
  uint64_t bytes = 0;
  switch (request.request_case()) {
    case v1::ShmRequest::kListCheckpoints:
      fields["method"] = "shm/ListCheckpoints";
      break;
    case v1::ShmRequest::kGetCheckpoint:
      fields["method"] = "shm/GetCheckpoint";
      checkpoint = request.get_checkpoint().name();
      break;
    case v1::ShmRequest::kMapTensors:
      fields["method"] = request.map_tensors().table_only() ? "shm/ListTensors" : "shm/MapTensors";
      checkpoint = request.map_tensors().name();
      if (!request.map_tensors().table_only()) {
        for (const auto& t : response.map_tensors().tensors()) {
          if (!t.info().unchanged())
            bytes += t.info().has_patch() ? t.info().patch().patch_bytes() : t.info().byte_size();
        }
      }
      break;
    default:
      fields["method"] = "shm/invalid";
  }
  if (!checkpoint.empty()) fields["checkpoint"] = TrailerValue(checkpoint);  // short and printable, as gRPC's
  fields["bytes"] = bytes;
  fields["duration_ms"] = std::round(std::chrono::duration<double, std::micro>(elapsed).count()) / 1e3;
  fields["status"] = GrpcCodeName(response.code());
  if (response.code() != 0) fields["error"] = response.message();
  fields["peer"] = peer;
  Log(level, "request", std::move(fields));
}

void ShmServer::Handle(const v1::ShmRequest& request, const ShmPeer& peer, v1::ShmResponse* response,
                       std::vector<int>* fds, std::vector<UniqueFd>* leases,
                       std::vector<std::shared_ptr<const MappedFile>>* keep) {
  absl::Status status;
  switch (request.request_case()) {
    case v1::ShmRequest::kListCheckpoints: {
      // As the gRPC listing: a followed checkpoint says how it stands against its upstream.
      const PullStats pulls = puller_ != nullptr ? puller_->Stats() : PullStats{};
      for (const auto& version : registry_->List()) {
        v1::CheckpointInfo* info = response->mutable_list_checkpoints()->add_checkpoints();
        ToProto(*version, info);
        AddFollowing(pulls, info);
      }
      break;
    }
    case v1::ShmRequest::kGetCheckpoint: {
      if (puller_ != nullptr) {
        if (absl::Status pulled = puller_->Pull(request.get_checkpoint().name()).status(); !pulled.ok()) {
          status = pulled;
          break;
        }
      }
      auto version = registry_->Find(request.get_checkpoint().name());
      if (!version.ok()) {
        status = version.status();
      } else {
        ToProto(**version, response->mutable_checkpoint());
        if (puller_ != nullptr) {
          AddFollowing(puller_->StatsOf(request.get_checkpoint().name()), response->mutable_checkpoint());
        }
      }
      break;
    }
    case v1::ShmRequest::kMapTensors:
      status = MapTensors(request.map_tensors(), peer, response->mutable_map_tensors(), keep);
      if (status.ok()) {
        for (const auto& segment : *keep) fds->push_back(LeaseDescriptor(*segment, leases));
      }
      break;
    default:
      status = absl::InvalidArgumentError("empty or unknown request");
  }
  if (!status.ok()) {
    fds->clear();
    leases->clear();
    keep->clear();
    SetStatus(WithoutPaths(status, options_.hidden_folders), response);
  }
}

absl::Status ShmServer::MapTensors(const v1::MapTensorsRequest& request, const ShmPeer& peer,
                                   v1::MapTensorsResponse* response,
                                   std::vector<std::shared_ptr<const MappedFile>>* segments) {
  if (puller_ != nullptr) WEIGHTSTORE_RETURN_IF_ERROR(puller_->Pull(request.name()).status());
  SelectionLimits limits = options_.selection_limits;
  limits.cancelled = [this] { return stopping_.load(); };
  absl::StatusOr<Resolved> resolved = [&]() -> absl::StatusOr<Resolved> {
    WEIGHTSTORE_ASSIGN_OR_RETURN(
        GateTicket slot, AdmitSelection(selection_gate_, absl::StrCat("unix:uid=", peer.uid), request.selection()));
    return Resolve(*registry_, request.name(), request.selection(), request.version(), limits, request.since_version());
  }();
  if (!resolved.ok()) return resolved.status();
  const Snapshot& snapshot = *resolved->snapshot;
  const Checkpoint& checkpoint = snapshot.checkpoint();
  response->set_name(request.name());
  response->set_version(resolved->version->version());
  if (resolved->apply_result) ToProto(*resolved->apply_result, response->mutable_apply_result());
  if (!resolved->since_version.empty()) *response->mutable_delta() = resolved->DeltaInfo(0, snapshot.size());
  MappedPatches patches;  // with request.patches: segment 0
  if (request.patches()) {
    PatchesFound found = FindPatches(*registry_, *resolved);
    std::string reason = std::move(found.reason);
    if (found.chain != nullptr && !request.table_only()) {
      absl::StatusOr<MappedPatches> mapped = MapPatches(*cache_, *resolved, *found.chain, request.name());
      if (mapped.ok()) {
        patches = *std::move(mapped);
      } else if (absl::IsResourceExhausted(mapped.status())) {  // the tensors are mapped instead
        reason = absl::StrCat("the element patches do not fit the segment budget (--shm-budget): ",
                              mapped.status().message());
      } else {
        return mapped.status();
      }
    }
    if (response->has_delta()) response->mutable_delta()->set_patch_reason(std::move(reason));
    if (patches.segment != nullptr) segments->push_back(patches.segment);
  }

  const ChecksumCache& checksums = resolved->version->checksums();
  absl::flat_hash_map<const MappedFile*, uint32_t> segment_of;
  absl::flat_hash_map<const MappedFile*, bool> file_allowed;  // MayPassFile, once per file
  std::vector<ServedTensorPlan> derived;                      // tensors to materialize
  // Tensors that go out as their file's filled copy, by file (in file order).
  std::map<size_t, std::vector<CopiedTensor>> copied;
  uint64_t bytes = 0;
  for (size_t i = 0; i < snapshot.size(); ++i) {
    const SnapshotTensor& t = snapshot.tensors()[i];
    const ServedTensorPlan plan = PlanServedTensor(snapshot, t);
    v1::MappedTensor* out = response->add_tensors();
    resolved->Describe(t, out->mutable_info());
    if (out->info().unchanged()) continue;  // the caller keeps what it mapped
    if (auto p = patches.at.find(i); p != patches.at.end()) {
      const auto& [patch, offset] = p->second;
      ToProto(patch, out->mutable_info()->mutable_patch());
      out->set_segment(0);
      out->set_offset(offset);
      bytes += patch.body.size();
      continue;
    }
    bytes += plan.byte_size;
    if (request.table_only()) {
      if (!request.skip_checksums()) {
        WEIGHTSTORE_ASSIGN_OR_RETURN(uint32_t crc, ServedChecksum(snapshot, plan, checksums));
        out->mutable_info()->set_crc32c(crc);
      }
      continue;
    }
    std::optional<FileExtent> extent;
    if (plan.is_byte_range()) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes view, ReadServedView(snapshot, plan));
      extent = checkpoint.Locate(view);
    }
    if (!extent) {
      derived.push_back(plan);
      continue;
    }
    const std::shared_ptr<const MappedFile>& file = checkpoint.files()[extent->file];
    if (!MayPassFile(*file, peer, &file_allowed)) {  // a copy instead
      // A copy keeps the file's offsets, so a tensor the file does not align
      // to its element (hand-written SafeTensors) is materialized aligned instead.
      const uint64_t unit = DTypeSize(t.spec.dtype);
      const uint64_t element = std::has_single_bit(unit) ? std::min<uint64_t>(unit, 8) : 1;
      if (filled_copies_ && extent->offset % element == 0) {
        copied[extent->file].push_back({i, {extent->offset, plan.byte_size}, plan});
      } else {
        derived.push_back(plan);
      }
      continue;
    }
    auto [it, added] = segment_of.try_emplace(file.get(), static_cast<uint32_t>(segments->size()));
    if (added) segments->push_back(file);
    out->set_segment(it->second);
    out->set_offset(extent->offset);
    if (!request.skip_checksums()) {
      WEIGHTSTORE_ASSIGN_OR_RETURN(uint32_t crc, ServedChecksum(snapshot, plan, checksums));
      out->mutable_info()->set_crc32c(crc);
    }
  }
  // Each file copied is one more descriptor: past what a frame carries, the
  // copies are materialized with the derived tensors into one segment.
  if (segments->size() + copied.size() + 1 > kMaxFdsPerFrame) {
    for (auto& [file_index, tensors] : copied) {
      for (CopiedTensor& t : tensors) derived.push_back(t.plan);
    }
    copied.clear();
  }
  for (auto& [file_index, tensors] : copied) {
    std::vector<std::optional<uint32_t>> crcs;
    absl::StatusOr<std::shared_ptr<const MappedFile>> copy = FillFileCopy(
        *cache_, *resolved, *checkpoint.files()[file_index], file_index, tensors, [this] { return stopping_.load(); },
        &crcs);
    // An older kernel, or a file's copy that has filled the budget: these
    // tensors are materialized with the derived ones, in a segment of their own.
    const bool unsupported = absl::IsUnimplemented(copy.status());
    if (unsupported || absl::IsResourceExhausted(copy.status())) {
      if (unsupported && filled_copies_.exchange(false)) {
        Log(LogLevel::kWarning, "socket copies are made per request, sealed whole",
            {{"error", std::string(copy.status().message())}});
      }
      for (CopiedTensor& t : tensors) derived.push_back(t.plan);
      continue;
    }
    if (!copy.ok()) return copy.status();
    const uint32_t index = static_cast<uint32_t>(segments->size());
    segments->push_back(*copy);
    for (size_t k = 0; k < tensors.size(); ++k) {
      const CopiedTensor& t = tensors[k];
      v1::MappedTensor* out = response->mutable_tensors(static_cast<int>(t.index));
      out->set_segment(index);
      out->set_offset(t.range.offset);
      if (request.skip_checksums()) continue;
      // The copy's, where this request copied it; else the version's, computed once.
      uint32_t crc = 0;
      if (crcs[k]) {
        crc = *crcs[k];
      } else {
        WEIGHTSTORE_ASSIGN_OR_RETURN(crc, ServedChecksum(snapshot, t.plan, checksums));
      }
      out->mutable_info()->set_crc32c(crc);
    }
  }
  if (!derived.empty()) {
    // One segment for everything materialized, keyed by the checkpoint, its
    // version and files as opened, and the plans' keys (a version id alone may
    // name two checkpoints: an origin's release tag, a content digest); the
    // checksums go to the version's cache as it is filled.
    const CheckpointVersion& version = *resolved->version;
    std::string key =
        absl::StrCat(version.name().size(), ":", version.name(), "|", version.version(), "|", version.file_version());
    std::vector<uint64_t> offsets;
    uint64_t size = 0;
    for (const ServedTensorPlan& plan : derived) {
      absl::StrAppend(&key, "|", plan.key);
      size = (size + kAlignment - 1) / kAlignment * kAlignment;
      offsets.push_back(size);
      size += plan.byte_size;
    }
    // Written by pwrite, a staging buffer at a time (no page of the segment is
    // mapped, so none faults), the CRC32C of each tensor taken on the way. Two
    // workers take the tensors in turn, so one materializes while the other's
    // bytes are copied into the segment.
    auto fill = [&](SegmentWriter& writer) -> absl::Status {
      std::atomic<bool> failed{false};
      auto work = [&](size_t first, size_t step) -> absl::Status {
        std::vector<std::byte> staging;
        for (size_t k = first; k < derived.size() && !failed; k += step) {
          const ServedTensorPlan& plan = derived[k];
          uint32_t crc = 0;
          if (plan.is_byte_range()) {  // stored bytes a peer may not map: copied as they are
            WEIGHTSTORE_ASSIGN_OR_RETURN(SharedBytes view, ReadServedView(snapshot, plan));
            crc = Crc32c(view.view());
            WEIGHTSTORE_RETURN_IF_ERROR(writer.Write(offsets[k], view.span()));
          } else {
            // A transposed tensor in whole rows of its served matrix, which
            // are produced by tiles (Snapshot::ReadRange).
            staging.resize(std::min<uint64_t>(ServedPieceBytes(plan, kStagingBytes), plan.byte_size));
            for (uint64_t at = 0; at < plan.byte_size; at += staging.size()) {
              const std::span<std::byte> chunk(staging.data(), std::min<uint64_t>(staging.size(), plan.byte_size - at));
              WEIGHTSTORE_RETURN_IF_ERROR(MaterializeServed(snapshot, plan, at, chunk));
              crc = Crc32cExtend(crc, absl::string_view(reinterpret_cast<const char*>(chunk.data()), chunk.size()));
              WEIGHTSTORE_RETURN_IF_ERROR(writer.Write(offsets[k] + at, chunk));
            }
          }
          if (!checksums.Find(plan.key)) WEIGHTSTORE_RETURN_IF_ERROR(checksums.Store(plan.key, crc));
        }
        return absl::OkStatus();
      };
      auto run = [&](size_t first, size_t step) {
        absl::Status status = work(first, step);
        if (!status.ok()) failed = true;
        return status;
      };
      absl::Status helped;
      std::thread helper;
      size_t workers = derived.size() > 1 && std::thread::hardware_concurrency() > 1 ? 2 : 1;
      if (workers == 2) {
        try {
          helper = std::thread([&] { helped = run(1, 2); });
        } catch (const std::system_error&) {  // no thread to be had (a pids limit): one worker
          workers = 1;
        }
      }
      absl::Status mine = run(0, workers);
      if (helper.joinable()) helper.join();
      // Checksums cached earlier vouch for the file as opened: so must these
      // bytes, or the segment is not kept. A file truncated under a write from
      // its mapping fails it with EFAULT: then this names the real cause.
      WEIGHTSTORE_RETURN_IF_ERROR(checksums.CheckUnchanged());
      WEIGHTSTORE_RETURN_IF_ERROR(mine);
      return helped;
    };
    absl::StatusOr<std::shared_ptr<const MappedFile>> segment = cache_->GetOrCreate(
        key, size, absl::StrCat(request.name(), ": ", derived.size(), " materialized tensors"), fill);
    if (!segment.ok()) return segment.status();
    const uint32_t index = static_cast<uint32_t>(segments->size());
    segments->push_back(*segment);
    for (size_t k = 0; k < derived.size(); ++k) {
      const size_t i = static_cast<size_t>(derived[k].tensor - snapshot.tensors().data());
      v1::MappedTensor* out = response->mutable_tensors(static_cast<int>(i));
      out->set_segment(index);
      out->set_offset(offsets[k]);
      if (request.skip_checksums()) continue;
      // Cached when this request (or an earlier one) filled the segment; else
      // read back from it, which is what the client maps.
      std::optional<uint32_t> crc = checksums.Find(derived[k].key);
      if (!crc) {
        crc = Crc32c((*segment)->bytes().Subspan(offsets[k], derived[k].byte_size).view());
        WEIGHTSTORE_RETURN_IF_ERROR(checksums.Store(derived[k].key, *crc));
      }
      out->mutable_info()->set_crc32c(*crc);
    }
  }
  if (segments->size() > kMaxFdsPerFrame) {
    return absl::FailedPreconditionError(absl::StrCat("'", request.name(), "' spans ", segments->size(),
                                                      " files; at most ", kMaxFdsPerFrame, " can be passed at once"));
  }
  // Checksums and materialized bytes vouch for the files as opened.
  WEIGHTSTORE_RETURN_IF_ERROR(resolved->version->CheckUnchanged());
  // Each segment's window: the pages its tensors lie in.
  static const uint64_t kPageBytes = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<std::pair<uint64_t, uint64_t>> window(segments->size(), {UINT64_MAX, 0});
  for (const v1::MappedTensor& t : response->tensors()) {
    // A table has no segments; an unchanged tensor has none either.
    if (request.table_only() || t.info().unchanged() || t.segment() >= window.size()) continue;
    auto& [begin, end] = window[t.segment()];
    begin = std::min(begin, t.offset());
    end = std::max(end, t.offset() + (t.info().has_patch() ? t.info().patch().patch_bytes() : t.info().byte_size()));
  }
  for (size_t i = 0; i < segments->size(); ++i) {
    const std::shared_ptr<const MappedFile>& segment = (*segments)[i];
    v1::Segment* s = response->add_segments();
    if (CheckSealed(segment->fd(), segment->path()).ok()) {
      s->set_kind(v1::Segment::SEALED_MEMFD);
    } else if (CheckFilledSeals(segment->fd(), segment->path()).ok()) {
      s->set_kind(v1::Segment::FILLED_MEMFD);
    } else {
      s->set_kind(v1::Segment::FILE);
    }
    s->set_size(segment->size());
    s->set_description(segment->path());
    const auto [begin, end] = window[i];
    const uint64_t map_offset = begin == UINT64_MAX ? 0 : begin / kPageBytes * kPageBytes;
    if (begin != UINT64_MAX && (map_offset > 0 || end < segment->size())) {
      s->set_map_offset(map_offset);
      s->set_map_size(end - map_offset);
    }
  }
  if (!request.table_only()) bytes_mapped_ += bytes;
  return absl::OkStatus();
}

}  // namespace weightstore::server
