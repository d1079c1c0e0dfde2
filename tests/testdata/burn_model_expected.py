"""What burn-store's model tests expect, computed with real PyTorch.

Usage: burn_model_expected.py FIXTURES_DIR OUT.json

For each case, the tensors a Burn model receives: names after remapping and
index mapping, values after adapters (Linear weights transposed, norm
weight/bias as gamma/beta) and casts, each as {"dtype", "shape", "sha256"} of
the C-contiguous bytes. Also writes OUT_DIR/casts.pt: random F32/F64 values
with torch's and numpy's conversions, for comparing our casts bit for bit.
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch

DT = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64"}


def describe(t):
    t = t.detach().contiguous()
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return {"dtype": DT[t.dtype], "shape": list(t.shape), "sha256": hashlib.sha256(raw).hexdigest()}


def main():
    fixtures, out = sys.argv[1], sys.argv[2]
    load = lambda name: torch.load(os.path.join(fixtures, "burn", "pytorch-models", name), map_location="cpu")
    cases = {}
    sd = load("linear.pt")
    cases["linear"] = {"fc1.weight": sd["fc1.weight"].t(), "fc1.bias": sd["fc1.bias"], "fc2.weight": sd["fc2.weight"].t()}
    cases["linear_f16"] = {k: v.half() for k, v in cases["linear"].items()}
    sd = load("linear_with_bias.pt")
    cases["linear_with_bias"] = {"fc1.weight": sd["fc1.weight"].t(), "fc1.bias": sd["fc1.bias"]}
    sd = load("batch_norm2d.pt")
    cases["batch_norm"] = {"norm1.gamma": sd["norm1.weight"], "norm1.beta": sd["norm1.bias"],
                           "norm1.running_mean": sd["norm1.running_mean"], "norm1.running_var": sd["norm1.running_var"]}
    for case, name in [("layer_norm", "layer_norm.pt"), ("group_norm", "group_norm.pt")]:
        sd = load(name)
        cases[case] = {"norm1.gamma": sd["norm1.weight"], "norm1.beta": sd["norm1.bias"]}
    sd = load("key_remap.pt")
    cases["key_remap"] = {k[len("conv."):]: v for k, v in sd.items()}
    sd = load("non_contiguous_indexes.pt")
    order = sorted({int(k.split(".")[1]) for k in sd})
    cases["non_contiguous_indexes"] = {f"fc.{order.index(int(k.split('.')[1]))}.{k.split('.')[2]}": v for k, v in sd.items()}
    sd = load("top_level_key.pt")["my_state_dict"]
    cases["top_level_key"] = dict(sd)
    json.dump({case: {k: describe(v) for k, v in tensors.items()} for case, tensors in cases.items()},
              open(out, "w"), indent=1, sort_keys=True)

    torch.manual_seed(3)
    x = torch.cat([torch.randn(4000) * 10, torch.randn(1000) * 1e-6, torch.randn(500) * 1e5,
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 65504.0, 65520.0, 6e-8, 3e-8])])
    y = torch.randn(3000, dtype=torch.float64) * 100
    casts = {"f32": x, "f32_to_f16": x.half(), "f32_to_bf16": x.bfloat16(), "f32_to_f64": x.double(),
             "f64": y, "f64_to_f32": y.float(), "f64_to_f16_numpy": torch.from_numpy(y.numpy().astype(np.float16)),
             "f16_to_f32": x.half().float(), "bf16_to_f32": x.bfloat16().float()}
    torch.save(casts, os.path.join(os.path.dirname(out), "casts.pt"))


if __name__ == "__main__":
    main()
