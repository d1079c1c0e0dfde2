// Lets a stopping server's last bytes reach its clients.
//
// gRPC counts a call finished once its last bytes are in the kernel. If the
// process then exits while a peer's window updates sit unread in a socket, the
// kernel answers with a reset and drops whatever it still had queued: the
// client sees the tail of a stream the server counts as complete vanish.
#ifndef WEIGHTSTORE_SERVER_TCP_LINGER_H_
#define WEIGHTSTORE_SERVER_TCP_LINGER_H_

#include <chrono>
#include <cstddef>

namespace weightstore::server {

// Bytes written to this process's connected TCP sockets that their peers have
// not acknowledged yet (SIOCOUTQ, summed over every such socket).
size_t UnacknowledgedTcpBytes();

// Polls until UnacknowledgedTcpBytes() is 0 or `deadline` passes. Returns
// whether every byte was acknowledged.
bool WaitForPeersToAcknowledge(std::chrono::system_clock::time_point deadline);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_TCP_LINGER_H_
