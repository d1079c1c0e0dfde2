"""Writes the tensor-parallel test models with real PyTorch, and what each rank
must receive, computed by torch itself (chunk, cat, to).

usage: make_tp_models.py OUT_DIR

OUT_DIR/models/llama.pt        Llama-style: q/k/v (GQA: k and v are narrower),
                               o, gate/up/down projections, norms, embeddings
OUT_DIR/models/llama_fused.pt  the same with fused qkv_proj and gate_up_proj
OUT_DIR/models/gpt2.pt         GPT-2-style: Conv1D weights stored [in, out],
                               fused c_attn (QKV along dimension 1)
OUT_DIR/models/big.pt          one 32 MiB matrix (the socket's sub-range check)
OUT_DIR/expected/<model>.pt    "n<N>.r<rank>.<name>" -> the rank's tensor, for
                               N in 2, 4, 8; "bf16.n<N>.r<rank>.<name>" -> the
                               same cast to bfloat16
                               and "slice.<name>" -> torch.narrow of the
                               tensor by SLICES
OUT_DIR/rules.json             {"rules": {model: [[regex, "DIM" or "DIMxPARTS"]]},
                                "slices": {model: {name: "[a:b, :]"}}}
"""
import json
import os
import re
import sys

import torch

HIDDEN, INTER, VOCAB, KV, LAYERS = 64, 128, 128, 32, 2

RULES = {
    "llama": [
        [r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$", "0"],
        [r"(o_proj|down_proj)\.weight$", "1"],
        [r"(embed_tokens|lm_head)\.weight$", "0"],
    ],
    "llama_fused": [
        [r"qkv_proj\.weight$", "0x3"],
        [r"gate_up_proj\.weight$", "0x2"],
        [r"(o_proj|down_proj)\.weight$", "1"],
        [r"(embed_tokens|lm_head)\.weight$", "0"],
    ],
    "gpt2": [
        [r"attn\.c_attn\.weight$", "1x3"],
        [r"attn\.c_attn\.bias$", "0x3"],
        [r"(attn|mlp)\.c_proj\.weight$", "0"],
        [r"mlp\.c_fc\.weight$", "1"],
        [r"mlp\.c_fc\.bias$", "0"],
        [r"wte\.weight$", "0"],
    ],
}


# Explicit slices (HF get_slice): name -> [start, stop] per leading dimension
# (None: whole).
SLICES = {
    "llama": {
        "model.embed_tokens.weight": [[8, 40]],
        "model.layers.0.mlp.down_proj.weight": [None, [16, 48]],
        "model.layers.1.self_attn.k_proj.weight": [[3, 5], [10, 60]],
    },
    "gpt2": {"transformer.wpe.weight": [[0, 1]], "transformer.h.1.mlp.c_fc.bias": [[100, 128]]},
}


def slice_text(bounds):
    return "[" + ", ".join(":" if b is None else f"{b[0]}:{b[1]}" for b in bounds) + "]"


def narrow(tensor, bounds):
    for dim, b in enumerate(bounds):
        if b is not None:
            tensor = tensor.narrow(dim, b[0], b[1] - b[0])
    return tensor.contiguous()


def llama(fused):
    sd = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        if fused:
            sd[p + "self_attn.qkv_proj.weight"] = torch.randn(3 * HIDDEN, HIDDEN)
            sd[p + "mlp.gate_up_proj.weight"] = torch.randn(2 * INTER, HIDDEN)
        else:
            sd[p + "self_attn.q_proj.weight"] = torch.randn(HIDDEN, HIDDEN)
            sd[p + "self_attn.k_proj.weight"] = torch.randn(KV, HIDDEN)
            sd[p + "self_attn.v_proj.weight"] = torch.randn(KV, HIDDEN)
            sd[p + "mlp.gate_proj.weight"] = torch.randn(INTER, HIDDEN)
            sd[p + "mlp.up_proj.weight"] = torch.randn(INTER, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = torch.randn(HIDDEN, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = torch.randn(HIDDEN, INTER)
        sd[p + "input_layernorm.weight"] = torch.randn(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = torch.randn(HIDDEN)
    sd["model.norm.weight"] = torch.randn(HIDDEN)
    sd["lm_head.weight"] = torch.randn(VOCAB, HIDDEN)
    return sd


def gpt2():
    sd = {"transformer.wte.weight": torch.randn(VOCAB, HIDDEN), "transformer.wpe.weight": torch.randn(32, HIDDEN)}
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        sd[p + "ln_1.weight"] = torch.randn(HIDDEN)
        sd[p + "ln_1.bias"] = torch.randn(HIDDEN)
        sd[p + "attn.c_attn.weight"] = torch.randn(HIDDEN, 3 * HIDDEN)  # Conv1D: [in, out]
        sd[p + "attn.c_attn.bias"] = torch.randn(3 * HIDDEN)
        sd[p + "attn.c_proj.weight"] = torch.randn(HIDDEN, HIDDEN)
        sd[p + "attn.c_proj.bias"] = torch.randn(HIDDEN)
        sd[p + "ln_2.weight"] = torch.randn(HIDDEN)
        sd[p + "ln_2.bias"] = torch.randn(HIDDEN)
        sd[p + "mlp.c_fc.weight"] = torch.randn(HIDDEN, INTER)
        sd[p + "mlp.c_fc.bias"] = torch.randn(INTER)
        sd[p + "mlp.c_proj.weight"] = torch.randn(INTER, HIDDEN)
        sd[p + "mlp.c_proj.bias"] = torch.randn(HIDDEN)
    sd["transformer.ln_f.weight"] = torch.randn(HIDDEN)
    sd["transformer.ln_f.bias"] = torch.randn(HIDDEN)
    return sd


def shard(name, tensor, rules, world, rank):
    """What rank `rank` of `world` receives: torch's own chunk and cat."""
    for pattern, split in rules:
        if re.search(pattern, name):
            dim, _, parts = split.partition("x")
            dim, parts = int(dim), int(parts or 1)
            pieces = [part.chunk(world, dim)[rank] for part in tensor.chunk(parts, dim)]
            return torch.cat(pieces, dim).contiguous()
    return tensor


def main():
    out = sys.argv[1]
    os.makedirs(os.path.join(out, "models"), exist_ok=True)
    os.makedirs(os.path.join(out, "expected"), exist_ok=True)
    torch.manual_seed(13)
    models = {"llama": llama(False), "llama_fused": llama(True), "gpt2": gpt2()}
    for model, sd in models.items():
        torch.save(sd, os.path.join(out, "models", model + ".pt"))
        expected = {}
        for world in (2, 4, 8):
            for rank in range(world):
                for name, tensor in sd.items():
                    piece = shard(name, tensor, RULES[model], world, rank)
                    expected[f"n{world}.r{rank}.{name}"] = piece.clone()
                    expected[f"bf16.n{world}.r{rank}.{name}"] = piece.to(torch.bfloat16).clone()
        for name, bounds in SLICES.get(model, {}).items():
            expected[f"slice.{name}"] = narrow(sd[name], bounds).clone()
        torch.save(expected, os.path.join(out, "expected", model + ".pt"))
    torch.save({"big": torch.randn(2048, 4096), "small": torch.randn(16)}, os.path.join(out, "models", "big.pt"))
    with open(os.path.join(out, "rules.json"), "w") as f:
        json.dump({"rules": RULES,
                   "slices": {m: {n: slice_text(b) for n, b in s.items()} for m, s in SLICES.items()}}, f)


if __name__ == "__main__":
    main()
