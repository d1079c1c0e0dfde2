// PutCheckpoint and PushCheckpoint: client streams that write a new checkpoint
// or version, committed only by their last message.
#ifndef WEIGHTSTORE_SERVER_UPLOADS_H_
#define WEIGHTSTORE_SERVER_UPLOADS_H_

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_callback.h>

#include "server/serving.h"
#include "weightstore/v1/weight_store.pb.h"

namespace weightstore::server {

// Receives an upload of a checkpoint file (admin scope, a slot of the uploads
// gate, watched for stalling), stored by its commit message; `response`
// describes what was stored.
grpc::ServerReadReactor<v1::PutCheckpointRequest>* ReceivePut(const Serving& serving, grpc::CallbackServerContext* ctx,
                                                              v1::CheckpointInfo* response);
// Receives a push of a new version (tensors whole or as element patches of
// the base), published all or nothing by its commit message.
grpc::ServerReadReactor<v1::PushCheckpointRequest>* ReceivePush(const Serving& serving,
                                                                grpc::CallbackServerContext* ctx,
                                                                v1::CheckpointInfo* response);

}  // namespace weightstore::server

#endif  // WEIGHTSTORE_SERVER_UPLOADS_H_
