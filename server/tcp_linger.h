// Lets a stopping server's last bytes reach its clients.
//
// gRPC counts a call finished once its last bytes are in the kernel, and its
// Shutdown() closes a connection as soon as no call is left on it. If the
// client's window updates then sit unread in the socket, the kernel resets the
// connection and drops what it still had queued: the client loses the tail of
// a stream the server counts as complete (seen in CI as "recvmsg: Connection
// reset by peer" one tensor before the end). So a stopping server first lets
// its calls finish, then waits for their bytes to be acknowledged, and only
// then shuts gRPC down.
#ifndef WEIGHTSTORE_SERVER_TCP_LINGER_H_
#define WEIGHTSTORE_SERVER_TCP_LINGER_H_

#include <chrono>
#include <cstddef>

namespace weightstore::server {

// Bytes written to this process's TCP connections on `local_port` (those a
// listener on that port accepted) that the peers have not acknowledged yet
// (SIOCOUTQ, summed).
size_t UnacknowledgedTcpBytes(int local_port);

// Polls until UnacknowledgedTcpBytes(local_port) is 0 or `deadline` passes.
// Returns whether every byte was acknowledged.
bool WaitForPeersToAcknowledge(int local_port, std::chrono::system_clock::time_point deadline);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_TCP_LINGER_H_
