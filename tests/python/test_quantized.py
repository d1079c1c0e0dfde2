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
is and whether a block is shared. A quantization config beside a checkpoint
(hf_quant_config.json, config.json's quantization_config) gives the blocks
when it has them, and the listing shows it. Needs a running weightstored: WS_ADDRESS,
WS_SOCKET, WS_MODELS (writable: files go under quantized/)."""
import json
import os
import unittest

import numpy as np
import torch

import safetensors.torch
import transformers
import weightstore

import grpc
from weightstore.v1 import weight_store_pb2, weight_store_pb2_grpc

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


def rescan_reply():
    with grpc.insecure_channel(ADDRESS) as channel:
        return weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)


class QuantizationConfigTest(unittest.TestCase):
    """Checkpoints in folders of their own, each beside the config a
    quantizer writes."""

    @classmethod
    def setUpClass(cls):
        g = torch.Generator().manual_seed(2701)
        cls.files = {
            # transformers' FineGrainedFP8 layout with an unusual block: the
            # shapes alone would guess 128 (the smallest power of two giving
            # two blocks of 192 rows); the config says 96.
            "cfg_fp8": ({"l.weight": random_bits((192, 192), torch.float8_e4m3fn, g),
                         "l.weight_scale_inv": torch.rand(2, 2, generator=g),
                         "lm_head.weight": torch.rand(4, 192, generator=g)},
                        "config.json",
                        # written by transformers' own FineGrainedFP8Config
                        {"architectures": ["X"], "quantization_config": json.loads(
                            transformers.FineGrainedFP8Config(weight_block_size=(96, 96),
                                                              modules_to_not_convert=["lm_head"])
                            .to_json_string(use_diff=False))}),
            # ModelOpt NVFP4: U8 packed pairs, F8_E4M3 scales per 16 values;
            # "q" is excluded, so its U8 weight is not called NVFP4.
            "cfg_nvfp4": ({"model.layers.0.mlp.p.weight": random_bits((64, 32), torch.uint8, g),
                           "model.layers.0.mlp.p.weight_scale": random_bits((64, 4), torch.float8_e4m3fn, g),
                           "model.layers.0.mlp.p.weight_scale_2": torch.tensor(0.5),
                           "model.layers.0.q.weight": random_bits((8, 8), torch.uint8, g),
                           "model.layers.0.q.weight_scale": random_bits((8, 1), torch.float8_e4m3fn, g)},
                          "hf_quant_config.json",
                          {"producer": {"name": "modelopt", "version": "0.40.0"},
                           "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                            "exclude_modules": ["model.layers.*.q", "lm_head"]}}),
            # A config whose blocks the scale's shape does not hold (32 values
            # a scale, where the config says 16).
            "cfg_mismatch": ({"p.weight": random_bits((64, 32), torch.uint8, g),
                              "p.weight_scale": random_bits((64, 2), torch.float8_e4m3fn, g)},
                             "hf_quant_config.json",
                             {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4",
                                                                                "group_size": 16}}),
            "cfg_broken": ({"w": torch.rand(2)}, "config.json", {"quantization_config": "fp8"}),
            "cfg_none": ({"p.weight": random_bits((4, 8), torch.uint8, g),
                          "p.weight_scale": random_bits((4, 1), torch.float8_e4m3fn, g)},
                         "config.json", {"architectures": ["X"]}),
        }
        for name, (tensors, config_name, config) in cls.files.items():
            folder = os.path.join(MODELS, FOLDER, name)
            os.makedirs(folder, exist_ok=True)
            safetensors.torch.save_file(tensors, os.path.join(folder, "model.safetensors"))
            with open(os.path.join(folder, config_name), "w") as f:
                json.dump(config, f)
        cls.reply = rescan_reply()
        cls.stores = {"grpc": weightstore.connect(ADDRESS), "socket": weightstore.connect("unix:" + SOCKET),
                      "local": weightstore.connect("file:" + MODELS)}

    def name(self, folder):
        return f"{FOLDER}/{folder}/model"

    def test_the_configs_block_decides_where_a_rank_cut_ends(self):
        w, s = self.files["cfg_fp8"][0]["l.weight"], self.files["cfg_fp8"][0]["l.weight_scale_inv"]
        for label, store in self.stores.items():
            for rank in range(2):
                with self.subTest(transport=label, rank=rank):
                    query = dict(shard=(rank, 2, {r"^l\.weight$": 0}))
                    got = store.tensors(self.name("cfg_fp8"), **query)
                    rows = even(192, rank, 2)
                    self.assertTrue(np.array_equal(got_bytes(got["l.weight"]), cut(w, [rows, (0, 192)]).reshape(-1)))
                    # Blocks of 96: each rank gets its own row of scales, none shared.
                    self.assertTrue(np.array_equal(got_bytes(got["l.weight_scale_inv"]),
                                                   cut(s, [(rank, rank + 1), (0, 2)]).reshape(-1)))
                    info = {t.name: t for t in store.describe(self.name("cfg_fp8"), **query)}
                    self.assertEqual(info["l.weight_scale_inv"].scale_block, (96, 96))
                    self.assertFalse(info["l.weight_scale_inv"].shares_scale_blocks)
                    self.assertEqual(info["l.weight"].quantization,
                                     "FP8_BLOCK, 8-bit values, blocks of 96x96 (config.json)")
                    self.assertIsNone(info["lm_head.weight"].quantization)

    def test_the_listing_names_the_config_and_the_packed_fp4_weights_it_describes(self):
        for label, store in self.stores.items():
            with self.subTest(transport=label):
                self.assertEqual(store.info(self.name("cfg_nvfp4"))["quantization"],
                                 "NVFP4, 4-bit values, blocks of 1x16 (hf_quant_config.json; 2 modules excluded)")
                info = {t.name: t for t in store.describe(self.name("cfg_nvfp4"))}
                self.assertEqual(info["model.layers.0.mlp.p.weight"].quantization,
                                 "NVFP4, 4-bit values, blocks of 1x16 (hf_quant_config.json)")
                self.assertIsNone(info["model.layers.0.q.weight"].quantization)  # excluded by its glob
                self.assertIsNone(info["model.layers.0.mlp.p.weight_scale"].quantization)
                self.assertIsNone(store.info(self.name("cfg_none"))["quantization"])  # config.json, no quantization
                self.assertIsNone(store.describe(self.name("cfg_none"))[0].quantization)
                # 16 values of a U8 weight are 8 bytes; the global scale is replicated.
                shard = dict(shard=(1, 2, {r"mlp\.p\.weight$": 1}))
                listed = {t.name: t for t in store.describe(self.name("cfg_nvfp4"), **shard)}
                self.assertEqual(listed["model.layers.0.mlp.p.weight_scale"].scale_block, (1, 8))
                got = store.tensors(self.name("cfg_nvfp4"), **shard)
                scale = self.files["cfg_nvfp4"][0]["model.layers.0.mlp.p.weight_scale"]
                self.assertTrue(np.array_equal(got_bytes(got["model.layers.0.mlp.p.weight_scale"]),
                                               cut(scale, [(0, 64), (2, 4)]).reshape(-1)))
                self.assertEqual(got["model.layers.0.mlp.p.weight_scale_2"].item(), 0.5)

    def test_a_scale_that_does_not_hold_the_configs_blocks_is_refused_naming_the_config(self):
        for label, store in self.stores.items():
            with self.subTest(transport=label):
                self.assertEqual(len(store.tensors(self.name("cfg_mismatch"))), 2)  # whole: served as is
                with self.assertRaises(weightstore.Error) as e:
                    store.tensors(self.name("cfg_mismatch"), shard=(0, 2, {r"^p\.weight$": 1}))
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                for part in ("'p.weight_scale'", "'p.weight'", "hf_quant_config.json", "blocks of 8"):
                    self.assertIn(part, e.exception.message)

    def test_a_malformed_config_keeps_its_checkpoint_out_and_says_why(self):
        lines = [line for line in self.reply.not_served if "cfg_broken" in line]
        self.assertEqual(len(lines), 1, list(self.reply.not_served))
        self.assertIn("config.json", lines[0])
        self.assertIn("quantization_config must be an object", lines[0])
        with self.assertRaises(weightstore.Error) as e:
            self.stores["grpc"].info(self.name("cfg_broken"))
        self.assertEqual(e.exception.code, "NOT_FOUND")


if __name__ == "__main__":
    unittest.main(verbosity=2)
