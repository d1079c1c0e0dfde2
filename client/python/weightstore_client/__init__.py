"""weightstore's Python client: list, inspect and load model weights from a
running weightstored, into numpy arrays or torch tensors.

Two transports, one interface:

    RemoteClient("host:50051")        gRPC (any host); bytes are copied once,
                                      into the arrays returned
    SocketClient("/run/ws.sock")      the same-host socket; tensors are read-only
                                      views into the daemon's shared mappings,
                                      nothing is copied

Both take burn-store's selection as keyword arguments (include=, exclude=,
paths=, renames=[(pattern, replacement)], top_level_key=, contiguous_indices=,
adapter=, dtype=) and offer:

    list_checkpoints()                -> [Checkpoint]
    get_checkpoint(name)              -> Checkpoint
    list_tensors(name, **selection)   -> [TensorInfo]
    fetch(name, as_="torch"|"numpy", **selection) -> {name: tensor}
    load_into(module, name, allow_partial=False, **selection) -> LoadResult

Pure Python over Debian's python3-grpcio, python3-numpy and python3-torch
(torch is imported only when asked for torch tensors).
"""
from weightstore_client.client import (Checkpoint, LoadResult, RemoteClient, SocketClient, TensorInfo,
                                       WeightStoreError)

__all__ = ["Checkpoint", "LoadResult", "RemoteClient", "SocketClient", "TensorInfo", "WeightStoreError"]
