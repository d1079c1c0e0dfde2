"""The `weightstore` package (the C++ client's extension) against a live
weightstored over gRPC, through its socket, and on local files. Run by
tests/integration/python_package_test.cc, which starts the daemon and passes
WS_ADDRESS, WS_SOCKET, WS_MODELS and WS_METRICS (its metrics port); the
package comes from PYTHONPATH (the build tree) or from a venv it was
pip-installed into."""
import glob
import json
import os
import signal
import struct
import threading
import time
import unittest
import urllib.request

import numpy as np
import torch

import grpc
import weightstore
from weightstore.v1 import weight_store_pb2, weight_store_pb2_grpc

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]
METRICS = os.environ["WS_METRICS"]


def fetch_calls():
    """The daemon's FetchTensors calls so far, from its metrics: how many
    started, and how many ended with each status code."""
    with urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=60) as answer:
        text = answer.read().decode()
    started, ended = 0.0, {}
    for line in text.splitlines():
        if 'grpc_method="FetchTensors"' not in line:
            continue
        if line.startswith("grpc_server_started_total{"):
            started += float(line.rsplit(" ", 1)[1])
        elif line.startswith("grpc_server_handled_total{"):
            code = line.split('grpc_code="', 1)[1].split('"', 1)[0]
            ended[code] = ended.get(code, 0.0) + float(line.rsplit(" ", 1)[1])
    return started, ended


def ended_cancelled_since(before):
    """Waits for every FetchTensors call the daemon started to end (60 s only
    catches one that never does); returns whether one started since `before`
    (a fetch_calls()) ended cancelled: its client cut the stream short."""
    deadline = time.monotonic() + 60
    started, ended = fetch_calls()
    while started != sum(ended.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
        started, ended = fetch_calls()
    return ended.get("Canceled", 0.0) > before[1].get("Canceled", 0.0)


def same_bytes(a, b):
    """Bit equality (NaN == NaN), any dtype."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.BatchNorm1d(48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 8))


def once_written(tensor, action):
    """Calls action() on a thread of its own once `tensor`'s first element is
    no longer zero (an event, not a timer: a load has begun writing it).
    Returns (done, thread): set done to stop watching, then join."""
    done = threading.Event()

    def watch():
        while not done.is_set():
            if tensor[0].item() != 0:
                action()
                done.set()
            time.sleep(0.001)

    thread = threading.Thread(target=watch)
    thread.start()
    return done, thread


class PackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.manual_seed(11)
        cls.model = make_model()
        cls.model[1].running_mean.uniform_()
        os.makedirs(os.path.join(MODELS, "pkg"), exist_ok=True)
        torch.save(cls.model.state_dict(), os.path.join(MODELS, "pkg", "mlp.pt"))
        # 256 MiB in 64 tensors: a fetch long enough to be interrupted.
        torch.save({f"w.{i}": torch.full((1024, 1024), float(i)) for i in range(64)},
                   os.path.join(MODELS, "pkg", "big.pt"))
        # 512 MiB in one tensor: Ctrl-C must not wait for the tensor's end.
        torch.save({"w": torch.ones(128 << 20)}, os.path.join(MODELS, "pkg", "one.pt"))
        # Unsigned types that numpy has and torch before 2.3 does not, written
        # as a SafeTensors file by hand (8-byte header size, JSON, data).
        cls.uints = np.arange(6, dtype="<u4") * 0x01010101
        header = ('{"u": {"dtype": "U32", "shape": [2, 3], "data_offsets": [0, 24]}}').encode()
        with open(os.path.join(MODELS, "pkg", "uints.safetensors"), "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header + cls.uints.tobytes())
        # Tensors at odd offsets (SafeTensors does not align them), the data
        # section itself 8-byte aligned in the file.
        cls.odd = {"b": torch.tensor([1, 2, 3], dtype=torch.uint8), "f": torch.arange(4.0).reshape(2, 2),
                   "d": torch.tensor([0.5, -1.25, 3.0], dtype=torch.float64)}
        header = ('{"b": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}, '
                  '"f": {"dtype": "F32", "shape": [2, 2], "data_offsets": [3, 19]}, '
                  '"d": {"dtype": "F64", "shape": [3], "data_offsets": [19, 43]}}').encode()
        header += b" " * (-len(header) % 8)
        with open(os.path.join(MODELS, "pkg", "odd.safetensors"), "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header + b"".join(
                cls.odd[k].numpy().tobytes() for k in ("b", "f", "d")))
        with grpc.insecure_channel(ADDRESS) as channel:  # serve the new files now
            weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)
        cls.local = weightstore.connect("file:" + MODELS)
        cls.remote = weightstore.connect(ADDRESS)
        cls.socket = weightstore.connect("unix:" + SOCKET)

    def stores(self):
        return {"grpc": self.remote, "socket": self.socket, "local": self.local}

    def test_the_package_is_the_installed_one_with_its_extension(self):
        self.assertTrue(os.path.exists(weightstore.__file__))
        self.assertIsNotNone(weightstore._native)
        self.assertEqual([self.remote.kind, self.socket.kind, self.local.kind], ["remote", "socket", "local"])

    def test_every_store_lists_the_same_checkpoints(self):
        names = [c["name"] for c in self.remote.list()]
        self.assertIn("pkg/mlp", names)
        self.assertEqual(names, [c["name"] for c in self.socket.list()])
        self.assertEqual(names, [c["name"] for c in self.local.list()])
        self.assertEqual(self.socket.info("pkg/mlp")["format"], "pytorch")

    def test_every_fixture_is_the_same_bytes_through_every_store(self):
        for c in self.remote.list():
            if c["name"] in ("pkg/big", "pkg/one", "pkg/uints"):
                continue  # the Ctrl-C and dtype tests'; compared there
            with self.subTest(c["name"]):
                want = self.local.tensors(c["name"])
                for label in ("grpc", "socket"):
                    got = self.stores()[label].tensors(c["name"])
                    self.assertEqual(list(got), list(want), label)
                    for name in want:
                        self.assertTrue(same_bytes(got[name], want[name]), (label, name))

    def test_pytorch_fixtures_match_torch_load(self):
        checked = 0
        for path in sorted(glob.glob(os.path.join(MODELS, "pytorch-models", "*.pt"))):
            loaded = torch.load(path, map_location="cpu")
            if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
                continue
            name = os.path.relpath(path, MODELS)[:-3]
            for label, store in self.stores().items():
                with self.subTest(name=name, transport=label):
                    got = store.tensors(name)
                    self.assertEqual(set(got), set(loaded))
                    for key, want in loaded.items():
                        self.assertTrue(torch.equal(got[key], want.contiguous()), key)
            checked += 1
        self.assertGreater(checked, 3)

    def test_fetched_tensors_are_writable_and_outlive_their_store(self):
        store = weightstore.connect(ADDRESS)
        got = store.tensors("pkg/mlp")
        del store
        got["0.weight"][0, 0] = 42.0  # owned memory: no copy was needed to write
        self.assertEqual(got["0.weight"][0, 0].item(), 42.0)
        self.assertTrue(torch.equal(got["0.bias"], self.model.state_dict()["0.bias"]))

    def test_socket_tensors_are_copy_on_write_views_and_numpy_works_too(self):
        arrays = self.socket.tensors("pkg/mlp", as_="numpy")
        want = self.model.state_dict()
        for name, array in arrays.items():
            np.testing.assert_array_equal(array, want[name].numpy())
        # A write lands in this process's private copy of the page, never in the
        # daemon's bytes: a second mapping still reads the original.
        arrays["0.weight"][0, 0] = 1234.5
        tensors = self.socket.tensors("pkg/mlp")
        tensors["0.bias"].add_(1.0)  # in place, through torch: no crash
        again = self.socket.tensors("pkg/mlp")
        self.assertTrue(torch.equal(again["0.weight"], want["0.weight"]))
        self.assertTrue(torch.equal(again["0.bias"], want["0.bias"]))
        self.assertEqual(arrays["0.weight"][0, 0], 1234.5)

    def test_tensors_at_odd_offsets_in_their_file_are_naturally_aligned(self):
        for label, store in self.stores().items():
            with self.subTest(label):
                got = store.tensors("pkg/odd")
                for name, want in self.odd.items():
                    self.assertTrue(same_bytes(got[name], want), name)
                    self.assertEqual(got[name].data_ptr() % got[name].element_size(), 0, name)
                arrays = store.tensors("pkg/odd", as_="numpy")
                for name, want in self.odd.items():
                    np.testing.assert_array_equal(arrays[name], want.numpy())
                    self.assertTrue(arrays[name].flags.aligned, name)

    def test_bad_arguments_are_type_or_value_errors_naming_the_argument(self):
        with self.assertRaises(TypeError):
            self.remote.tensors("pkg/mlp", include=r"^0\.")  # a string, not a list
        with self.assertRaises(TypeError):
            self.remote.tensors("pkg/mlp", rename=[("a",)])
        with self.assertRaises(ValueError):
            self.remote.tensors("pkg/mlp", shard=(-1, 2, {"x": 0}))
        with self.assertRaises(ValueError):
            self.remote.tensors("pkg/mlp", as_="np")
        with self.assertRaises(ValueError):
            weightstore.connect(ADDRESS, parallel_streams=100000)
        with self.assertRaises(ValueError):
            weightstore.connect(ADDRESS, timeout=float("nan"))
        with self.assertRaises(TypeError):
            weightstore.connect(ADDRESS, data_lane="yes")
        with self.assertRaises(TypeError) as e:
            self.remote.update({7: torch.zeros(1)}, "pkg/mlp")  # names are str
        self.assertIn("key 7", str(e.exception))

    def test_a_fetch_on_the_stream_alone_equals_one_over_the_data_lane(self):
        # (Over the daemon's data lane where it has one: the build tree's run.)
        lane = weightstore.connect(ADDRESS).tensors("pkg/mlp")
        stream = weightstore.connect(ADDRESS, data_lane=False).tensors("pkg/mlp")
        self.assertEqual(list(lane), list(stream))
        for name in lane:
            self.assertTrue(torch.equal(lane[name], stream[name]), name)

    def test_unsigned_tensors_reach_numpy_and_torch_says_what_to_ask_for_instead(self):
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                np.testing.assert_array_equal(store.tensors("pkg/uints", as_="numpy")["u"], self.uints.reshape(2, 3))
                if hasattr(torch, "uint32"):  # torch >= 2.3
                    got = store.tensors("pkg/uints")["u"]
                    self.assertEqual(got.dtype, torch.uint32)
                    continue
                with self.assertRaises(weightstore.Error) as e:
                    store.tensors("pkg/uints")
                self.assertEqual(e.exception.code, "UNIMPLEMENTED")
                self.assertIn("'u' is U32", e.exception.message)
                self.assertIn("as_='numpy'", e.exception.message)

    def test_devices_are_checked_before_fetching_and_cuda_needs_torch_with_cuda(self):
        with self.assertRaises(ValueError):
            self.remote.tensors("pkg/mlp", device="mps")
        with self.assertRaises(ValueError):
            self.remote.tensors("pkg/mlp", device="cuda:0", as_="numpy")
        with self.assertRaises(ValueError):
            self.remote.tensors("pkg/mlp", device="cuda:zero")
        self.assertTrue(torch.equal(self.remote.tensors("pkg/mlp", device=torch.device("cpu"))["0.bias"],
                                    self.model.state_dict()["0.bias"]))
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                if not torch.cuda.is_available():
                    with self.assertRaises(weightstore.Error) as e:
                        store.tensors("pkg/mlp", device="cuda:0")
                    self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                    self.assertIn("'cuda:0'", e.exception.message)
                    continue
                got = store.tensors("pkg/mlp", device="cuda:0")
                for name, want in self.model.state_dict().items():
                    self.assertEqual(got[name].device, torch.device("cuda:0"))
                    self.assertTrue(torch.equal(got[name].cpu(), want), name)

    def test_the_cuda_path_is_the_cpp_clients_and_says_when_there_is_no_gpu(self):
        # Below the package's torch check: the extension's own device fetch.
        # Without a GPU it fails cleanly for every store, which stays usable;
        # with one, it returns GPU memory that torch takes through DLPack.
        selection = weightstore._selection()
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                if torch.cuda.is_available():
                    _, _, _, buffer = store._native.fetch_to_device("pkg/mlp", selection, 0)["tensors"][0]
                    self.assertEqual(buffer.__dlpack_device__(), (2, 0))
                    self.assertEqual(torch.from_dlpack(buffer).device, torch.device("cuda:0"))
                    continue
                with self.assertRaises(weightstore.Error) as e:
                    store._native.fetch_to_device("pkg/mlp", selection, 0)
                if weightstore._native.has_cuda:
                    self.assertEqual(e.exception.code, "UNAVAILABLE")
                    self.assertIn("no CUDA device for cuda:0", e.exception.message)
                else:
                    self.assertIn("no CUDA support", e.exception.message)
                # The store is still usable afterwards.
                self.assertEqual(len(store.tensors("pkg/mlp")), len(self.model.state_dict()))

    def test_tensors_reach_torch_through_dlpack_and_free_their_memory_with_the_last_one(self):
        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        # A buffer exports flat host bytes; views share them.
        buffer = self.remote._native.fetch("pkg/mlp", weightstore._selection())["tensors"][0][3]
        self.assertEqual(buffer.__dlpack_device__(), (1, 0))
        a, b = torch.from_dlpack(buffer), torch.from_dlpack(buffer)
        self.assertEqual((a.dtype, a.numel()), (torch.uint8, len(buffer)))
        a[0] ^= 0xFF
        self.assertEqual(a[0].item(), b[0].item())
        del a, b, buffer
        # 256 MiB fetched and exported as capsules never consumed and as
        # consumed ones, and 256 MiB fetched as the package's tensors: each
        # fetch's memory is freed with its last holder, and valid until then.
        before = rss_mib()
        fetched = self.remote._native.fetch("pkg/big", weightstore._selection())["tensors"]
        unused = [item[3].__dlpack__() for item in fetched]
        raw = [torch.from_dlpack(item[3].__dlpack__()) for item in fetched]
        tensors = self.remote.tensors("pkg/big")
        peak = rss_mib()
        self.assertGreater(peak - before, 400)
        del fetched, unused
        for i in (0, 63):
            self.assertTrue(torch.all(raw[i].view(torch.float32) == float(i)))
        del raw
        self.assertLess(rss_mib(), peak - 200)
        last = tensors["w.63"]
        del tensors
        self.assertLess(rss_mib(), peak - 400)
        self.assertTrue(torch.all(last == 63.0))

    def test_load_into_ignores_buffers_outside_the_state_dict(self):
        model = make_model()
        model.register_buffer("inv_freq", torch.ones(3), persistent=False)  # as rotary embeddings do
        result = self.remote.load_into(model, "pkg/mlp")
        self.assertTrue(result.ok)
        self.assertEqual(result.missing, [])

    def test_casts_match_torch(self):
        for dtype, torch_dtype in (("f16", torch.float16), ("bf16", torch.bfloat16), ("f64", torch.float64)):
            for label, store in self.stores().items():
                with self.subTest(dtype=dtype, transport=label):
                    got = store.tensors("pkg/mlp", dtype=dtype)
                    for name, want in self.model.state_dict().items():
                        want = want.to(torch_dtype) if want.is_floating_point() else want
                        self.assertTrue(torch.equal(got[name], want), name)
        got = self.remote.tensors("pkg/mlp", dtype=torch.bfloat16)  # torch's dtypes name casts too
        self.assertEqual(got["0.weight"].dtype, torch.bfloat16)

    def test_selections_filter_and_rename_on_the_server(self):
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                got = store.tensors("pkg/mlp", rename=[(r"^0\.", "encoder.")], include=[r"^encoder\."])
                self.assertEqual(sorted(got), ["encoder.bias", "encoder.weight"])
                infos = store.describe("pkg/mlp", with_checksums=True, include=[r"^3\."])
                self.assertEqual([t.name for t in infos], ["3.weight", "3.bias"])
                self.assertTrue(all(t.crc32c is not None for t in infos))

    def test_each_rank_receives_torchs_chunk_of_its_shard(self):
        rules = {r"^0\.(weight|bias)$": 0, r"^3\.weight$": "1"}
        state = self.model.state_dict()
        for world in (2, 4):
            for rank in range(world):
                for label, store in self.stores().items():
                    with self.subTest(world=world, rank=rank, transport=label):
                        got = store.tensors("pkg/mlp", shard=(rank, world, rules))
                        self.assertTrue(same_bytes(got["0.weight"], state["0.weight"].chunk(world, 0)[rank]))
                        self.assertTrue(same_bytes(got["3.weight"],
                                                   state["3.weight"].chunk(world, 1)[rank].contiguous()))
                        self.assertTrue(same_bytes(got["1.running_mean"], state["1.running_mean"]))
        info = {t.name: t for t in self.remote.describe("pkg/mlp", shard=(1, 4, rules))}["3.weight"]
        self.assertEqual((info.shape, info.unsliced_shape, info.slice), ((8, 12), (8, 48), (((0, 8),), ((12, 24),))))
        got = self.socket.tensors("pkg/mlp", paths=["0.weight"], slices={"0.weight": (slice(4, 20),)})
        self.assertTrue(same_bytes(got["0.weight"], state["0.weight"][4:20].contiguous()))

    def test_load_into_a_module_with_one_call(self):
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                fresh = make_model()
                result = store.load_into(fresh, "pkg/mlp")
                self.assertTrue(result.ok)
                self.assertEqual(sorted(result.applied), sorted(self.model.state_dict()))
                for name, want in self.model.state_dict().items():
                    self.assertTrue(torch.equal(fresh.state_dict()[name], want), name)

    def test_load_into_writes_each_tensor_in_place_and_converts_what_it_cannot(self):
        want = self.model.state_dict()
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                fresh = make_model()
                # Held as float64 (torch converts it), and transposed (not
                # contiguous: copied by torch); the rest are written in place.
                fresh[3].weight = torch.nn.Parameter(torch.zeros(8, 48, dtype=torch.float64))
                fresh[0].weight = torch.nn.Parameter(torch.zeros(24, 48).t())
                before = {n: (t.data_ptr(), t._version) for n, t in fresh.state_dict(keep_vars=True).items()}
                self.assertTrue(store.load_into(fresh, "pkg/mlp").ok)
                got = fresh.state_dict(keep_vars=True)
                for name, w in want.items():
                    self.assertEqual(got[name].data_ptr(), before[name][0], name)
                    self.assertGreater(got[name]._version, before[name][1], name)  # autograd sees the write
                    self.assertTrue(torch.equal(got[name], w.to(got[name].dtype)), name)
                self.assertEqual(got["3.weight"].dtype, torch.float64)
                self.assertFalse(got["0.weight"].is_contiguous())

    def test_partial_and_failing_loads_report_burn_store_results(self):
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                result = store.load_into(make_model(), "pkg/mlp", allow_partial=True, exclude=[r"^3\."])
                self.assertEqual(sorted(result.skipped), ["3.bias", "3.weight"])
                wrong = torch.nn.Sequential(torch.nn.Linear(24, 47))
                before = [p.clone() for p in wrong.parameters()]
                with self.assertRaises(weightstore.Error) as e:
                    store.load_into(wrong, "pkg/mlp")
                self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                self.assertIn("0.weight", e.exception.message)
                for p, b in zip(wrong.parameters(), before):
                    self.assertTrue(torch.equal(p, b))  # untouched

    def test_errors_carry_the_status_code_and_name_what_was_wrong(self):
        for label, store in self.stores().items():
            with self.subTest(transport=label):
                with self.assertRaises(weightstore.Error) as e:
                    store.tensors("no/such")
                self.assertEqual(e.exception.code, "NOT_FOUND")
                self.assertIn("no/such", e.exception.message)
                with self.assertRaises(weightstore.Error) as e:
                    store.tensors("pkg/mlp", include=["(unclosed"])
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn("(unclosed", e.exception.message)
                with self.assertRaises(weightstore.Error) as e:
                    store.tensors("pkg/mlp", shard=(0, 5, {r"^0\.weight$": 0}))
                self.assertIn("'0.weight'", e.exception.message)
        with self.assertRaises(weightstore.Error) as e:
            weightstore.connect("unix:/nonexistent/ws.sock")
        self.assertIn(e.exception.code, ("NOT_FOUND", "UNAVAILABLE"))
        self.assertIn("/nonexistent/ws.sock", e.exception.message)
        with self.assertRaises(ValueError):
            self.remote.tensors("pkg/mlp", slices={"0.weight": "[-1:]"})

    def interrupt(self, store, name, fraction, over_grpc):
        """Sends a real SIGINT (Ctrl-C) into fetches of `name` once this
        process's RSS has grown by `fraction` of the fetch's bytes (an event:
        the fetch is under way, however fast the machine), until one is
        interrupted mid-fetch: it raises KeyboardInterrupt, and over gRPC the
        daemon saw a stream of it end cancelled (not read to its end, nor one
        that never started). Returns how long a whole fetch and the
        interrupted one took (s), for the record: how fast is not asserted,
        a loaded machine varies it."""
        page = os.sysconf("SC_PAGE_SIZE")

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        store.tensors(name)  # warm: the page cache, the daemon's checksums
        start = time.perf_counter()
        size = sum(t.numel() * t.element_size() for t in store.tensors(name).values())
        whole = time.perf_counter() - start
        # A fetch that ends before the watcher sees it grow (a fast machine,
        # a watcher not scheduled) is tried again.
        for _ in range(5):
            before = fetch_calls() if over_grpc else None
            base, done = rss(), threading.Event()

            def interrupt_once_grown():
                while not done.is_set():
                    if rss() - base >= size * fraction:
                        os.kill(os.getpid(), signal.SIGINT)
                        done.set()
                    time.sleep(0.0005)

            watcher = threading.Thread(target=interrupt_once_grown)
            start = time.perf_counter()
            watcher.start()
            try:
                store.tensors(name)
                cancelled = False
            except KeyboardInterrupt:
                cancelled = True
            interrupted = time.perf_counter() - start
            try:  # a signal that came after the fetch is taken here, not in another test
                done.set()
                watcher.join()
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass
            if cancelled and over_grpc:
                cancelled = ended_cancelled_since(before)
            if cancelled:
                break
        self.assertTrue(cancelled, "Ctrl-C did not cut a fetch short in five tries")
        return whole, interrupted

    def test_ctrl_c_cancels_a_fetch_in_flight_and_the_store_keeps_working(self):
        # A real SIGINT (Ctrl-C) a tenth of the way in.
        whole, interrupted = self.interrupt(self.remote, "pkg/big", 1 / 10, over_grpc=True)
        print(f"\nCtrl-C: a {whole * 1e3:.0f} ms fetch interrupted a tenth of the way in returned after "
              f"{interrupted * 1e3:.0f} ms")
        got = self.remote.tensors("pkg/big", paths=["w.63"])
        self.assertEqual(got["w.63"][0, 0].item(), 63.0)

    def test_ctrl_c_ends_a_listing_that_waits_on_a_stopped_daemon(self):
        # Issue 26, finding 7: list(), info() and describe() waited for the
        # call's timeout (600 s by default) on Ctrl-C. A daemon of this test's
        # own is stopped (SIGSTOP) so that every call waits; the store's
        # timeout (120 s) only keeps a regression from hanging the suite.
        import subprocess
        import tempfile
        work = tempfile.mkdtemp(prefix="ws-ctrl-c-")
        port_file, socket_path = os.path.join(work, "port"), os.path.join(work, "ws.sock")
        daemon = subprocess.Popen([os.environ["WS_DAEMON"], "--models", MODELS, "--listen", "127.0.0.1:0",
                                   "--port-file", port_file, "--socket", socket_path, "--metrics-listen", ""],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            def port():
                if not os.path.exists(port_file):
                    return ""
                with open(port_file) as f:
                    return f.read().strip()
            while not port():
                self.assertIsNone(daemon.poll(), "the daemon did not start")
                time.sleep(0.02)
            address = "127.0.0.1:" + port()
            stores = {"grpc": weightstore.connect(address, timeout=120),
                      "socket": weightstore.connect("unix:" + socket_path, timeout=120)}
            for store in stores.values():
                store.list()  # connected before the daemon stops
            daemon.send_signal(signal.SIGSTOP)
            # Stopped for certain before any call is made (the signal is
            # delivered asynchronously): the parent hears of the stop.
            _, status = os.waitpid(daemon.pid, os.WUNTRACED)
            self.assertTrue(os.WIFSTOPPED(status), status)
            calls = {"list": lambda s: s.list(), "info": lambda s: s.info("pkg/mlp"),
                     "describe": lambda s: s.describe("pkg/mlp")}
            for label, store in stores.items():
                for call, run in calls.items():
                    with self.subTest(store=label, call=call):
                        timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
                        start = time.perf_counter()
                        timer.start()
                        with self.assertRaises(KeyboardInterrupt):
                            run(store)
                        timer.join()
                        elapsed = time.perf_counter() - start
                        print(f"\nCtrl-C ({label} {call}, daemon stopped): returned {elapsed * 1e3:.0f} ms after "
                              "the call began")
                        # Before the store's 120 s timeout, which is what the
                        # call waited for before (a bound only a hang breaks).
                        self.assertLess(elapsed, 60)
            daemon.send_signal(signal.SIGCONT)
            for label, store in stores.items():  # and the stores keep working
                self.assertIn("pkg/mlp", [c["name"] for c in store.list()], label)
        finally:
            daemon.send_signal(signal.SIGCONT)
            daemon.terminate()
            daemon.wait(timeout=60)

    def test_ctrl_c_cancels_a_fetch_in_the_middle_of_one_large_tensor(self):
        # Over gRPC (one stream), and from local files (copied 64 MiB at a time;
        # that a cancel stops the copy within a piece is CancelTest's, in
        # tests/integration/server_test.cc, and ServedTensorPlanTest's).
        for label, store in (("gRPC", weightstore.connect(ADDRESS, parallel_streams=1)), ("local", self.local)):
            with self.subTest(transport=label):
                whole, interrupted = self.interrupt(store, "pkg/one", 1 / 4, over_grpc=label == "gRPC")
                print(f"\nCtrl-C ({label}): a {whole * 1e3:.0f} ms one-tensor fetch interrupted a quarter of "
                      f"the way in returned after {interrupted * 1e3:.0f} ms")
                got = store.tensors("pkg/one")["w"]
                self.assertEqual(got.numel(), 128 << 20)
                self.assertEqual(got[-1].item(), 1.0)

    def load_one_stores(self):
        """(label, store) pairs that load_into's mid-write tests run over, and
        whether this torch lets load_into write in place (2.1 and later); on
        an older torch each store is checked to load pkg/one by torch's copy
        (nothing is written mid-fetch there) and left out."""
        in_place = getattr(getattr(torch.autograd, "graph", None), "increment_version", None) is not None
        stores = [("gRPC", weightstore.connect(ADDRESS, parallel_streams=1)), ("local", self.local)]
        if not in_place:
            for label, store in stores:
                module = torch.nn.Module()
                module.w = torch.nn.Parameter(torch.zeros(128 << 20))
                self.assertTrue(store.load_into(module, "pkg/one").ok, label)
                self.assertTrue(torch.all(module.w.data == 1.0), label)
            return []
        return stores

    def test_ctrl_c_in_the_middle_of_load_into_says_the_module_may_be_partly_written(self):
        for label, store in self.load_one_stores():
            with self.subTest(transport=label):
                # Until the signal comes before the load's end: one that lands
                # after the native call returned is Python's own bare
                # KeyboardInterrupt (the module is whole then), tried again.
                said = False
                for _ in range(5):
                    module = torch.nn.Module()
                    module.w = torch.nn.Parameter(torch.zeros(128 << 20))
                    version = module.w._version
                    done, watcher = once_written(module.w.data, lambda: os.kill(os.getpid(), signal.SIGINT))
                    try:
                        store.load_into(module, "pkg/one")
                        interrupted = None
                    except KeyboardInterrupt as e:
                        interrupted = e
                    try:  # a signal that came after the load is taken here
                        done.set()
                        watcher.join()
                        time.sleep(0.05)
                    except KeyboardInterrupt:
                        pass
                    said = interrupted is not None and "partly written" in str(interrupted)
                    if said:
                        break
                    if interrupted is not None:  # too late: the load had finished, whole
                        self.assertTrue(torch.all(module.w.data == 1.0), f"{interrupted!r} left a partial load")
                self.assertTrue(said, f"Ctrl-C did not cut a load short in five tries (the last: {interrupted!r})")
                self.assertGreater(module.w._version, version)  # autograd sees the write
                self.assertTrue(store.load_into(module, "pkg/one").ok)  # loading again mends it
                self.assertTrue(torch.all(module.w.data == 1.0))

    def test_a_parameter_replaced_while_load_into_writes_it_is_an_error_naming_it(self):
        for label, store in self.load_one_stores():
            with self.subTest(transport=label):
                for _ in range(5):  # until the replacement comes before the load's end
                    module = torch.nn.Module()
                    module.w = torch.nn.Parameter(torch.zeros(128 << 20))
                    old, new = module.w.data, torch.zeros(128 << 20)  # made before: 512 MiB takes a while
                    done, watcher = once_written(old, lambda: setattr(module.w, "data", new))
                    try:
                        store.load_into(module, "pkg/one")
                        error = None
                    except weightstore.Error as e:
                        error = e
                    done.set()
                    watcher.join()
                    if error is not None:
                        break
                self.assertIsNotNone(error, "no replacement landed during a load in five tries")
                self.assertEqual(error.code, "FAILED_PRECONDITION")
                self.assertIn("['w'] moved while load_into wrote into them", error.message)
                self.assertTrue(torch.all(old == 1.0))  # the old storage was held and written whole
                self.assertTrue(store.load_into(module, "pkg/one").ok)  # loading again fills the new one
                self.assertTrue(torch.all(module.w.data == 1.0))

    def publish(self, name, state):
        """Writes `state` as MODELS/<name>.pt the way a trainer publishes (a
        temporary renamed over it) and has the daemon rescan."""
        path = os.path.join(MODELS, name + ".pt")
        time.sleep(0.015)  # coarse timestamps: keep two versions apart
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        with grpc.insecure_channel(ADDRESS) as channel:
            weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)

    def publish_safetensors(self, name, state):
        """publish(), as a SafeTensors file (written here: Debian's torch 1.13
        has no safetensors package), which pushes can rewrite."""
        dtypes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
        header, blobs, at = {}, [], 0
        for n, t in state.items():
            b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            header[n] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
            blobs.append(b)
            at += len(b)
        encoded = json.dumps(header).encode()
        path = os.path.join(MODELS, name + ".safetensors")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
        os.replace(path + ".tmp", path)
        with grpc.insecure_channel(ADDRESS) as channel:
            weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)

    def test_update_follows_a_trainer_that_pushes_element_patches_from_python(self):
        torch.manual_seed(12)
        trained = torch.nn.Linear(256, 256).to(torch.bfloat16)
        self.publish_safetensors("pkg/pushed", trained.state_dict())
        total = sum(t.element_size() * t.nelement() for t in trained.state_dict().values())
        serving = torch.nn.Linear(256, 256).to(torch.bfloat16)
        held = self.remote.update(serving, "pkg/pushed")
        last = {n: t.clone() for n, t in trained.state_dict().items()}  # as pushed: training writes in place
        with torch.no_grad():
            for p in trained.parameters():
                flat = p.view(-1)
                flat[torch.randperm(flat.numel())[:max(1, flat.numel() // 100)]] += 1.0
        pushed = self.remote.push("pkg/pushed", trained, base=last)
        self.assertEqual(pushed.previous_version, held.version)
        self.assertEqual(sorted(pushed.patched), ["bias", "weight"])
        self.assertEqual((pushed.whole, pushed.removed, pushed.unchanged), ([], [], 0))
        self.assertLess(pushed.sent_bytes, total // 20)
        update = self.remote.update(serving, "pkg/pushed", since=held.version)
        self.assertEqual(update.version, pushed.version)
        self.assertEqual(sorted(update.patched), ["bias", "weight"])
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(serving.state_dict()[n], t), n)
        # Nothing changed: the daemon publishes nothing and says so.
        with self.assertRaises(weightstore.Error) as e:
            self.remote.push("pkg/pushed", trained)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("changes nothing", e.exception.message)
        # Without a base, a changed tensor goes whole and the unchanged stay.
        bias = trained.bias.detach().clone()
        bias[0] += 1.0
        pushed = self.remote.push("pkg/pushed", {"weight": trained.weight, "bias": bias})
        self.assertEqual((pushed.whole, pushed.patched, pushed.unchanged), (["bias"], [], 1))
        # numpy arrays push too: a tensor of another dtype replaces the served
        # one, new ones are added and those the state lacks removed.
        extra, step = np.arange(4, dtype=np.int32), np.array(3.0, dtype=np.float32)  # a 0-d array stays 0-d
        pushed = self.remote.push("pkg/pushed", {"bias": bias.float().numpy(), "extra": extra, "step": step})
        self.assertEqual(sorted(pushed.whole), ["bias", "extra", "step"])
        self.assertEqual(sorted(pushed.removed), ["bias", "weight"])
        got = self.remote.tensors("pkg/pushed")
        self.assertEqual(sorted(got), ["bias", "extra", "step"])
        self.assertEqual(tuple(got["step"].shape), ())
        self.assertTrue(same_bytes(got["bias"], bias.float()))
        self.assertTrue(same_bytes(got["extra"], torch.arange(4, dtype=torch.int32)))
        # Only a daemon reached over gRPC takes pushes.
        with self.assertRaises(weightstore.Error) as e:
            self.socket.push("pkg/pushed", trained)
        self.assertEqual(e.exception.code, "UNIMPLEMENTED")

    def test_update_fetches_only_the_changed_tensors_into_a_dict(self):
        weights = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(10)}
        self.publish("pkg/upd", weights)
        state = {}
        first = self.remote.update(state, "pkg/upd")
        self.assertFalse(first.delta)
        self.assertEqual(sorted(first.added), sorted(weights))
        weights["layer.3.weight"] = torch.randn(64, 64)
        weights["layer.7.weight"] = torch.randn(64, 64)
        del weights["layer.9.weight"]
        weights["head.weight"] = torch.randn(8, 64)
        self.publish("pkg/upd", weights)
        second = self.remote.update(state, "pkg/upd", since=first.version)
        self.assertTrue(second.delta, second.full_reason)
        self.assertEqual(sorted(second.changed), ["layer.3.weight", "layer.7.weight"])
        self.assertEqual(second.added, ["head.weight"])
        self.assertEqual(second.removed, ["layer.9.weight"])
        self.assertEqual(second.fetched_bytes, (2 * 64 + 8) * 64 * 4)
        self.assertEqual(sorted(state), sorted(weights))
        for n, t in weights.items():
            self.assertTrue(same_bytes(state[n], t), n)
        # A version the daemon keeps no digests of is a full fetch that says so.
        third = self.remote.update(state, "pkg/upd", since="0123456789abcdef")
        self.assertFalse(third.delta)
        self.assertIn("0123456789abcdef", third.full_reason)
        # Through the socket the changed tensors are mapped, and the others
        # keep their mappings.
        mapped = {}
        first_map = self.socket.update(mapped, "pkg/upd")
        kept = mapped["layer.1.weight"]
        weights["layer.0.weight"] = torch.randn(64, 64)
        self.publish("pkg/upd", weights)
        again = self.socket.update(mapped, "pkg/upd", since=first_map.version)
        self.assertTrue(again.delta, again.full_reason)
        self.assertEqual(again.changed, ["layer.0.weight"])
        self.assertIs(mapped["layer.1.weight"], kept)
        for n, t in weights.items():
            self.assertTrue(same_bytes(mapped[n], t), n)
        # A local store tells nothing: a full read that says so.
        files, local = weightstore.connect("file:" + MODELS), {}  # opened after the file was written
        first_local = files.update(local, "pkg/upd")
        full = files.update(local, "pkg/upd", since=first_local.version)
        self.assertFalse(full.delta)
        self.assertIn("does not tell", full.full_reason)

    def test_update_refetches_what_another_shard_rank_or_dtype_selects(self):
        # Issue 26, finding 8: after the rank or dtype changed, update() kept
        # the tensors of the old selection and reported nothing changed.
        weights = {f"layer.{i}.weight": torch.randn(8, 4) for i in range(3)}
        self.publish("pkg/reshard", weights)
        rules = {r"weight$": 0}
        for store in (self.remote, self.socket):
            state = {}
            first = store.update(state, "pkg/reshard", shard=(0, 2, rules))
            second = store.update(state, "pkg/reshard", since=first.version, shard=(1, 2, rules))
            self.assertFalse(second.delta)
            self.assertIn("another selection", second.full_reason)
            self.assertEqual(sorted(second.changed), sorted(weights))
            for n, t in weights.items():
                self.assertTrue(same_bytes(state[n], t[4:].contiguous()), n)  # rank 1's rows
            third = store.update(state, "pkg/reshard", since=second.version, shard=(1, 2, rules), dtype="f16")
            self.assertFalse(third.delta)
            for n, t in weights.items():
                self.assertTrue(same_bytes(state[n], t[4:].half().contiguous()), n)
            # The same selection again: a delta, nothing fetched.
            fourth = store.update(state, "pkg/reshard", since=third.version, shard=(1, 2, rules), dtype="f16")
            self.assertTrue(fourth.delta, fourth.full_reason)
            self.assertEqual(fourth.fetched_bytes, 0)
            # A state from elsewhere (another Store, no memory of it) whose
            # dtype differs from the listing is refetched too.
            other = weightstore.connect(ADDRESS if store is self.remote else "unix:" + SOCKET)
            fifth = other.update(state, "pkg/reshard", since=fourth.version, shard=(1, 2, rules))
            self.assertFalse(fifth.delta)
            self.assertIn("selection (shard, dtype, renames...) is not known", fifth.full_reason)
            self.assertEqual(state["layer.0.weight"].dtype, torch.float32)

    def test_update_of_a_state_it_did_not_fill_fetches_it_whole_and_one_tensors_filled_is_a_delta(self):
        # Rank 0's rows have rank 1's shape: a state whose selection is not
        # known must not pass as rank 1's, unchanged.
        weights = {f"layer.{i}.weight": torch.randn(8, 4) for i in range(3)}
        self.publish("pkg/unrecorded", weights)
        rules = {r"weight$": 0}
        for store in (self.remote, self.socket):
            version = store.info("pkg/unrecorded")["version"]
            state = dict(weightstore.connect(ADDRESS).tensors("pkg/unrecorded", shard=(0, 2, rules)))
            update = store.update(state, "pkg/unrecorded", since=version, shard=(1, 2, rules))
            self.assertFalse(update.delta)
            self.assertIn("is not known", update.full_reason)
            for n, t in weights.items():
                self.assertTrue(same_bytes(state[n], t[4:].contiguous()), n)  # rank 1's rows
            # What tensors() of this Store filled is known, pinned or not
            # (the fetch says which version it sent): a delta.
            for pinned in ({"version": version}, {}):
                mine = store.tensors("pkg/unrecorded", shard=(1, 2, rules), **pinned)
                again = store.update(mine, "pkg/unrecorded", since=version, shard=(1, 2, rules))
                self.assertTrue(again.delta, (pinned, again.full_reason))
                self.assertEqual(again.fetched_bytes, 0)

    def test_update_copies_the_changed_tensors_into_a_module_in_place(self):
        torch.manual_seed(5)
        trained = make_model()
        self.publish("pkg/updmlp", trained.state_dict())
        serving = make_model()
        first = self.remote.update(serving, "pkg/updmlp")
        weight = serving[0].weight
        with torch.no_grad():
            trained[3].weight.add_(1.0)
        self.publish("pkg/updmlp", trained.state_dict())
        second = self.remote.update(serving, "pkg/updmlp", since=first.version)
        self.assertTrue(second.delta, second.full_reason)
        self.assertEqual(second.changed, ["3.weight"])
        self.assertIs(serving[0].weight, weight)  # in place: the same parameter objects
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(serving.state_dict()[n], t), n)
        # A checkpoint that does not fit is refused before anything is copied.
        other = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.BatchNorm1d(48), torch.nn.ReLU(),
                                    torch.nn.Linear(48, 9))
        before = {n: t.clone() for n, t in other.state_dict().items()}
        with self.assertRaises(weightstore.Error) as e:
            self.remote.update(other, "pkg/updmlp")
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("3.weight: shape [8, 48], held as [9, 48]", e.exception.message)
        for n, t in other.state_dict().items():
            self.assertTrue(same_bytes(t, before[n]), n)

    def test_update_writes_an_rl_steps_element_patches_into_the_module_in_one_call(self):
        torch.manual_seed(9)
        trained = torch.nn.Linear(256, 256).to(torch.bfloat16)
        self.publish("pkg/rl", trained.state_dict())
        serving = torch.nn.Linear(256, 256).to(torch.bfloat16)
        held = {}
        first = self.remote.update(serving, "pkg/rl")
        first_dict = self.remote.update(held, "pkg/rl")
        weight, before = serving.weight, held["weight"]
        # An RL step: 1% of every tensor's elements move.
        with torch.no_grad():
            for p in trained.parameters():
                flat = p.view(-1)
                flat[torch.randperm(flat.numel())[:max(1, flat.numel() // 100)]] += 1.0
        self.publish("pkg/rl", trained.state_dict())
        total = sum(t.element_size() * t.nelement() for t in trained.state_dict().values())
        second = self.remote.update(serving, "pkg/rl", since=first.version)
        self.assertTrue(second.delta, second.full_reason)
        self.assertEqual(second.patched, ["weight", "bias"])
        self.assertEqual(second.patch_reason, "")
        self.assertLess(second.fetched_bytes, total // 20)
        self.assertIs(serving.weight, weight)  # written in place
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(serving.state_dict()[n], t), n)
        # A dict gets patched copies: tensors handed out before keep their bytes.
        kept = before.clone()
        again = self.remote.update(held, "pkg/rl", since=first_dict.version)
        self.assertEqual(again.patched, ["weight", "bias"])
        self.assertTrue(same_bytes(before, kept))
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(held[n], t), n)
        # A module changed here is not what `since` names: the patched result
        # fails its digest check, and the changed tensors come whole.
        with torch.no_grad():
            serving.weight.view(-1)[0] += 1.0
            trained.weight.view(-1)[1:3] += 1.0
            trained.bias.view(-1)[0] += 1.0
        self.publish("pkg/rl", trained.state_dict())
        third = self.remote.update(serving, "pkg/rl", since=second.version)
        self.assertEqual(third.patched, [])
        self.assertEqual(third.changed, ["weight", "bias"])
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(serving.state_dict()[n], t), n)
        # Through the socket: the patches are mapped, and written in place.
        local = torch.nn.Linear(256, 256).to(torch.bfloat16)
        on_socket = self.socket.update(local, "pkg/rl")
        weight = local.weight
        with torch.no_grad():
            for p in trained.parameters():
                flat = p.view(-1)
                flat[torch.randperm(flat.numel())[:max(1, flat.numel() // 100)]] += 1.0
        self.publish("pkg/rl", trained.state_dict())
        on_socket = self.socket.update(local, "pkg/rl", since=on_socket.version)
        self.assertTrue(on_socket.delta, on_socket.full_reason)
        self.assertEqual(on_socket.patched, ["weight", "bias"])
        self.assertLess(on_socket.fetched_bytes, total // 20)
        self.assertIs(local.weight, weight)
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(local.state_dict()[n], t), n)

    def test_update_changes_hand_out_an_rl_steps_patches_as_flat_indices_and_values(self):
        torch.manual_seed(13)
        trained = torch.nn.Linear(256, 256).to(torch.bfloat16)
        self.publish("pkg/changes", trained.state_dict())
        held = {}
        since = self.remote.update(held, "pkg/changes").version
        with torch.no_grad():
            for p in trained.parameters():
                flat = p.view(-1)
                flat[torch.randperm(flat.numel())[:max(1, flat.numel() // 100)]] += 1.0
        self.publish("pkg/changes", trained.state_dict())
        total = sum(t.element_size() * t.nelement() for t in trained.state_dict().values())
        for store in (self.remote, self.socket):
            changes = store.changes("pkg/changes", since=since)
            self.assertTrue(changes.delta, changes.full_reason)
            self.assertEqual((changes.since, changes.names, changes.tensors), (since, ["weight", "bias"], {}))
            self.assertEqual(changes.version, self.remote.info("pkg/changes")["version"])
            self.assertLess(changes.fetched_bytes, total // 20)
            self.assertEqual(changes.patched, ["weight", "bias"])
            self.assertEqual([p.name for p in changes.decode()], ["weight", "bias"])
            self.assertIs(changes.decode(), changes.decode())  # decoded once
            for patch in changes.decode():
                self.assertEqual((patch.dtype, patch.shape), ("BF16", tuple(trained.state_dict()[patch.name].shape)))
                self.assertEqual((patch.indices.dtype, patch.values.dtype), (torch.int64, torch.bfloat16))
                self.assertEqual(patch.indices.numel(), patch.values.numel())
                self.assertTrue(bool((patch.indices[1:] > patch.indices[:-1]).all()))  # ascending, each once
                written = held[patch.name].clone()
                written.view(-1)[patch.indices] = patch.values
                self.assertTrue(same_bytes(written, trained.state_dict()[patch.name]), patch.name)
                self.assertEqual(len(patch.digest), 32)
            # apply() writes them into copies, checked against the digests.
            before = held["weight"].clone()
            applied = changes.apply(held)
            self.assertTrue(same_bytes(held["weight"], before))
            for n, t in trained.state_dict().items():
                self.assertTrue(same_bytes(applied[n], t), n)
            # In place: into the held tensors themselves.
            mine = {n: t.clone() for n, t in held.items()}
            written = changes.apply(mine, in_place=True)
            self.assertEqual(written["weight"].data_ptr(), mine["weight"].data_ptr())
            for n, t in trained.state_dict().items():
                self.assertTrue(same_bytes(mine[n], t), n)
            wrong = dict(held, weight=held["weight"].clone())
            wrong["weight"].view(-1)[0] += 1.0
            with self.assertRaises(weightstore.Error) as e:
                changes.apply(wrong)
            self.assertEqual(e.exception.code, "DATA_LOSS")
            self.assertIn("'weight'", e.exception.message)
            with self.assertRaises(weightstore.Error) as e:
                changes.apply({"weight": held["weight"].float(), "bias": held["bias"]})
            self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        # The changed tensors whole instead, and everything without `since`.
        whole = self.remote.changes("pkg/changes", since=since, patches=False)
        self.assertEqual((whole.patched, whole.decode(), sorted(whole.tensors)), ([], [], ["bias", "weight"]))
        everything = self.remote.changes("pkg/changes", since=None)
        self.assertFalse(everything.delta)
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(everything.tensors[n], t), n)

    def test_iter_tensors_yields_every_tensor_in_batches_pinned_to_one_version(self):
        name = "pkg/mlp"
        expected = self.remote.tensors(name)
        for store in (self.remote, self.socket, self.local):
            for batch_bytes in (1, 1 << 30):  # one tensor a batch; one batch
                got = list(store.iter_tensors(name, batch_bytes=batch_bytes))
                self.assertEqual([n for n, _ in got], list(expected))
                for n, t in got:
                    self.assertTrue(same_bytes(t, expected[n]), n)
        renamed = list(self.remote.iter_tensors(name, batch_bytes=1, rename=[("^", "m.")], exclude=["bias"]))
        self.assertEqual([n for n, _ in renamed], ["m." + n for n in expected if "bias" not in n])
        with self.assertRaises(ValueError):
            next(self.remote.iter_tensors(name, batch_bytes=0))

    def test_update_scatters_an_rl_steps_patches_into_a_gpu_module_or_says_there_is_no_gpu(self):
        def rl_step(module):
            with torch.no_grad():
                for p in module.parameters():
                    flat = p.view(-1)
                    flat[torch.randperm(flat.numel())[:max(1, flat.numel() // 100)]] += 1.0

        torch.manual_seed(11)
        trained = torch.nn.Linear(256, 256).to(torch.bfloat16)
        self.publish("pkg/rl_gpu", trained.state_dict())
        held = {}
        first = self.remote.update(held, "pkg/rl_gpu")
        rl_step(trained)
        self.publish("pkg/rl_gpu", trained.state_dict())
        if not torch.cuda.is_available():
            # The device path fails cleanly without a GPU, before any host
            # destination of the same call is written.
            got = self.remote._native.delta("pkg/rl_gpu", weightstore._selection(), first.version, True)
            self.assertEqual(sorted(got["patched"]), ["bias", "weight"])
            weight, bias = held["weight"].clone(), held["bias"].clone()
            size = lambda t: t.element_size() * t.nelement()  # torch 1.13 has no Tensor.nbytes
            destinations = {"weight": (weight.data_ptr(), size(weight), 0), "bias": (bias.data_ptr(), size(bias))}
            with self.assertRaises(weightstore.Error) as e:
                self.remote._native.apply_patches(got["patches"], destinations)
            self.assertEqual(e.exception.code, "UNAVAILABLE" if weightstore._native.has_cuda else "UNIMPLEMENTED")
            self.assertTrue(same_bytes(bias, held["bias"]))
            return  # the scatter itself runs where a GPU is
        serving = torch.nn.Linear(256, 256).to(torch.bfloat16).cuda()
        on_gpu = self.remote.update(serving, "pkg/rl_gpu")
        weight = serving.weight
        rl_step(trained)
        self.publish("pkg/rl_gpu", trained.state_dict())
        update = self.remote.update(serving, "pkg/rl_gpu", since=on_gpu.version)
        self.assertEqual(update.patched, ["weight", "bias"])
        self.assertIs(serving.weight, weight)
        for n, t in trained.state_dict().items():
            self.assertTrue(same_bytes(serving.state_dict()[n].cpu(), t), n)

    def test_two_watchers_keep_torch_models_equal_to_each_new_version(self):
        # A trainer publishes five versions, each changing another parameter;
        # two watchers hear of each over gRPC (events come only that way) and
        # apply the delta to a torch model of their own: one fetching over
        # gRPC, the other mapping through the socket.
        torch.manual_seed(7)
        trainer = make_model()
        self.publish("pkg/followed", trainer.state_dict())
        stores = {"grpc": self.remote, "socket": self.socket}
        models = {label: make_model() for label in stores}
        versions = {label: store.update(models[label], "pkg/followed").version for label, store in stores.items()}
        params = [n for n, _ in trainer.named_parameters()]
        for v in range(5):
            with torch.no_grad():
                dict(trainer.named_parameters())[params[v % len(params)]].add_(0.5)
            self.publish("pkg/followed", trainer.state_dict())
            for label, store in stores.items():
                seen = []
                self.remote.watch(lambda e: seen.append(e) or e["kind"] != "replaced", name="pkg/followed",
                                  known={"pkg/followed": versions[label]})
                self.assertEqual(seen[0]["changed"], [params[v % len(params)]], label)
                u = store.update(models[label], "pkg/followed", since=versions[label])
                self.assertTrue(u.delta, u.full_reason)
                self.assertEqual(u.changed, [params[v % len(params)]])
                versions[label] = u.version
                full = self.remote.tensors("pkg/followed", version=u.version)
                for n, t in models[label].state_dict().items():
                    self.assertTrue(same_bytes(t, full[n]), f"{label} {n} after version {v + 2}")

    def test_watch_reports_each_new_version_with_the_tensors_that_changed(self):
        weights = {f"w.{i}": torch.full((16,), float(i)) for i in range(4)}
        self.publish("pkg/watched", weights)
        events = []

        def on_event(event):
            events.append(event)
            if event["kind"] == "synced":
                weights["w.2"] = torch.zeros(16)
                threading.Thread(target=self.publish, args=("pkg/watched", weights)).start()
            return event["kind"] != "replaced"

        self.remote.watch(on_event, name="pkg/watched")
        self.assertEqual([e["kind"] for e in events], ["added", "synced", "replaced"])
        self.assertEqual(events[2]["changed"], ["w.2"])
        self.assertTrue(events[2]["delta"])
        self.assertEqual(events[2]["old_version"], events[0]["new_version"])
        with self.assertRaises(weightstore.Error) as e:
            self.local.watch(on_event)
        self.assertEqual(e.exception.code, "UNIMPLEMENTED")


if __name__ == "__main__":
    unittest.main(verbosity=2)
