"""torch 2.13 as the judge of weightstore's casts (issue 27), over every store:

- every value of every float dtype (all 256 codes of the F8 family, all 65,536
  of F16 and BF16, a million random F32 bit patterns with the edges) cast to
  F32, F16 and BF16 is bit for bit what torch's .to() gives, NaN payloads
  aside;
- F32, F16 and BF16 narrowed into F8_E4M3, F8_E5M2 and their FNUZ variants
  likewise (torch saturates E4M3FN and turns FNUZ overflow into NaN);
- F4 (torch's float4_e2m1fn_x2, which torch cannot cast) decodes to the OCP MX
  values, the first element in the low nibble, and F8_E8M0 scales decode to
  powers of two: never their raw bytes (vllm#43416).

Needs a running weightstored: WS_ADDRESS, WS_SOCKET, WS_MODELS (writable: the
files go under dtypes/, and the daemon is asked to rescan)."""
import os
import unittest

import numpy as np
import torch

import safetensors.torch
import weightstore

from _support import rescan

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]
FOLDER = "dtypes"
F8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
      "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "F8_E8M0": torch.float8_e8m0fnu}
WIDE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
OCP_F4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def bits(t):
    """A tensor's bits as integers, NaNs of either sign made one value."""
    ints = t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int64)
    nan = torch.isnan(t.float()) if t.dtype not in F8.values() else torch.isnan(t.to(torch.float32))
    return torch.where(nan, torch.full_like(ints, -1), ints)


def f32_cases():
    """A million random F32 bit patterns and the edges of every F8 type."""
    g = torch.Generator().manual_seed(27)
    random = torch.randint(-2**31, 2**31, (1 << 20,), dtype=torch.int64, generator=g).to(torch.int32)
    edges = torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 479.0, 480.0, 240.0, 247.0, 248.0, 256.0, 57344.0, 61439.0,
                          61440.0, 65536.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-9, 2.0**-17, 2.0**-18, 2.0**-16 * 1.5,
                          float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 3.4e38], dtype=torch.float32)
    return torch.cat([random.view(torch.float32), edges, -edges])


class CastsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        folder = os.path.join(MODELS, FOLDER)
        os.makedirs(folder, exist_ok=True)
        every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        every_half = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
        cls.sources = {name: every_byte.clone().view(dtype) for name, dtype in F8.items()}
        cls.sources["F16"] = every_half.view(torch.float16)
        cls.sources["BF16"] = every_half.clone().view(torch.bfloat16)
        cls.sources["F32"] = f32_cases()
        cls.sources["F4"] = every_byte.clone().view(torch.float4_e2m1fn_x2)  # every pair of codes
        safetensors.torch.save_file({k.lower(): v for k, v in cls.sources.items()},
                                    os.path.join(folder, "every.safetensors"))
        rescan()
        cls.stores = {"grpc": weightstore.connect(ADDRESS), "socket": weightstore.connect("unix:" + SOCKET),
                      "local": weightstore.connect("file:" + MODELS)}

    def fetch(self, store, dtype, names):
        return store.tensors(f"{FOLDER}/every", paths=[n.lower() for n in names], dtype=dtype)

    def test_every_float_value_casts_to_f32_f16_and_bf16_as_torch_does(self):
        wide_sources = [n for n in self.sources if n != "F4"]
        for label, store in self.stores.items():
            for target, torch_target in WIDE.items():
                got = self.fetch(store, target.lower(), wide_sources)
                for name in wide_sources:
                    with self.subTest(transport=label, source=name, target=target):
                        want = self.sources[name].to(torch_target)
                        self.assertEqual(got[name.lower()].dtype, torch_target)
                        self.assertTrue(torch.equal(bits(got[name.lower()]), bits(want)))

    def test_wide_floats_narrow_into_every_f8_type_as_torch_does(self):
        for label, store in self.stores.items():
            for target in ("F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"):
                got = self.fetch(store, target.lower(), list(WIDE))
                for name in WIDE:
                    with self.subTest(transport=label, source=name, target=target):
                        want = self.sources[name].to(F8[target])
                        self.assertEqual(got[name.lower()].dtype, F8[target])
                        self.assertTrue(torch.equal(bits(got[name.lower()]), bits(want)))

    def test_f4_decodes_to_the_ocp_values_low_nibble_first(self):
        want = torch.tensor([[OCP_F4[b & 0xF], OCP_F4[b >> 4]] for b in range(256)]).reshape(-1)
        for label, store in self.stores.items():
            for target, torch_target in WIDE.items():
                with self.subTest(transport=label, target=target):
                    got = self.fetch(store, target.lower(), ["F4"])["f4"]
                    self.assertEqual(tuple(got.shape), (512,))
                    self.assertTrue(torch.equal(bits(got), bits(want.to(torch_target))))

    def test_e8m0_scales_decode_to_powers_of_two_never_their_bytes(self):
        got = self.fetch(self.stores["grpc"], "f32", ["F8_E8M0"])["f8_e8m0"]
        codes = np.arange(255)
        self.assertTrue(np.array_equal(got[:255].numpy(), np.ldexp(1.0, codes - 127).astype(np.float32)))
        self.assertTrue(torch.isnan(got[255]))
        self.assertFalse(torch.equal(got[:255], torch.arange(255, dtype=torch.float32)))  # the raw bytes

    def test_a_cast_torch_does_not_define_is_refused_naming_the_dtypes(self):
        for label, store in self.stores.items():
            with self.subTest(transport=label):
                with self.assertRaises(weightstore.Error) as e:
                    self.fetch(store, "f8_e8m0", ["F32"])
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn("F8_E8M0", e.exception.message)
                with self.assertRaises(weightstore.Error) as e:
                    self.fetch(store, "f8_e4m3", ["F4"])  # from F4: through bf16 first
                self.assertIn("cannot cast F4 to F8_E4M3", e.exception.message)


if __name__ == "__main__":
    unittest.main(verbosity=2)
