"""Burn's legacy records (issue 29), served like any checkpoint over every
store (gRPC, the daemon's socket, local files) and converted by the CLI.

The fixtures are five real records from public repositories
($WS_FIXTURES/burn-records); expected.json is what an independent decoder
reads from them (names, dtypes, shapes, sha256 of the bytes, metadata). No
public repository had a gzip or JSON record, so they are made here from the
MessagePack fixtures as Burn's NamedMpkGz, JsonGz and PrettyJson recorders
would write them (gzip of the same bytes; serde_json writes bytes as arrays of
integers). Needs a running weightstored started with --record-layout of
mnistweb_0.21's layout: WS_ADDRESS, WS_SOCKET, WS_MODELS, WS_CLI, WS_FIXTURES."""
import gzip
import hashlib
import json
import os
import subprocess
import tempfile
import unittest

import msgpack
import numpy as np

import weightstore

from _support import rescan

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]
CLI = os.environ["WS_CLI"]
RECORDS = os.path.join(os.environ["WS_FIXTURES"], "burn-records")
FOLDER = "records"
MPK = ("connect4_0.16.1", "modern-lstm_0.17-half", "customimage_0.13-half-old-layout")

with open(os.path.join(RECORDS, "expected.json")) as f:
    EXPECTED = json.load(f)


def as_json(value):
    """A decoded MessagePack value as serde_json writes it: bytes as integer arrays."""
    if isinstance(value, bytes):
        return list(value)
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    return value


def sha256(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


class BurnRecordsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        folder = os.path.join(MODELS, FOLDER)
        os.makedirs(folder, exist_ok=True)
        for stem in MPK:  # the fixtures, read in place
            os.symlink(os.path.join(RECORDS, stem + ".mpk"), os.path.join(folder, stem + ".mpk"))
        for stem in ("connect4_0.16.1", "modern-lstm_0.17-half"):
            with open(os.path.join(RECORDS, stem + ".mpk"), "rb") as f:
                data = f.read()
            with open(os.path.join(folder, stem + "-gz.mpk.gz"), "wb") as f:
                f.write(gzip.compress(data, 6))
            record = as_json(msgpack.unpackb(data, raw=False))
            with open(os.path.join(folder, stem + "-json.json.gz"), "wb") as f:
                f.write(gzip.compress(json.dumps(record, separators=(",", ":")).encode(), 6))
            cls.pretty = os.path.join(tempfile.mkdtemp(), stem + ".json")
            with open(cls.pretty, "w") as f:
                json.dump(record, f, indent=2)
        with open(os.path.join(RECORDS, "mnistweb_0.21.bin"), "rb") as f:
            with open(os.path.join(folder, "mnistweb_0.21.bin.gz"), "wb") as out:
                out.write(gzip.compress(f.read(), 6))
        rescan()
        cls.stores = {"grpc": weightstore.connect(ADDRESS), "socket": weightstore.connect("unix:" + SOCKET),
                      "local": weightstore.connect("file:" + MODELS,
                                                   record_layout=os.path.join(RECORDS, "mnistweb_0.21.layout.json"))}

    def assert_reads_as_expected(self, store, name, fixture):
        want = EXPECTED[fixture]
        listed = store.describe(name)
        self.assertEqual([t.name for t in listed], list(want["tensors"]))
        for t in listed:
            self.assertEqual((t.dtype, list(t.shape)), (want["tensors"][t.name]["dtype"],
                                                        want["tensors"][t.name]["shape"]), t.name)
        got = store.tensors(name, as_="numpy")
        for tensor_name, w in want["tensors"].items():
            self.assertEqual(sha256(got[tensor_name]), w["sha256"], tensor_name)
        if want["metadata"] is not None:
            self.assertEqual(store.info(name)["metadata"], want["metadata"])

    def test_every_messagepack_record_serves_what_an_independent_decoder_reads(self):
        for label, store in self.stores.items():
            for stem in MPK:
                with self.subTest(transport=label, record=stem):
                    self.assertEqual(store.info(f"{FOLDER}/{stem}")["format"], "burn-record")
                    self.assert_reads_as_expected(store, f"{FOLDER}/{stem}", stem + ".mpk")

    def test_gzip_and_json_records_read_as_the_messagepack_they_were_made_from(self):
        for label, store in self.stores.items():
            for stem in ("connect4_0.16.1", "modern-lstm_0.17-half"):
                for form in ("gz", "json"):
                    with self.subTest(transport=label, record=stem, form=form):
                        self.assert_reads_as_expected(store, f"{FOLDER}/{stem}-{form}", stem + ".mpk")
        local = weightstore.connect("file:" + self.pretty)  # .json is read when named, never scanned
        (only,) = local.list()
        self.assert_reads_as_expected(local, only["name"], "modern-lstm_0.17-half.mpk")

    def test_bincode_records_are_read_with_their_layout(self):
        for label, store in self.stores.items():  # the daemon's --record-layout, and file:'s record_layout
            with self.subTest(transport=label):
                self.assert_reads_as_expected(store, f"{FOLDER}/mnistweb_0.21", "mnistweb_0.21.bin")
        old = weightstore.connect("file:" + os.path.join(RECORDS, "mnistweb_0.14-uuid.bin"),
                                  record_layout=os.path.join(RECORDS, "mnistweb_0.14-uuid.layout.json"))
        (only,) = old.list()
        self.assert_reads_as_expected(old, only["name"], "mnistweb_0.14-uuid.bin")

    def test_a_bincode_record_without_its_layout_is_refused_saying_a_layout_is_needed(self):
        with self.assertRaises(weightstore.Error) as e:
            weightstore.connect("file:" + os.path.join(RECORDS, "mnistweb_0.14-uuid.bin"))
        self.assertIn("mnistweb_0.14-uuid.bin", e.exception.message)
        self.assertIn("layout", e.exception.message)
        with self.assertRaises(weightstore.Error) as e:  # a layout of another model
            weightstore.connect("file:" + os.path.join(RECORDS, "mnistweb_0.14-uuid.bin"),
                                record_layout=os.path.join(RECORDS, "mnistweb_0.21.layout.json"))
        self.assertIn("conv1.conv.weight", e.exception.message)
        with self.assertRaises(ValueError):
            weightstore.connect(ADDRESS, record_layout="x.json")

    def test_a_record_shards_like_any_checkpoint(self):
        with open(os.path.join(RECORDS, "connect4_0.16.1.mpk"), "rb") as f:
            item = msgpack.unpackb(f.read(), raw=False)["item"]
        weight = np.frombuffer(item["layer_0"]["weight"]["param"]["bytes"], dtype="<f4").reshape(42, 64)
        for label, store in self.stores.items():
            for rank in range(2):
                with self.subTest(transport=label, rank=rank):
                    got = store.tensors(f"{FOLDER}/connect4_0.16.1", as_="numpy",
                                        shard=(rank, 2, {r"layer_0\.weight$": 1}))
                    self.assertTrue(np.array_equal(got["layer_0.weight"], weight[:, rank * 32:(rank + 1) * 32]))

    def test_the_cli_migrates_records_to_burnpack_and_writes_records_burn_loads(self):
        out = tempfile.mkdtemp()
        src = os.path.join(RECORDS, "connect4_0.16.1.mpk")
        bpk, mpk = os.path.join(out, "connect4.bpk"), os.path.join(out, "connect4.mpk")
        subprocess.run([CLI, "convert", src, bpk], check=True, capture_output=True)
        subprocess.run([CLI, "convert", bpk, mpk], check=True, capture_output=True)
        for path in (bpk, mpk):
            with self.subTest(path=path):
                listing = json.loads(subprocess.run([CLI, "inspect", "--json", path], check=True,
                                                    capture_output=True, text=True).stdout)
                self.assertEqual([(t["name"], t["dtype"], t["shape"]) for t in listing["tensors"]],
                                 [(n, w["dtype"], w["shape"]) for n, w in EXPECTED["connect4_0.16.1.mpk"]["tensors"]
                                  .items()])
                got = weightstore.connect("file:" + path).tensors(os.path.basename(path)[:-4], as_="numpy")
                for name, w in EXPECTED["connect4_0.16.1.mpk"]["tensors"].items():
                    self.assertEqual(sha256(got[name]), w["sha256"], name)
        # The written record decodes as Burn's NamedMpk: the same ParamIds, and
        # the metadata it was read with.
        with open(src, "rb") as f:
            original = msgpack.unpackb(f.read(), raw=False)
        with open(mpk, "rb") as f:
            written = msgpack.unpackb(f.read(), raw=False)
        self.assertEqual(written["metadata"], original["metadata"])
        self.assertEqual(written["_b"], [])
        self.assertEqual(written["item"]["layer_0"]["weight"]["id"], original["item"]["layer_0"]["weight"]["id"])
        refused = subprocess.run([CLI, "convert", src, os.path.join(out, "x.mpk.gz")], capture_output=True, text=True)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn(".mpk only", refused.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "x.mpk.gz")))

    def test_a_push_never_rewrites_a_record_in_another_encoding(self):
        # A gzipped record (or a bincode one) would be rewritten as plain
        # MessagePack under its old name; the daemon refuses, naming the file.
        before = self.stores["grpc"].info(f"{FOLDER}/connect4_0.16.1-gz")["version"]
        pushed = subprocess.run([CLI, "push", "--server", ADDRESS, f"{FOLDER}/connect4_0.16.1-gz",
                                 os.path.join(RECORDS, "connect4_0.16.1.mpk")], capture_output=True, text=True)
        self.assertNotEqual(pushed.returncode, 0)
        self.assertIn("connect4_0.16.1-gz.mpk.gz", pushed.stderr)
        self.assertIn("pushes write one file of a writable format and ending", pushed.stderr)
        self.assertEqual(self.stores["grpc"].info(f"{FOLDER}/connect4_0.16.1-gz")["version"], before)


if __name__ == "__main__":
    unittest.main(verbosity=2)
