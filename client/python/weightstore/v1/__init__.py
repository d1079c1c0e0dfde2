"""weightstore's gRPC API (weight_store_pb2, shm_pb2 and their _grpc stubs),
generated from proto/weightstore/v1 by the build."""
