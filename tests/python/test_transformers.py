"""transformers end to end: tiny Llama, Qwen3-MoE (experts), GPT-2 (tied head,
Conv1D) and ViT models built from configs with random weights (nothing comes
from the hub), saved with save_pretrained as sharded SafeTensors and as a
pytorch_model.bin, laid out as a Hugging Face hub cache in WS_MODELS, served by
repo id and loaded into fresh models over the socket, over gRPC and from local
files. Needs WS_ADDRESS, WS_SOCKET and WS_MODELS (a daemon serving it);
`python tests/python/test_transformers.py`."""
import json
import os
import shutil
import tempfile
import unittest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from the hub

import grpc  # noqa: E402
import huggingface_hub  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import weightstore  # noqa: E402
from _support import write_hub_repo  # noqa: E402
from weightstore.v1 import weight_store_pb2, weight_store_pb2_grpc  # noqa: E402

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


def tiny_models():
    """{key: (repo id, model class, config, inputs)}: hidden 32, 2 layers."""
    llama = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    qwen = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    gpt2 = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                   eos_token_id=0)
    vit = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=16, patch_size=4, num_labels=5)
    tokens = torch.tensor([[3, 17, 42, 99, 5, 127, 64, 8, 0, 31]])
    pixels = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    return {"llama": ("acme/tiny-llama", transformers.LlamaForCausalLM, llama, tokens),
            "qwen3-moe": ("acme/tiny-qwen3-moe", transformers.Qwen3MoeForCausalLM, qwen, tokens),
            "gpt2": ("acme/tiny-gpt2", transformers.GPT2LMHeadModel, gpt2, tokens),
            "vit": ("acme/tiny-vit", transformers.ViTForImageClassification, vit, pixels)}


def served_name(repo, revision=None):
    """The checkpoint a hub cache repo is served as: refs/main by repo id,
    another ref or a commit as REPO@REV."""
    return repo if revision is None else f"{repo}@{revision}"


def logits(model, inputs):
    with torch.no_grad():
        return model(inputs).logits


def unshard(pieces, dim, parts=1):
    """The whole tensor from each rank's piece of a DIMxPARTS shard."""
    return torch.cat([torch.cat([p.chunk(parts, dim)[k] for p in pieces], dim) for k in range(parts)], dim)


class TransformersTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.models, cls.files, cls.shards, cls.commits = {}, {}, {}, {}
        with tempfile.TemporaryDirectory() as tmp:
            for key, (repo, kind, config, inputs) in tiny_models().items():
                torch.manual_seed(7)
                model = kind(config).eval()
                cls.models[key] = (model, logits(model, inputs))
                saved = os.path.join(tmp, key)
                # Shards of at most 20 KB: 5 to 8 files and an index.
                model.save_pretrained(saved, max_shard_size="20KB")
                names = sorted(os.listdir(saved))
                with open(os.path.join(saved, "model.safetensors.index.json")) as f:
                    weight_map = json.load(f)["weight_map"]
                cls.files[key] = sorted(weight_map)
                cls.shards[key] = sorted(set(weight_map.values()))
                # transformers 5.24's save_pretrained ignores safe_serialization=False and writes SafeTensors all
                # the same; 4.x wrote torch.save of the checkpoint-layout state dict, tied aliases removed. That
                # dict is what the shards hold: written here as 4.x wrote it.
                state = {}
                for shard in cls.shards[key]:
                    state.update(safetensors.torch.load_file(os.path.join(saved, shard)))
                bin_dir = os.path.join(tmp, key + "-bin")
                os.makedirs(bin_dir)
                torch.save(state, os.path.join(bin_dir, "pytorch_model.bin"))
                shutil.copy(os.path.join(saved, "config.json"), bin_dir)
                cls.commits[repo] = write_hub_repo(MODELS, repo, {n: os.path.join(saved, n) for n in names})
                cls.commits[repo + "-bin"] = write_hub_repo(
                    MODELS, repo + "-bin", {n: os.path.join(bin_dir, n) for n in os.listdir(bin_dir)})
        with grpc.insecure_channel(ADDRESS) as channel:  # serve the new repos now
            weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)
        cls.stores = {"socket": weightstore.connect("unix:" + SOCKET), "grpc": weightstore.connect(ADDRESS),
                      "local": weightstore.connect("file:" + MODELS)}

    def fresh(self, key):
        """A new model of the same config, other random weights."""
        _, kind, config, inputs = tiny_models()[key]
        torch.manual_seed(1234)
        model = kind(config).eval()
        self.assertFalse(torch.equal(logits(model, inputs), self.models[key][1]), key)
        return model, inputs

    def test_the_hub_cache_is_one_huggingface_hub_reads(self):
        for key, (repo, *_) in tiny_models().items():
            with self.subTest(model=key):
                self.assertGreater(len(self.shards[key]), 2)
                for name, files in ((repo, self.shards[key] + ["model.safetensors.index.json", "config.json"]),
                                    (repo + "-bin", ["pytorch_model.bin", "config.json"])):
                    snapshot = os.path.join(MODELS, "models--" + name.replace("/", "--"), "snapshots",
                                            self.commits[name])
                    for file in files:
                        self.assertEqual(huggingface_hub.try_to_load_from_cache(name, file, cache_dir=MODELS),
                                         os.path.join(snapshot, file))
                        self.assertTrue(os.path.islink(os.path.join(snapshot, file)))

    def test_the_hub_cache_is_served_by_repo_id_and_by_commit(self):
        for label, store in self.stores.items():
            listed = {c["name"]: c for c in store.list()}
            for key, (repo, *_) in tiny_models().items():
                with self.subTest(transport=label, model=key):
                    self.assertEqual(listed[served_name(repo)]["format"], "safetensors")
                    self.assertEqual(listed[served_name(repo)]["tensor_count"], len(self.files[key]))
                    self.assertEqual(listed[served_name(repo + "-bin")]["format"], "pytorch")
                    for name in (served_name(repo, self.commits[repo]), served_name(repo + "-bin"),
                                 served_name(repo + "-bin", self.commits[repo + "-bin"])):
                        self.assertEqual(sorted(t.name for t in store.describe(name)), self.files[key], name)

    def check_loads(self, suffix):
        for key, (repo, *_) in tiny_models().items():
            for label, store in self.stores.items():
                with self.subTest(model=key, transport=label):
                    model, inputs = self.fresh(key)
                    result = store.load_into(model, served_name(repo + suffix))
                    self.assertEqual((result.missing, result.unused, result.errors), ([], [], []))
                    self.assertEqual(sorted(result.applied), self.files[key])
                    self.assertTrue(torch.equal(logits(model, inputs), self.models[key][1]))

    def test_each_model_loads_from_sharded_safetensors_with_the_same_logits_through_every_store(self):
        self.check_loads("")

    def test_each_model_loads_from_pytorch_model_bin_with_the_same_logits_through_every_store(self):
        self.check_loads("-bin")

    def test_the_target_is_the_checkpoint_layout_and_transformers_converts_it_into_the_module(self):
        store = self.stores["socket"]
        qwen, _ = self.fresh("qwen3-moe")
        result = store.load_into(qwen, served_name("acme/tiny-qwen3-moe"))
        # Per-expert 2-D weights in the file, fused 3-D experts in the module.
        self.assertIn("model.layers.1.mlp.experts.3.gate_proj.weight", result.applied)
        self.assertNotIn("model.layers.1.mlp.experts.gate_up_proj", result.applied)
        fused = qwen.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
        want = self.models["qwen3-moe"][0].state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
        self.assertEqual(fused.dim(), 3)
        self.assertTrue(torch.equal(fused, want))
        served = store.tensors(served_name("acme/tiny-qwen3-moe"), include=[r"layers\.1\.mlp\.experts\.3\."])
        self.assertTrue(torch.equal(fused[3], torch.cat([served["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                                         served["model.layers.1.mlp.experts.3.up_proj.weight"]])))
        # ViT: the file's encoder.layer.N.attention.attention.query is the module's layers.N.attention.q_proj.
        vit, _ = self.fresh("vit")
        result = store.load_into(vit, served_name("acme/tiny-vit"))
        self.assertIn("vit.encoder.layer.0.attention.attention.query.weight", result.applied)
        self.assertNotIn("vit.encoder.layer.0.attention.attention.query.weight", vit.state_dict())
        self.assertTrue(torch.equal(vit.state_dict()["vit.layers.0.attention.q_proj.weight"],
                                    self.models["vit"][0].state_dict()["vit.layers.0.attention.q_proj.weight"]))

    def test_gpt2s_tied_head_is_not_asked_for_and_loads_with_the_embedding_it_shares(self):
        model, inputs = self.fresh("gpt2")
        head = model.lm_head.weight
        self.assertIs(head, model.transformer.wte.weight)
        result = self.stores["grpc"].load_into(model, served_name("acme/tiny-gpt2"))
        self.assertNotIn("lm_head.weight", self.files["gpt2"])
        self.assertNotIn("lm_head.weight", result.missing + result.applied)
        self.assertIs(model.lm_head.weight, head)  # in place: still one tensor under both names
        self.assertTrue(torch.equal(head, self.models["gpt2"][0].transformer.wte.weight))
        # Conv1D weights are [in, out] in the file and the module alike.
        self.assertEqual(tuple(model.transformer.h[0].attn.c_attn.weight.shape), (32, 96))
        self.assertTrue(torch.equal(logits(model, inputs), self.models["gpt2"][1]))

    def test_a_torch_modules_tied_parameters_load_from_whichever_name_the_file_holds(self):
        class Tied(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(16, 8)
                self.head = torch.nn.Linear(8, 16, bias=False)
                self.head.weight = self.embed.weight

        torch.manual_seed(5)
        source = Tied()
        os.makedirs(os.path.join(MODELS, "tied"), exist_ok=True)
        weight = source.embed.weight.detach()
        other = weight + 1
        files = {"tied/embed": {"embed.weight": weight}, "tied/head": {"head.weight": weight},
                 "tied/both": {"embed.weight": weight, "head.weight": weight.clone()},
                 # Two values for one memory: the later name wins, as with
                 # load_state_dict, on every transport (a socket or file:
                 # load writes the first in place and copies the second after).
                 "tied/differ": {"embed.weight": weight, "head.weight": other}}
        for name, state in files.items():
            safetensors.torch.save_file(state, os.path.join(MODELS, name + ".safetensors"))
        with grpc.insecure_channel(ADDRESS) as channel:
            weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)
        for name, state in files.items():
            for label, store in self.stores.items():
                with self.subTest(checkpoint=name, transport=label):
                    if label == "local":
                        store = weightstore.connect("file:" + MODELS)  # opened after the files were written
                    target = Tied()
                    result = store.load_into(target, name)
                    self.assertEqual((result.missing, result.unused, result.errors), ([], [], []))
                    self.assertEqual(sorted(result.applied), sorted(state))
                    self.assertIs(target.head.weight, target.embed.weight)
                    self.assertTrue(torch.equal(target.head.weight, other if name == "tied/differ" else weight))
                    if name == "tied/differ":
                        expected = Tied()
                        expected.load_state_dict(state)
                        self.assertTrue(torch.equal(target.head.weight, expected.head.weight))

    def test_llama_and_gpt2_tensor_parallel_shards_of_two_ranks_put_together_equal_the_whole_tensors(self):
        llama = {r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$": 0, r"(o_proj|down_proj)\.weight$": 1,
                 r"(embed_tokens|lm_head)\.weight$": 0}
        gpt2 = {r"attn\.c_attn\.weight$": "1x3", r"attn\.c_attn\.bias$": "0x3", r"(attn|mlp)\.c_proj\.weight$": 0,
                r"mlp\.c_fc\.weight$": 1, r"mlp\.c_fc\.bias$": 0, r"wte\.weight$": 0}
        # (dim, parts) each tensor is cut along, as the rules say; None: replicated.
        cuts = {"llama": lambda n: (0, 1) if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                          "gate_proj.weight", "up_proj.weight", "embed_tokens.weight",
                                                          "lm_head.weight"))
                else (1, 1) if n.endswith(("o_proj.weight", "down_proj.weight")) else None,
                "gpt2": lambda n: (1, 3) if n.endswith("c_attn.weight") else (0, 3) if n.endswith("c_attn.bias")
                else (0, 1) if n.endswith(("c_proj.weight", "c_fc.bias", "wte.weight"))
                else (1, 1) if n.endswith("c_fc.weight") else None}
        for key, rules in (("llama", llama), ("gpt2", gpt2)):
            repo = tiny_models()[key][0]
            original = self.models[key][0].state_dict()
            for label, store in self.stores.items():
                with self.subTest(model=key, transport=label):
                    ranks = [store.tensors(served_name(repo), shard=(r, 2, rules)) for r in range(2)]
                    self.assertEqual([sorted(r) for r in ranks], [self.files[key]] * 2)
                    whole, cut = {}, 0
                    for name in self.files[key]:
                        how = cuts[key](name)
                        if how is None:
                            self.assertTrue(torch.equal(ranks[0][name], ranks[1][name]), name)
                            whole[name] = ranks[0][name]
                            continue
                        dim, parts = how
                        self.assertEqual(ranks[0][name].shape[dim] * 2, original[name].shape[dim], name)
                        whole[name] = unshard([r[name] for r in ranks], dim, parts)
                        cut += 1
                    self.assertGreaterEqual(cut, 10)
                    # Put together, the two ranks are the whole model: every tensor, and the logits.
                    for name, tensor in whole.items():
                        self.assertTrue(torch.equal(tensor, original[name]), name)
                    model, inputs = self.fresh(key)
                    missing, unexpected = model.load_state_dict(whole, strict=False)
                    self.assertEqual((missing, unexpected), (["lm_head.weight"] if key == "gpt2" else [], []))
                    self.assertTrue(torch.equal(logits(model, inputs), self.models[key][1]))

    def test_a_checkpoint_of_another_shape_fails_and_leaves_the_model_untouched(self):
        _, kind, config, inputs = tiny_models()["llama"]
        wider = transformers.LlamaConfig(**{**config.to_dict(), "intermediate_size": 96})
        torch.manual_seed(9)
        model = kind(wider).eval()
        before = {n: t.clone() for n, t in model.state_dict().items()}
        for label, store in self.stores.items():
            with self.subTest(transport=label):
                with self.assertRaises(weightstore.Error) as e:
                    store.load_into(model, served_name("acme/tiny-llama"))
                self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                self.assertIn("mlp.gate_proj.weight", e.exception.message)
                for n, t in model.state_dict().items():
                    self.assertTrue(torch.equal(t, before[n]), n)


if __name__ == "__main__":
    unittest.main(verbosity=2)
