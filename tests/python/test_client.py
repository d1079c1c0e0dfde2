"""The Python client (client/python) against a live weightstored, through the
socket and over gRPC. Run by tests/integration/python_client_test.cc, which
starts the daemon and passes WS_ADDRESS, WS_SOCKET and WS_MODELS."""
import glob
import os
import sys
import unittest

import numpy as np
import torch

from weightstore_client import RemoteClient, SocketClient, WeightStoreError
from weightstore_client.client import pb, pb_grpc

import grpc

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]


def rescan():
    with grpc.insecure_channel(ADDRESS) as channel:
        pb_grpc.WeightStoreStub(channel).Rescan(pb.RescanRequest(), timeout=60)


def same_bytes(a, b):
    """Bit equality (NaN == NaN), any dtype."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.BatchNorm1d(48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 8))


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.manual_seed(7)
        cls.model = make_model()
        cls.model[1].running_mean.uniform_()
        os.makedirs(os.path.join(MODELS, "py"), exist_ok=True)
        torch.save(cls.model.state_dict(), os.path.join(MODELS, "py", "mlp.pt"))
        rescan()
        cls.remote = RemoteClient(ADDRESS)
        cls.socket = SocketClient(SOCKET)

    def clients(self):
        return {"grpc": self.remote, "socket": self.socket}

    def test_both_transports_list_the_same_checkpoints(self):
        names = [c.name for c in self.remote.list_checkpoints()]
        self.assertIn("py/mlp", names)
        self.assertEqual(names, [c.name for c in self.socket.list_checkpoints()])
        info = self.socket.get_checkpoint("py/mlp")
        self.assertEqual(info.format, "pytorch")
        self.assertEqual(info.tensor_count, len(self.model.state_dict()))

    def test_every_fixture_is_the_same_through_both_transports(self):
        for c in self.remote.list_checkpoints():
            with self.subTest(c.name):
                over_grpc = self.remote.fetch(c.name)
                mapped = self.socket.fetch(c.name, verify=True)
                self.assertEqual(list(over_grpc), list(mapped))
                for name in over_grpc:
                    self.assertTrue(same_bytes(over_grpc[name], mapped[name]), name)

    def test_pytorch_fixtures_match_torch_load(self):
        checked = 0
        for path in sorted(glob.glob(os.path.join(MODELS, "pytorch-models", "*.pt"))):
            loaded = torch.load(path, map_location="cpu")
            if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
                continue
            name = os.path.relpath(path, MODELS)[:-3]
            for label, client in self.clients().items():
                with self.subTest(name=name, transport=label):
                    got = client.fetch(name)
                    self.assertEqual(set(got), set(loaded))
                    for key, want in loaded.items():
                        self.assertTrue(torch.equal(got[key], want.contiguous()), key)
            checked += 1
        self.assertGreater(checked, 3)

    def test_socket_tensors_are_read_only_views_and_numpy_works_too(self):
        arrays = self.socket.fetch("py/mlp", as_="numpy")
        want = self.model.state_dict()
        for name, array in arrays.items():
            self.assertFalse(array.flags.writeable, name)
            np.testing.assert_array_equal(array, want[name].numpy())
        with self.assertRaises(ValueError):
            arrays["0.weight"][0, 0] = 1.0

    def test_casts_match_torch(self):
        for dtype, torch_dtype in (("F16", torch.float16), ("BF16", torch.bfloat16), ("F64", torch.float64)):
            for label, client in self.clients().items():
                with self.subTest(dtype=dtype, transport=label):
                    got = client.fetch("py/mlp", dtype=dtype)
                    for name, want in self.model.state_dict().items():
                        want = want.to(torch_dtype) if want.is_floating_point() else want
                        self.assertTrue(torch.equal(got[name], want), name)

    def test_selection_filters_and_renames_on_the_server(self):
        for label, client in self.clients().items():
            with self.subTest(transport=label):
                # Renames come before the filter (burn-store's order).
                got = client.fetch("py/mlp", renames=[(r"^0\.", "encoder.")], include=[r"^encoder\."])
                self.assertEqual(sorted(got), ["encoder.bias", "encoder.weight"])
                infos = client.list_tensors("py/mlp", with_checksums=True, include=[r"^3\."])
                self.assertEqual([t.name for t in infos], ["3.weight", "3.bias"])
                self.assertTrue(all(t.crc32c is not None for t in infos))

    def test_load_into_a_module_with_one_call(self):
        for label, client in self.clients().items():
            with self.subTest(transport=label):
                fresh = make_model()
                result = client.load_into(fresh, "py/mlp")
                self.assertTrue(result.ok)
                self.assertEqual(sorted(result.applied), sorted(self.model.state_dict()))
                for name, want in self.model.state_dict().items():
                    self.assertTrue(torch.equal(fresh.state_dict()[name], want), name)

    def test_partial_and_failing_loads_report_burn_store_results(self):
        bigger = torch.nn.Sequential(make_model(), torch.nn.Linear(8, 2))
        for label, client in self.clients().items():
            with self.subTest(transport=label):
                result = client.load_into(bigger[0], "py/mlp", allow_partial=True, exclude=[r"^3\."])
                self.assertEqual(sorted(result.skipped), ["3.bias", "3.weight"])
                with self.assertRaises(WeightStoreError) as e:
                    client.load_into(torch.nn.Sequential(torch.nn.Linear(24, 47)), "py/mlp")
                self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                self.assertIn("0.weight", e.exception.message)

    def test_errors_name_what_was_wrong(self):
        for label, client in self.clients().items():
            with self.subTest(transport=label):
                with self.assertRaises(WeightStoreError) as e:
                    client.fetch("no/such")
                self.assertEqual(e.exception.code, "NOT_FOUND")
                self.assertIn("no/such", e.exception.message)
                with self.assertRaises(WeightStoreError) as e:
                    client.fetch("py/mlp", include=["(unclosed"])
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn("(unclosed", e.exception.message)


if __name__ == "__main__":
    try:
        unittest.main(verbosity=2)
    finally:
        for client in (getattr(ClientTest, "socket", None), getattr(ClientTest, "remote", None)):
            if client is not None:
                client.close()
