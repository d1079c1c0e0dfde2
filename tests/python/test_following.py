"""An RL fleet judged by transformers: a tiny Llama saved sharded by
save_pretrained is served by a trainer's daemon, which takes each training
step by `store.push`; a regional daemon follows it (--follow), and two nodes
follow the regional one, one of them started after two steps. Each node's
files must then load with transformers' own from_pretrained into the
trainer's model, tensor for tensor, and a client of a node must load the same
into a fresh model. Starts its own daemons (WS_DAEMON);
`python tests/python/test_following.py`."""
import os
import shutil
import tempfile
import time
import unittest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from the hub

import torch  # noqa: E402
import transformers  # noqa: E402

import weightstore  # noqa: E402
from _support import Daemon  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

NAME = "policy/model"  # policy/model.safetensors.index.json
STEPS = 4
TOKENS = torch.tensor([[3, 17, 42, 99, 5, 127, 64, 8, 0, 31]])


def config():
    return transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def logits(model):
    with torch.no_grad():
        return model(TOKENS).logits


def train_step(model, generator):
    """An optimizer's step as an RL trainer makes one: about 1% of each
    weight's elements move (at least one)."""
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            count = max(1, flat.numel() // 100)
            at = torch.randperm(flat.numel(), generator=generator)[:count]
            flat[at] += torch.randn(count, generator=generator, dtype=flat.dtype) * 1e-2


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class FollowingTransformersTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="ws-following-")
        self.daemons = []

    def tearDown(self):
        for d in reversed(self.daemons):
            d.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    def start(self, folder, *args):
        d = Daemon(os.path.join(self.work, folder), *args, work=tempfile.mkdtemp(dir=self.work))
        self.daemons.append(d)
        return d

    def wait_for_version(self, daemon, version, what):
        store = weightstore.connect(daemon.address)
        deadline = time.monotonic() + 120  # only a node that never gets there waits this long
        seen = None
        while time.monotonic() < deadline:
            try:
                seen = store.info(NAME)["version"]
            except weightstore.Error:
                seen = None
            if seen == version:
                return
            time.sleep(0.05)
        self.fail(f"{what} serves {seen}, not {version}:\n{daemon.log()}")

    def test_nodes_follow_a_trainers_pushes_through_a_regional_tier_and_load_with_from_pretrained(self):
        torch.manual_seed(11)
        model = transformers.LlamaForCausalLM(config()).eval()
        saved = os.path.join(self.work, "trainer", "policy")
        model.save_pretrained(saved, max_shard_size="20KB")  # 5 or more shards and an index
        with open(os.path.join(saved, "model.safetensors.index.json"), "rb") as f:
            index = f.read()
        shards = sorted(n for n in os.listdir(saved) if n.endswith(".safetensors"))
        self.assertGreater(len(shards), 2, shards)

        trainer = self.start("trainer")
        regional = self.start("regional", "--origin", f"grpc://{trainer.address}", "--follow", "--pull", NAME)
        early = self.start("early", "--origin", f"grpc://{regional.address}", "--follow", "--pull", NAME)
        pusher = weightstore.connect(trainer.address)
        first = pusher.info(NAME)["version"]
        self.wait_for_version(early, first, "the early node")

        generator = torch.Generator().manual_seed(5)
        base = snapshot(model)
        late = None
        for step in range(1, STEPS + 1):
            train_step(model, generator)
            pushed = pusher.push(NAME, model, base=base)
            self.assertGreater(len(pushed.patched), 0, f"step {step}: {pushed}")
            self.assertEqual(len(pushed.whole) + len(pushed.patched), len(base), f"step {step}: every weight moved")
            base = snapshot(model)
            if step == 2:  # a node joins, and pulls this step's version before the next
                late = self.start("late", "--origin", f"grpc://{regional.address}", "--follow", "--pull", NAME)
                self.wait_for_version(late, pushed.version, "the late node")
        last = pusher.info(NAME)["version"]
        want = logits(model)

        for node, what in ((early, "the early node"), (late, "the late node")):
            self.wait_for_version(node, last, what)
            # transformers reads the node's folder as it reads any saved model:
            # the index save_pretrained wrote, and the node's own shards.
            folder = os.path.join(node.models, "policy")
            with open(os.path.join(folder, "model.safetensors.index.json"), "rb") as f:
                self.assertEqual(f.read(), index, what)
            self.assertEqual(sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")), shards, what)
            # The node pulls weights, not configs: a model folder is the node's
            # files (linked) beside the configs save_pretrained wrote.
            model_dir = tempfile.mkdtemp(dir=self.work)
            for n in os.listdir(folder):
                os.symlink(os.path.join(folder, n), os.path.join(model_dir, n))
            for n in ("config.json", "generation_config.json"):
                shutil.copy(os.path.join(saved, n), model_dir)
            loaded = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
            got = loaded.state_dict()
            for name, tensor in model.state_dict().items():
                self.assertTrue(torch.equal(got[name], tensor), f"{what}: {name} is not the trainer's")
            self.assertTrue(torch.equal(logits(loaded), want), what)
            # A client of the node loads the same into a fresh model.
            torch.manual_seed(1234)
            fresh = transformers.LlamaForCausalLM(config()).eval()
            self.assertFalse(torch.equal(logits(fresh), want))
            weightstore.connect(node.address).load_into(fresh, NAME)
            self.assertTrue(torch.equal(logits(fresh), want), what)

        # Each tier took steps as element patches: the early node every one
        # it saw, the late one those after it pulled.
        for node, what in ((regional, "the regional tier"), (early, "the early node"), (late, "the late node")):
            patched = node.metric("weightstore_follow_updates_total", checkpoint=NAME, how="patches")
            self.assertGreaterEqual(patched or 0, 1, f"{what}:\n{node.log()}")
            self.assertGreater(node.metric("weightstore_follow_received_bytes_total", checkpoint=NAME,
                                           kind="patch") or 0, 0, what)
            self.assertEqual(node.metric("weightstore_follow_checkpoints"), 1, what)
            self.assertEqual(node.metric("weightstore_follow_unfollowed_checkpoints"), 0, what)


if __name__ == "__main__":
    unittest.main()
