// How the client opens gRPC channels to a weightstored, for code besides the
// Store that talks to one (the origin tier's upstream reads).
#ifndef WEIGHTSTORE_CLIENT_CHANNEL_H_
#define WEIGHTSTORE_CLIENT_CHANNEL_H_

#include <grpcpp/channel.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/store.h"

namespace weightstore::client {

// Returns a function that opens a new channel to `address` with `options`' TLS
// settings, each on a connection of its own. InvalidArgument / NotFound for
// unreadable TLS files. The token is not part of the channel: send it per call.
absl::StatusOr<std::function<std::shared_ptr<grpc::Channel>()>> ChannelMaker(const std::string& address,
                                                                             const RemoteOptions& options);

}  // namespace weightstore::client

#endif  // WEIGHTSTORE_CLIENT_CHANNEL_H_
