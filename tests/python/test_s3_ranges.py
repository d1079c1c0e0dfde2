"""A trainer that uploads its checkpoints to S3, saved by the `safetensors`
library with weightstore.digests_metadata() in the header: a node following
the object (--origin s3://... --follow) takes a step that changed two of its
tensors by fetching only those, and serves the new version bit for bit. The
same steps without the digests come whole. S3 is moto's server, in this
process; the node is a weightstored of the test's own (WS_DAEMON);
`python tests/python/test_s3_ranges.py`."""
import logging
import os
import shutil
import tempfile
import time
import unittest

import boto3
import torch
from moto.server import ThreadedMotoServer
from safetensors.torch import save

import weightstore
from _support import Daemon

BUCKET = "models"
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs each request


def trainer_state(generator):
    """Eight weights of 256 KiB: a model whose first six layers are frozen."""
    return {f"layers.{i}.weight": torch.randn(256, 256, generator=generator) for i in range(8)}


def fine_tune(state, generator):
    """A step that moves only the last two layers."""
    for name in ("layers.6.weight", "layers.7.weight"):
        state[name] += torch.randn(256, 256, generator=generator) * 1e-2


class S3RangesTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="ws-s3-ranges-")
        self.s3_server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.s3_server.start()
        host, port = self.s3_server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="key", aws_secret_access_key="key",
                               region_name="us-east-1")
        self.s3.create_bucket(Bucket=BUCKET)
        self.node = None

    def tearDown(self):
        if self.node is not None:
            self.node.stop()
        self.s3_server.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    def upload(self, key, state, digests):
        metadata = {"format": "pt"}
        if digests:
            metadata.update(weightstore.digests_metadata(state))
        body = save(state, metadata=metadata)
        self.s3.put_object(Bucket=BUCKET, Key=key, Body=body)
        return len(body)

    def start_node(self, name):
        os.environ.update({"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": "key",
                           "AWS_SECRET_ACCESS_KEY": "key", "AWS_REGION": "us-east-1"})
        self.node = Daemon(f"{self.work}/node", "--origin", f"s3://{BUCKET}/ckpt", "--follow", "--follow-interval",
                           "0.1", "--pull", name, work=tempfile.mkdtemp(dir=self.work))
        store = weightstore.connect(self.node.address)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                return store, store.info(name)["version"]
            except weightstore.Error:
                time.sleep(0.05)
        self.fail(f"the node never served {name}: {self.node.log()}")

    def step(self, store, name, held):
        """Waits for the node to serve a version other than `held`."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            version = store.info(name)["version"]
            if version != held:
                return version
            time.sleep(0.05)
        self.fail(f"the node never took the step: {self.node.log()}")

    def received(self, name):
        return sum(self.node.metric("weightstore_follow_received_bytes_total", checkpoint=name, kind=kind) or 0
                   for kind in ("whole", "patch"))

    def follow(self, digests):
        generator = torch.Generator().manual_seed(7)
        name = "policy-digests" if digests else "policy-plain"
        key = f"ckpt/{name}.safetensors"
        state = trainer_state(generator)
        self.upload(key, state, digests)
        store, held = self.start_node(name)
        for _ in range(2):
            fine_tune(state, generator)
            before = self.received(name)
            size = self.upload(key, state, digests)
            held = self.step(store, name, held)
            got = store.tensors(name)
            self.assertEqual(set(got), set(state))
            for n, t in state.items():
                self.assertTrue(torch.equal(got[n], t), n)
            yield self.received(name) - before, size

    def test_a_step_fetches_only_the_tensors_whose_digest_changed(self):
        for received, size in self.follow(digests=True):
            # The first 64 KiB (the header) and the two changed weights of 256 KiB.
            self.assertLess(received, 2 * 256 * 1024 + 2 * 65536)
            self.assertGreater(received, 2 * 256 * 1024)
        self.assertIn("tensors unchanged, copied from the file held", self.node.log())
        self.assertEqual(self.node.metric("weightstore_follow_updates_total", checkpoint="policy-digests",
                                          how="ranges"), 2)

    def test_without_digests_each_step_is_the_whole_file(self):
        for received, size in self.follow(digests=False):
            self.assertGreaterEqual(received, size)
        self.assertEqual(self.node.metric("weightstore_follow_updates_total", checkpoint="policy-plain", how="ranges"),
                         0)


if __name__ == "__main__":
    unittest.main()
