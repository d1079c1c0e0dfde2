// FetchTensors' stream: one response, one chunk in flight at a time, each
// served-tensor plan (or its element patch) framed by the chunk codec
// (proto/codec/chunk_codec.h) with payloads that are slices of the mapping.
#ifndef WEIGHTSTORE_SERVER_FETCH_STREAM_H_
#define WEIGHTSTORE_SERVER_FETCH_STREAM_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>

#include "server/serving.h"

namespace weightstore::server {

// Streams the FetchTensors response to `request` (raw): admitted as a
// serving stream (or, while its checkpoint is pulled, a waiting one), watched
// for stalling, its selection resolved by `serving.resolve_async`.
grpc::ServerWriteReactor<grpc::ByteBuffer>* StreamTensors(const Serving& serving, grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_FETCH_STREAM_H_
