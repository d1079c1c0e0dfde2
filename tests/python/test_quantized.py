"""Quantization-aware shards (issue 27) against numpy slicing of the same
bytes, over every store (gRPC, the daemon's socket, local files):

- block FP8 (DeepSeek-V3): F8_E4M3 weights and an F32 `weight_scale_inv` per
  128 x 128, a rank's rows ending inside a block sharing it;
- NVFP4 (ModelOpt): U8 packed pairs, F8_E4M3 scales per 16 values, F32
  global and input scales (replicated);
- MXFP4: I8 packed pairs with F8_E8M0 scales per 32 values (DeepSeek-V4's
  routed experts), and F4 itself with F8_E8M0 scales;
- gpt-oss: U8 `_blocks` [E, out, groups, 16] with U8 `_scales` [E, out,
  groups], the experts stacked (expert parallel along dimension 0);
- experts one per tensor, rank r of N getting [r E / N, (r + 1) E / N).

Each scale is found by its standard name, and the listing says whose scale it
is and whether a block is shared. Needs a running weightstored: WS_ADDRESS,
WS_SOCKET, WS_MODELS (writable: files go under quantized/)."""
import os
import unittest

import numpy as np
import torch

import safetensors.torch
import weightstore

from _support import random_bits, rescan

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]
FOLDER = "quantized"


def stored_bytes(t):
    """A stored tensor's bytes as numpy uint8, its last dimension in bytes."""
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return flat.reshape(tuple(t.shape[:-1]) + (-1,)) if t.dim() else flat


def cut(t, ranges, served_per_byte=1):
    """The bytes of stored tensor `t` in `ranges` (one (start, stop) per
    dimension, in served elements; `served_per_byte` served elements a byte:
    2 for F4) concatenated as a slice serves them."""
    data = stored_bytes(t)
    if t.dim() == 0:
        return data
    per = data.shape[-1] // (t.shape[-1] * (2 if t.dtype == torch.float4_e2m1fn_x2 else 1))
    index = [slice(a, b) for a, b in ranges[:-1]]
    a, b = ranges[-1]
    if t.dtype == torch.float4_e2m1fn_x2:
        index.append(slice(a // 2, b // 2))
    else:
        index.append(slice(a * per, b * per))
    return data[tuple(index)]


def even(size, rank, world):
    return (rank * size // world, (rank + 1) * size // world)


def blocks(weight_range, block, size):
    a, b = weight_range
    return (a // block, -(-b // block)), (a % block != 0 or (b % block != 0 and b != size))


def got_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class QuantizedShardsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        g = torch.Generator().manual_seed(27)
        folder = os.path.join(MODELS, FOLDER)
        os.makedirs(folder, exist_ok=True)
        cls.files = {
            "fp8_block": {"l.weight": random_bits((300, 256), torch.float8_e4m3fn, g),
                          "l.weight_scale_inv": torch.rand(3, 2, generator=g)},
            "nvfp4": {"p.weight": random_bits((64, 32), torch.uint8, g),
                      "p.weight_scale": random_bits((64, 4), torch.float8_e4m3fn, g),
                      "p.weight_scale_2": torch.tensor(0.5), "p.input_scale": torch.tensor(2.0)},
            "mxfp4_i8": {"e.weight": random_bits((64, 48), torch.int8, g),
                         "e.scale": random_bits((64, 3), torch.float8_e8m0fnu, g)},
            "mxfp4_f4": {"f.weight": random_bits((64, 32), torch.float4_e2m1fn_x2, g),
                         "f.weight_scale": random_bits((64, 2), torch.float8_e8m0fnu, g)},
            "gpt_oss": {"mlp.experts.down_proj_blocks": random_bits((4, 8, 2, 16), torch.uint8, g),
                        "mlp.experts.down_proj_scales": random_bits((4, 8, 2), torch.uint8, g),
                        "mlp.router.weight": torch.rand(4, 8, generator=g)},
            "moe": {**{f"layers.{l}.experts.{e}.w": random_bits((6,), torch.bfloat16, g)
                       for l in range(2) for e in range(8)},
                    "layers.0.gate.weight": torch.rand(8, 6, generator=g)},
        }
        for name, tensors in cls.files.items():
            safetensors.torch.save_file(tensors, os.path.join(folder, name + ".safetensors"))
        rescan()
        cls.stores = {"grpc": weightstore.connect(ADDRESS), "socket": weightstore.connect("unix:" + SOCKET),
                      "local": weightstore.connect("file:" + MODELS)}

    def check(self, file, weight, scale, dim, blocks_of, world, served_per_byte=1, rule=None):
        """Every rank's weight and scale bytes against numpy's cut of them."""
        w, s = self.files[file][weight], self.files[file][scale]
        served_shape = list(w.shape)
        if w.dtype == torch.float4_e2m1fn_x2:
            served_shape[-1] *= 2
        for label, store in self.stores.items():
            for rank in range(world):
                with self.subTest(file=file, transport=label, rank=rank, world=world):
                    query = dict(shard=(rank, world, {rule or f"^{weight}$": dim}))
                    got = store.tensors(f"{FOLDER}/{file}", **query)
                    w_ranges = [(0, n) for n in served_shape]
                    w_ranges[dim] = even(served_shape[dim], rank, world)
                    self.assertTrue(np.array_equal(got_bytes(got[weight]), cut(w, w_ranges).reshape(-1)))
                    s_ranges = [(0, n) for n in s.shape]
                    shared = False
                    if dim < s.dim():
                        s_ranges[dim], shared = blocks(w_ranges[dim], blocks_of[dim], served_shape[dim])
                    self.assertTrue(np.array_equal(got_bytes(got[scale]), cut(s, s_ranges).reshape(-1)))
                    info = {t.name: t for t in store.describe(f"{FOLDER}/{file}", **query)}
                    self.assertEqual(info[scale].scale_of, weight)
                    self.assertEqual(info[scale].shares_scale_blocks, shared)

    def test_block_fp8_scales_follow_rows_and_columns_sharing_a_cut_block(self):
        for world in (2, 4):
            self.check("fp8_block", "l.weight", "l.weight_scale_inv", 0, (128, 128), world)
        self.check("fp8_block", "l.weight", "l.weight_scale_inv", 1, (128, 128), 2)

    def test_nvfp4_scale_groups_follow_the_packed_bytes_and_global_scales_are_replicated(self):
        for world in (2, 4):
            self.check("nvfp4", "p.weight", "p.weight_scale", 1, (1, 8), world)
            self.check("nvfp4", "p.weight", "p.weight_scale", 0, (1, 8), world)
        for label, store in self.stores.items():
            got = store.tensors(f"{FOLDER}/nvfp4", shard=(1, 4, {r"^p\.weight$": 1}))
            self.assertEqual(got["p.weight_scale_2"].item(), 0.5, label)
            self.assertEqual(got["p.input_scale"].item(), 2.0, label)

    def test_mxfp4_e8m0_scales_follow_i8_and_f4_weights(self):
        self.check("mxfp4_i8", "e.weight", "e.scale", 1, (1, 16), 2)  # 32 values: 16 bytes
        self.check("mxfp4_i8", "e.weight", "e.scale", 1, (1, 16), 4)  # 12 bytes a rank: blocks shared
        self.check("mxfp4_f4", "f.weight", "f.weight_scale", 1, (1, 32), 2)  # F4: values, two a byte
        self.check("mxfp4_f4", "f.weight", "f.weight_scale", 0, (1, 32), 4)

    def test_gpt_oss_stacked_experts_go_to_their_rank_with_their_scales(self):
        for world in (2, 4):
            self.check("gpt_oss", "mlp.experts.down_proj_blocks", "mlp.experts.down_proj_scales", 0, (1, 1, 1), world,
                       rule=r"_blocks$")

    def test_experts_stored_one_per_tensor_go_to_their_rank(self):
        for label, store in self.stores.items():
            for rank in range(4):
                with self.subTest(transport=label, rank=rank):
                    got = store.tensors(f"{FOLDER}/moe", shard=(rank, 4, {}), shard_experts=[r"experts\.(\d+)\."])
                    want = {f"layers.{l}.experts.{e}.w" for l in range(2) for e in (2 * rank, 2 * rank + 1)}
                    self.assertEqual(set(got), want | {"layers.0.gate.weight"})
                    for name in want:
                        self.assertTrue(torch.equal(got[name].view(torch.int16),
                                                    self.files["moe"][name].view(torch.int16)))

    def test_an_f4_shard_that_would_split_a_byte_is_refused_naming_the_tensor(self):
        for label, store in self.stores.items():
            with self.assertRaises(weightstore.Error) as e:
                store.tensors(f"{FOLDER}/mxfp4_f4", shard=(0, 3, {r"^f\.weight$": 1}))  # 64 values in 3
            self.assertEqual(e.exception.code, "INVALID_ARGUMENT", label)
            self.assertIn("'f.weight'", e.exception.message)


if __name__ == "__main__":
    unittest.main(verbosity=2)
