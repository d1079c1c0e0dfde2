"""PyTorch side of core_bench: writes .pt checkpoints and times torch.load.

  torch_helper.py write PATH MEGABYTES   writes a state dict of 64 equal F32 tensors
  torch_helper.py load PATH REPEATS      prints the median torch.load seconds
"""
import statistics
import sys
import time

import torch


TENSORS = 64  # as core_bench's SafeTensors files


def write(path, megabytes):
    torch.manual_seed(0)
    numel = megabytes * (1 << 20) // 4 // TENSORS
    torch.save({f"layers.{i}.weight": torch.randn(numel) for i in range(TENSORS)}, path)


def load(path, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state = torch.load(path, map_location="cpu")
        times.append(time.perf_counter() - start)
        del state
    print(f"{statistics.median(times):.6f}")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]))
    else:
        load(sys.argv[2], int(sys.argv[3]))
