"""weightstore.safe_open against safetensors.safe_open, the judge, on the same
files: keys, metadata, every tensor, slices (edge cases and random ones) and
errors, through every store (gRPC, the daemon's socket, local files) and both
frameworks ("pt", "np"), plus a sharded checkpoint compared with the library
opening each shard.

Needs a running weightstored: WS_ADDRESS (its gRPC address), WS_SOCKET (its
socket path) and WS_MODELS (its models folder, writable: the files are written
under safe_open/ and the daemon is asked to rescan). The package comes from
PYTHONPATH (the build tree) or the venv it was installed into.

The library indexes per framework, and so does weightstore.safe_open:
- "pt": torch's indexing of the whole tensor. Everything must match: values,
  dtype, shape, and errors (the same type, torch's message inside ours).
- "np": the library's own indexer, which refuses some slices numpy takes: a
  negative end (OverflowError), an end past the dimension or a start at it,
  even `:` or `...` over a dimension of size 0 (SafetensorError "... out of
  bounds"), a stop before the start (SystemError). weightstore returns
  numpy's result there instead (checked against numpy on the whole array).
  Everywhere else values, dtype and shape match, and errors are instances of
  the library's exception type (SafetensorError; ours are also IndexError,
  ValueError, TypeError or KeyError)."""
import json
import operator
import os
import random
import unittest
import warnings

import numpy as np
import torch

import grpc
import safetensors
import safetensors.numpy
import safetensors.torch
import weightstore
from huggingface_hub import save_torch_state_dict
from weightstore.v1 import weight_store_pb2, weight_store_pb2_grpc

from _support import random_bits, rescan

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]
FOLDER = "safe_open"  # under MODELS


def np_library_takes(index, shape):
    """Whether the library's np indexer is judge for `index`: false only for
    an index of ints, slices with positive steps and one Ellipsis where a
    slice has an end numpy takes and the library does not (negative, past the
    dimension, a start at the dimension even for `:` over a size 0, a stop
    before the start). The library raises OverflowError, SafetensorError
    ("out of bounds"), SystemError, ValueError or even a pyo3 PanicException
    there, where numpy (and weightstore) answer."""
    if isinstance(index, list) and not index:
        index = (slice(0, 0),)
    items = index if isinstance(index, tuple) else (index,)

    def plain(i):
        return isinstance(i, (int, np.integer)) or i is Ellipsis or (
            isinstance(i, slice) and all(e is None or isinstance(e, (int, np.integer)) for e in (i.start, i.stop)) and
            (i.step is None or (isinstance(i.step, (int, np.integer)) and i.step > 0)))
    consuming = [i for i in items if i is not Ellipsis]
    if not all(plain(i) for i in items) or sum(i is Ellipsis for i in items) > 1:
        return True
    if any(isinstance(i, slice) and any(e is not None and not 0 <= e < 2**64 for e in (i.start, i.stop))
           for i in items):
        return False  # ends are converted to unsigned integers first
    if len(consuming) > len(shape):
        return True
    expanded = []
    for i in items:
        expanded += [slice(None)] * (len(shape) - len(consuming)) if i is Ellipsis else [i]
    for i, n in zip(expanded, shape):
        if isinstance(i, slice):
            start = 0 if i.start is None else i.start
            stop = n if i.stop is None else i.stop
            if not (start < n and start <= stop <= n):
                return False
    return True






def same(got, want):
    """Bit equality, dtype, shape and kind (torch tensor or numpy array)."""
    if isinstance(want, torch.Tensor):
        def raw(t):  # row-major bytes (the library's views can have any strides)
            return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).reshape(-1).view(torch.uint8)
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape and
                got.device == want.device and torch.equal(raw(got.cpu()), raw(want.cpu())))
    return (type(got) is np.ndarray and type(want) is np.ndarray and got.dtype == want.dtype and
            got.shape == want.shape and got.tobytes() == want.tobytes())


def attempt(fn):
    """(result, None) or (None, exception)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation and truncation warnings
            return fn(), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # compared with what the library raised (a pyo3 panic is a BaseException)
        return None, e


def random_index(rng, shape, framework):
    """An index the library takes or refuses: ints in and out of range, slices
    with None, negative and out-of-range ends and steps, Ellipsis, fewer
    indices than dimensions, None (a new axis, torch only)."""
    count = rng.randint(0, len(shape))
    items = []
    for size in shape[:count]:
        roll = rng.random()
        if roll < 0.25 and size > 0:
            items.append(rng.randrange(-size, size))
        elif roll < 0.3:
            items.append(rng.choice([size, -size - 1]))
        else:
            start = rng.choice([None, rng.randint(-size - 2, size + 2), rng.randint(0, max(size - 1, 0))])
            stop = rng.choice([None, rng.randint(-size - 2, size + 2), rng.randint(0, size)])
            items.append(slice(start, stop, rng.choice([None, 1, 1, 2, 3, size + 1])))
    if framework == "pt" and rng.random() < 0.15:
        items.insert(rng.randint(0, len(items)), None)
    if rng.random() < 0.2:
        items.insert(rng.randint(0, len(items)), Ellipsis)
    if len(items) == 1 and rng.random() < 0.5:
        return items[0]
    return tuple(items)


# Indices chosen for their edges, tried on every tensor of the fixture.
EDGE_INDICES = [
    0, -1, 1, 2, -3, slice(None), (), Ellipsis, (Ellipsis, 1), (0, Ellipsis, 2), (Ellipsis, Ellipsis),
    (slice(None), 1), (slice(0, 1), slice(None, None, 2)), (slice(-2, None),), (1, 2, 3), (0, 0, 0, 0),
    slice(5, 10), slice(-10, 10), slice(2, 2), slice(1, 1), slice(0, 0), slice(None, 10), slice(1, 0),
    (slice(3, 1),), slice(2, None), (slice(None), slice(3, None)), (slice(None), 3), (1, slice(2, 2)),
    (Ellipsis, slice(0, 0)), (slice(None), slice(None), slice(None, None, 3)), (slice(1, None, 2),),
    (slice(0, 2, 2), slice(1, 3, 2), slice(None, None, 5)), (slice(1, None, 10),), slice(None, None, 100),
    slice(0, 2**70), slice(-2**70, 1), 2**70, slice(None, None, -1), (slice(None, None, 0),),
    np.int64(1), np.int64(-1), slice(np.int64(1), None), slice(None, None, np.int64(2)), True, False,
    torch.tensor(1), [], [0], [1, 0], (slice(None), [0, 2]), np.array([1, 0]), torch.tensor([1, 0]),
    (None,), (None, 0), (0, None), (slice(None), None, 1), "a", 1.0, slice(0.5, None),
]


class SafeOpenTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        folder = os.path.join(MODELS, FOLDER)
        os.makedirs(os.path.join(folder, "shard"), exist_ok=True)
        g = torch.Generator().manual_seed(20)
        cls.mixed = {
            "model.embed.weight": torch.randn(37, 16, generator=g),
            "model.layers.0.attn.qkv.weight": torch.randn(48, 16, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.w": torch.randn(8, 12, 6, generator=g).to(torch.float16),
            "model.layers.0.norm": torch.randn(16, generator=g, dtype=torch.float64),
            "model.layers.10.norm": torch.randn(3, generator=g),
            "model.layers.9.norm": torch.randn(3, generator=g),
            "B.upper": torch.randn(2, generator=g),
            "cube": torch.randn(3, 4, 5, 6, generator=g),
            "ids": torch.randint(-2**40, 2**40, (25,), generator=g),
            "i32": random_bits((5, 7), torch.int32, g),
            "i16": random_bits((9,), torch.int16, g),
            "i8": random_bits((4, 4), torch.int8, g),
            "u8": random_bits((33,), torch.uint8, g),
            "u16": random_bits((3, 5), torch.uint16, g),
            "u32": random_bits((6,), torch.uint32, g),
            "u64": random_bits((2, 3), torch.uint64, g),
            "mask": random_bits((7, 5), torch.bool, g),
            "nan_bits": random_bits((64,), torch.float32, g),
            "f8_e4m3": random_bits((6, 10), torch.float8_e4m3fn, g),
            "f8_e5m2": random_bits((10,), torch.float8_e5m2, g),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "empty_mid": torch.zeros(3, 0, 2, dtype=torch.int16),
        }
        cls.metadata = {"format": "pt", "note": "ünïcode ✓", "blank": ""}
        cls.paths = {name: os.path.join(folder, name + ".safetensors")
                     for name in ("mixed", "nometa", "emptymeta", "numpy")}
        safetensors.torch.save_file(cls.mixed, cls.paths["mixed"], metadata=cls.metadata)
        safetensors.torch.save_file({"a": torch.arange(6.0).reshape(2, 3)}, cls.paths["nometa"])
        safetensors.torch.save_file({"a": torch.arange(6.0).reshape(2, 3)}, cls.paths["emptymeta"], metadata={})
        rng = np.random.default_rng(3)
        cls.arrays = {"f64": rng.standard_normal((4, 5)), "f32": rng.standard_normal((3, 7)).astype(np.float32),
                      "f16": rng.standard_normal(11).astype(np.float16), "i64": rng.integers(-99, 99, (2, 2, 2)),
                      "u16": rng.integers(0, 2**16, (5,), dtype=np.uint16), "bool": rng.random((3, 3)) > 0.5,
                      "zero_d": np.array(7, dtype=np.int32)}
        safetensors.numpy.save_file(cls.arrays, cls.paths["numpy"], metadata={"made_by": "numpy"})
        # A sharded checkpoint as huggingface_hub (and so transformers) writes it.
        cls.sharded = {f"layers.{i}.w": torch.randn(16, 8 + i, generator=g) for i in range(6)}
        cls.sharded["embed"] = torch.randn(40, 8, generator=g).to(torch.bfloat16)
        cls.sharded["head.bias"] = random_bits((8,), torch.uint8, g)
        save_torch_state_dict(cls.sharded, os.path.join(folder, "shard"), max_shard_size=1500,
                              metadata={"origin": "test_safe_open"})
        cls.shard_dir = os.path.join(folder, "shard")
        with open(os.path.join(cls.shard_dir, "model.safetensors.index.json")) as f:
            cls.index = json.load(f)
        rescan()
        cls.stores = {"grpc": weightstore.connect(ADDRESS), "socket": weightstore.connect("unix:" + SOCKET),
                      "local": weightstore.connect("file:" + MODELS)}

    def name(self, key):
        return f"{FOLDER}/{key}"

    def both(self, key, framework, label):
        """(the library's safe_open on the file, weightstore's over the store)."""
        return (safetensors.safe_open(self.paths[key], framework),
                weightstore.safe_open(self.stores[label], self.name(key), framework=framework))

    def whole(self, key, framework):
        """The tensor as numpy has it, for numpy's answers to the slices the library's np indexer refuses."""
        return self.mixed[key].numpy() if framework == "np" else None

    def each(self):
        for label in self.stores:
            for framework in ("pt", "np"):
                yield label, framework

    def compare_index(self, lib_slice, our_slice, full, index, framework, checkpoint, key):
        """One index through the library and through weightstore (see the module's docstring)."""
        got, our_error = attempt(lambda: our_slice[index])
        where = f"{checkpoint} {key} {framework} {index!r}"
        if framework == "np" and not np_library_takes(index, lib_slice.get_shape()):
            # The library refuses it (some such indices make it panic): numpy's answer.
            items = (slice(0, 0),) if isinstance(index, list) else index if isinstance(index, tuple) else (index,)
            items = items if any(i is Ellipsis for i in items) else items + (Ellipsis,)  # 0-d: an array
            want, np_error = attempt(lambda: np.ascontiguousarray(full[items]))
            if np_error is None:
                self.assertIsNone(our_error, where)
                self.assertTrue(same(got, want), f"{where}: {got!r} != {want!r}")
            else:
                self.assertIsNotNone(our_error, f"{where}: numpy raises {np_error!r}")
            return
        want, lib_error = attempt(lambda: lib_slice[index])
        if lib_error is None:
            self.assertIsNone(our_error, f"{where}: the library returns {getattr(want, 'shape', None)}")
            self.assertTrue(same(got, want), f"{where}: {got!r} != {want!r}")
            return
        if our_error is not None:
            self.assertIn(checkpoint, str(our_error), where)
            self.assertIn(f"'{key}'", str(our_error), where)
            if framework == "pt":
                self.assertIsInstance(our_error, type(lib_error), f"{where}: {our_error!r} vs {lib_error!r}")
                self.assertIn(str(lib_error), str(our_error), where)
            elif isinstance(lib_error, OverflowError):  # converting an end, before the step is checked
                self.assertIsInstance(our_error, safetensors.SafetensorError, where)
            else:
                self.assertIsInstance(our_error, type(lib_error), f"{where}: {our_error!r} vs {lib_error!r}")
            return
        self.fail(f"{where}: the library raises {lib_error!r}, weightstore returns {got!r}")

    def test_keys_are_sorted_and_metadata_is_the_files_like_the_library(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                for key in ("mixed", "nometa", "numpy"):
                    lib, ours = self.both(key, framework, label)
                    self.assertEqual(ours.keys(), lib.keys(), key)
                    self.assertEqual(ours.offset_keys(), lib.offset_keys(), key)
                    self.assertEqual(ours.metadata(), lib.metadata(), key)
                self.assertIsNone(self.both("nometa", framework, label)[1].metadata())

    @unittest.expectedFailure
    def test_an_explicitly_empty_metadata_is_an_empty_dict_like_the_library(self):
        # DIFFERENCE (C++/API): a header with "__metadata__": {} opens in the
        # library with metadata() == {}, one without it with None; the store's
        # checkpoint info has a map that is empty in both cases, so
        # weightstore.safe_open answers None for both.
        lib, ours = self.both("emptymeta", "pt", "grpc")
        self.assertEqual(lib.metadata(), {})
        self.assertEqual(ours.metadata(), lib.metadata())

    def test_every_tensor_is_bit_identical_to_the_librarys_in_both_frameworks(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                for key in ("mixed", "numpy"):
                    lib, ours = self.both(key, framework, label)
                    for name in lib.keys():
                        want, lib_error = attempt(lambda: lib.get_tensor(name))
                        got, our_error = attempt(lambda: ours.get_tensor(name))
                        if lib_error is not None:  # numpy has no bfloat16 or float8
                            self.assertEqual(framework, "np")
                            self.assertIsInstance(our_error, TypeError, name)
                            self.assertIn(name, str(our_error))
                            self.assertIn(ours.get_slice(name).get_dtype(), str(our_error))
                            continue
                        self.assertIsNone(our_error, name)
                        self.assertTrue(same(got, want), f"{key} {name}")
                    if key == "numpy" or framework == "pt":
                        got = ours.get_tensors()
                        want = lib.get_tensors()
                        self.assertEqual(list(got), list(want))
                        for name in want:
                            self.assertTrue(same(got[name], want[name]), name)

    def test_numpy_lacks_bf16_so_np_raises_type_error_like_the_library(self):
        lib, ours = self.both("mixed", "np", "socket")
        key = "model.layers.0.attn.qkv.weight"
        for fn in (lambda f: f.get_tensor(key), lambda f: f.get_slice(key)[0]):
            with self.assertRaises(TypeError):
                fn(lib)
            with self.assertRaises(TypeError) as e:
                fn(ours)
            self.assertIn(f"'{key}'", str(e.exception))
            self.assertIn("BF16", str(e.exception))
            self.assertIn(self.name("mixed"), str(e.exception))

    def test_slices_report_the_librarys_shape_and_dtype_strings(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                lib, ours = self.both("mixed", framework, label)
                for name in lib.keys():
                    self.assertEqual(ours.get_slice(name).get_shape(), lib.get_slice(name).get_shape(), name)
                    self.assertEqual(ours.get_slice(name).get_dtype(), lib.get_slice(name).get_dtype(), name)

    def test_edge_case_indices_match_the_library_in_values_dtype_shape_and_errors(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                lib, ours = self.both("mixed", framework, label)
                for key in ("cube", "model.embed.weight", "ids", "scalar", "empty", "empty_mid", "mask", "u16",
                            "f8_e4m3"):
                    if framework == "np" and key.startswith("f8"):
                        continue  # numpy has no float8: the library's np framework raises for any index
                    for index in EDGE_INDICES:
                        self.compare_index(lib.get_slice(key), ours.get_slice(key), self.whole(key, framework),
                                           index, framework, self.name("mixed"), key)

    def test_random_slices_match_the_library(self):
        rng = random.Random(1234)
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                lib, ours = self.both("mixed", framework, label)
                for key in ("cube", "model.embed.weight", "model.layers.0.mlp.w", "empty_mid", "u64"):
                    shape = lib.get_slice(key).get_shape()
                    for _ in range(40):
                        index = random_index(rng, shape, framework)
                        self.compare_index(lib.get_slice(key), ours.get_slice(key), self.whole(key, framework),
                                           index, framework, self.name("mixed"), key)

    def test_a_slice_is_cut_on_the_server_and_a_step_fetches_only_its_covering_box(self):
        class Recording(weightstore.Store):
            def __init__(self, store):
                super().__init__(store._native)
                self.calls = []

            def tensors(self, name, **selection):
                got = super().tensors(name, **selection)
                self.calls.append((selection, {k: tuple(v.shape) for k, v in got.items()}))
                return got

        key = "model.embed.weight"  # [37, 16]
        for label, store in self.stores.items():
            with self.subTest(transport=label):
                recording = Recording(store)
                f = weightstore.safe_open(recording, self.name("mixed"))
                part = f.get_slice(key)
                self.assertEqual((part.get_shape(), part.get_dtype()), ([37, 16], "F32"))
                self.assertEqual(recording.calls, [])  # keys, shapes and dtypes come from the listing
                cases = [  # index, the box asked of the server, the shape it sends
                    ((slice(5, 9),), (slice(5, 9), slice(0, 16)), (4, 16)),
                    ((slice(None), slice(-4, None)), (slice(0, 37), slice(12, 16)), (37, 4)),
                    ((3,), (slice(3, 4), slice(0, 16)), (1, 16)),
                    ((slice(1, 10, 4), 2), (slice(1, 10), slice(2, 3)), (9, 1)),
                    ((Ellipsis, slice(0, 16, 5)), (slice(0, 37), slice(0, 16)), None),  # the whole: no slice
                    ((slice(30, 99),), (slice(30, 37), slice(0, 16)), (7, 16)),
                ]
                for index, box, sent in cases:
                    recording.calls.clear()
                    got = part[index]
                    self.assertTrue(same(got, self.mixed[key][index].contiguous()), index)
                    [(selection, shapes)] = recording.calls
                    self.assertEqual(selection["paths"], [key])
                    if sent is None:
                        self.assertNotIn("slices", selection)
                        self.assertEqual(shapes, {key: (37, 16)})
                    else:
                        self.assertEqual(selection["slices"], {key: box}, index)
                        self.assertEqual(shapes, {key: sent}, index)
                recording.calls.clear()
                f.get_slice(key)[[0, 5]]  # a list: torch indexes the whole tensor
                self.assertNotIn("slices", recording.calls[0][0])
                arrays = weightstore.safe_open(recording, self.name("mixed"), framework="np")
                recording.calls.clear()
                self.assertTrue(same(arrays.get_slice("cube")[1, :, 2:4], self.mixed["cube"][1, :, 2:4].numpy()))
                self.assertEqual(recording.calls[0][0]["slices"],
                                 {"cube": (slice(1, 2), slice(0, 4), slice(2, 4), slice(0, 6))})

    def test_an_unknown_tensor_raises_key_error_naming_checkpoint_and_tensor_like_the_library(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                lib, ours = self.both("mixed", framework, label)
                for fn in (lambda f: f.get_tensor("model.nope"), lambda f: f.get_slice("model.nope")):
                    with self.assertRaises(safetensors.SafetensorError) as want:
                        fn(lib)
                    with self.assertRaises(KeyError) as got:
                        fn(ours)
                    self.assertIsInstance(got.exception, type(want.exception))
                    self.assertIn("'model.nope'", str(got.exception))
                    self.assertIn(self.name("mixed"), str(got.exception))
                    self.assertIn("does not contain tensor", str(got.exception))  # the library's words

    def test_a_slice_past_the_end_raises_index_error_like_the_library(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                lib, ours = self.both("mixed", framework, label)
                for key, index in (("cube", 3), ("cube", -4), ("cube", (0, 4)), ("cube", (0, 0, 0, 0, 0)),
                                   ("model.embed.weight", (slice(None), 16)), ("scalar", 0), ("empty", 0)):
                    with self.assertRaises(Exception) as want:
                        lib.get_slice(key)[index]
                    with self.assertRaises(IndexError) as got:
                        ours.get_slice(key)[index]
                    self.assertIsInstance(got.exception, type(want.exception), (key, index))
                    self.assertIsInstance(got.exception, safetensors.SafetensorError)
                    self.assertIn(f"'{key}'", str(got.exception))
                    self.assertIn(self.name("mixed"), str(got.exception))
                    if framework == "pt":
                        self.assertIn(str(want.exception), str(got.exception))

    def test_a_step_that_is_not_positive_raises_value_error_like_the_library(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                lib, ours = self.both("mixed", framework, label)
                for index in (slice(None, None, -1), (slice(None), slice(None, None, 0))):
                    with self.assertRaises(Exception) as want:
                        lib.get_slice("cube")[index]
                    with self.assertRaises(ValueError) as got:
                        ours.get_slice("cube")[index]
                    self.assertIsInstance(got.exception, type(want.exception))
                    self.assertIn("'cube'", str(got.exception))

    def test_frameworks_other_than_pt_and_np_are_refused_by_name(self):
        with self.assertRaises(safetensors.SafetensorError):
            safetensors.safe_open(self.paths["mixed"], "xx")
        for framework in ("xx", "tf", "flax", None):
            with self.assertRaises(ValueError) as e:
                weightstore.safe_open(ADDRESS, self.name("mixed"), framework=framework)
            self.assertIsInstance(e.exception, safetensors.SafetensorError)
            self.assertIn(repr(framework), str(e.exception))
            self.assertIn("'pt'", str(e.exception))
        for alias, kind in (("torch", torch.Tensor), ("pytorch", torch.Tensor), ("numpy", np.ndarray)):
            got = weightstore.safe_open(ADDRESS, self.name("mixed"), framework=alias).get_tensor("cube")
            self.assertIsInstance(got, kind)

    def test_devices_other_than_cpu_need_a_store_and_torch_with_cuda(self):
        with self.assertRaises(ValueError):
            weightstore.safe_open(ADDRESS, self.name("mixed"), device="mps")
        with self.assertRaises(ValueError):
            weightstore.safe_open(ADDRESS, self.name("mixed"), framework="np", device="cuda:0")
        cpu = weightstore.safe_open(ADDRESS, self.name("mixed"), device=torch.device("cpu"))
        self.assertTrue(same(cpu.get_tensor("cube"), self.mixed["cube"]))
        for label, store in self.stores.items():
            with self.subTest(transport=label):
                if not torch.cuda.is_available():
                    for device in ("cuda:0", 0):
                        with self.assertRaises(weightstore.Error) as e:
                            weightstore.safe_open(store, self.name("mixed"), device=device)
                        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                        self.assertIn("'cuda:0'", e.exception.message)
                    continue
                f = weightstore.safe_open(store, self.name("mixed"), device="cuda:0")
                lib = safetensors.safe_open(self.paths["mixed"], "pt", device="cuda:0")
                for key in ("cube", "model.layers.0.attn.qkv.weight", "mask"):
                    got, want = f.get_tensor(key), lib.get_tensor(key)
                    self.assertEqual(got.device, want.device)
                    self.assertTrue(same(got.cpu(), want.cpu()), key)
                    got, want = f.get_slice(key)[1:, ::2], lib.get_slice(key)[1:, ::2]
                    self.assertEqual(got.device, want.device)
                    self.assertTrue(same(got.cpu(), want.cpu()), key)

    def test_it_works_without_with_and_closes_like_the_library(self):
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                lib, ours = self.both("mixed", framework, label)
                self.assertIs(ours.__enter__(), ours)
                lib_slice, our_slice = lib.get_slice("cube"), ours.get_slice("cube")
                self.assertTrue(same(ours.get_tensor("cube"), lib.get_tensor("cube")))
                lib.__exit__(None, None, None)
                ours.__exit__(None, None, None)
                for fn in (lambda f: f.keys(), lambda f: f.get_tensor("cube"), lambda f: f.metadata(),
                           lambda f: f.get_slice("cube")):
                    with self.assertRaises(safetensors.SafetensorError):
                        fn(lib)
                    with self.assertRaises(safetensors.SafetensorError) as e:
                        fn(ours)
                    self.assertIn("closed", str(e.exception))
                # A slice taken before stays usable, in the library too.
                self.assertTrue(same(our_slice[1, 2:], lib_slice[1, 2:]))
                with weightstore.safe_open(self.stores[label], self.name("mixed"), framework) as f:
                    self.assertEqual(f.keys(), sorted(self.mixed))

    def test_the_first_argument_is_a_url_or_a_store(self):
        lib = safetensors.safe_open(self.paths["mixed"], "pt")
        for source in (ADDRESS, "unix:" + SOCKET, "file:" + MODELS, *self.stores.values()):
            with self.subTest(source=str(source)):
                with weightstore.safe_open(source, self.name("mixed"), "pt") as f:
                    self.assertEqual(f.keys(), lib.keys())
                    self.assertTrue(same(f.get_slice("cube")[:, 1], lib.get_slice("cube")[:, 1]))

    def test_a_checkpoint_that_is_not_served_raises_file_not_found_like_the_library(self):
        with self.assertRaises(FileNotFoundError):
            safetensors.safe_open(os.path.join(MODELS, FOLDER, "absent.safetensors"), "pt")
        for label, store in self.stores.items():
            with self.subTest(transport=label):
                with self.assertRaises(FileNotFoundError) as e:
                    weightstore.safe_open(store, self.name("absent"))
                self.assertIsInstance(e.exception, weightstore.Error)
                self.assertEqual(e.exception.code, "NOT_FOUND")
                self.assertIn(self.name("absent"), str(e.exception))

    def test_a_sharded_checkpoint_reads_as_the_library_reads_each_shard(self):
        shards = sorted(set(self.index["weight_map"].values()))
        self.assertGreater(len(shards), 2)
        rng = random.Random(5)
        for label, framework in self.each():
            with self.subTest(transport=label, framework=framework):
                ours = weightstore.safe_open(self.stores[label], self.name("shard/model"), framework)
                libs = [safetensors.safe_open(os.path.join(self.shard_dir, s), framework) for s in shards]
                self.assertEqual(ours.keys(), sorted(k for lib in libs for k in lib.keys()))
                # The checkpoint's metadata is the index's (values as strings);
                # each shard has its own ({"format": "pt"}).
                self.assertEqual(ours.metadata(), {k: str(v) for k, v in self.index["metadata"].items()})
                for lib in libs:
                    self.assertEqual(lib.metadata(), {"format": "pt"})
                    for key in lib.keys():
                        if framework == "np" and lib.get_slice(key).get_dtype() == "BF16":
                            with self.assertRaises(TypeError):
                                ours.get_tensor(key)
                            continue
                        self.assertTrue(same(ours.get_tensor(key), lib.get_tensor(key)), key)
                        self.assertEqual(ours.get_slice(key).get_shape(), lib.get_slice(key).get_shape())
                        self.assertEqual(ours.get_slice(key).get_dtype(), lib.get_slice(key).get_dtype())
                        whole = lib.get_tensor(key) if framework == "np" else None
                        for _ in range(6):
                            index = random_index(rng, lib.get_slice(key).get_shape(), framework)
                            self.compare_index(lib.get_slice(key), ours.get_slice(key), whole, index, framework,
                                               self.name("shard/model"), key)

    def test_a_checkpoint_replaced_while_open_is_an_error_not_a_mix_of_versions(self):
        path = os.path.join(MODELS, FOLDER, "replaced.safetensors")
        safetensors.torch.save_file({"w": torch.zeros(4), "v": torch.zeros(2)}, path)
        rescan()
        opened = {label: weightstore.safe_open(store, self.name("replaced")) for label, store in self.stores.items()
                  if label != "local"}  # the local store was opened before the file existed
        local = weightstore.connect("file:" + MODELS)
        opened["local"] = weightstore.safe_open(local, self.name("replaced"))
        # Another size too, so that no file version can take it for the first.
        safetensors.torch.save_file({"w": torch.ones(4), "v": torch.ones(2), "x": torch.ones(3)}, path + ".tmp")
        os.replace(path + ".tmp", path)
        rescan()
        for label, f in opened.items():
            with self.subTest(transport=label):
                got, error = attempt(lambda: f.get_tensor("w"))
                if error is None:  # still the version it opened, never the new one
                    self.assertTrue(same(got, torch.zeros(4)), label)
                else:
                    self.assertIsInstance(error, weightstore.Error)
                    self.assertEqual(error.code, "ABORTED", error)
                    self.assertIn(self.name("replaced"), str(error))
        self.assertTrue(same(weightstore.safe_open(ADDRESS, self.name("replaced")).get_tensor("w"), torch.ones(4)))

    def test_code_written_for_safetensors_runs_unchanged_but_for_the_open(self):
        def load_rows(opener, source, rows):
            out = {}
            with opener(source, framework="pt", device="cpu") as f:
                for k in f.keys():
                    if f.get_slice(k).get_shape()[:1] and f.get_slice(k).get_shape()[0] > rows:
                        out[k] = f.get_slice(k)[:rows]
                    else:
                        out[k] = f.get_tensor(k)
                out["__metadata__"] = f.metadata()
            return out

        want = load_rows(safetensors.safe_open, self.paths["mixed"], 4)
        got = load_rows(lambda source, **kw: weightstore.safe_open(ADDRESS, source, **kw), self.name("mixed"), 4)
        self.assertEqual(list(got), list(want))
        self.assertEqual(got.pop("__metadata__"), want.pop("__metadata__"))
        for k in want:
            self.assertTrue(same(got[k], want[k]), k)


if __name__ == "__main__":
    unittest.main(verbosity=2)
