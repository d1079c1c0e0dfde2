"""What several of the package's Python tests share (tests/python/test_*.py).
Imported by name: each test runs as a script from this folder."""
import os

import numpy as np
import torch

import grpc
from weightstore.v1 import weight_store_pb2, weight_store_pb2_grpc


def rescan(address=None):
    """Has the daemon at `address` (default: $WS_ADDRESS) rescan its models folder."""
    with grpc.insecure_channel(address or os.environ["WS_ADDRESS"]) as channel:
        weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)


def random_bits(shape, dtype, generator):
    """A tensor of `dtype` with random bits (NaNs, infinities, subnormals); bools 0/1."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    size = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape)) if shape else 1
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)
