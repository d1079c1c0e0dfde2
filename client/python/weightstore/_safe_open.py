"""weightstore.safe_open: safetensors' `safe_open` API over any store.

    from weightstore import safe_open
    with safe_open("host:50051", "llama/8b", framework="pt") as f:   # or a Store, "unix:...", "file:..."
        for k in f.keys():
            t = f.get_tensor(k)
        part = f.get_slice("embed.weight")[:, 1024:2048]             # only that part is fetched

It behaves as `safetensors.safe_open(filename, framework, device)` on the
checkpoint's file: keys() sorted, metadata() (None when there is none),
get_tensor, get_slice with get_shape/get_dtype and indexing, get_tensors,
offset_keys. A slice is cut on the server (the store's `slices=`); an index
with a step fetches the smallest box that covers it and finishes here.

Indexing follows the library, which indexes per framework:
- "pt": torch's indexing of the whole tensor (ints, slices, None, Ellipsis;
  anything else, such as lists or tensors, fetches the whole tensor and lets
  torch index it). Errors are torch's, with the checkpoint and tensor named.
- "np": the library's own indexer: ints (bools count as ints), slices with a
  positive step, one Ellipsis, and [] (nothing of dim 0). Where the library
  refuses a slice that numpy accepts (a negative end, an end past the
  dimension), numpy's result is returned instead.

The checkpoint's version is pinned when it is opened: a checkpoint replaced
while open is an Error (ABORTED) rather than a mix of two versions.

Errors subclass both the built-in exception the library (or torch) raises
and safetensors.SafetensorError (when safetensors is installed), so code
catching either keeps working: an unknown tensor is a KeyError, an index out
of range an IndexError, a bad step a ValueError, an index of an unsupported
type a TypeError, a checkpoint that is not served a FileNotFoundError (and a
weightstore.Error with code NOT_FOUND).
"""
import operator

import weightstore as _ws
from weightstore._errors import Error

try:
    from safetensors import SafetensorError
except ImportError:  # safetensors is not a dependency: a stand-in of the same name
    class SafetensorError(Exception):
        """safetensors.SafetensorError's stand-in when safetensors is not installed."""

__all__ = ["safe_open", "SafetensorError"]


class _Message:
    """str(e) is the message as given (KeyError's str would quote it)."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class SafeOpenKeyError(_Message, KeyError, SafetensorError):
    """No such tensor in the checkpoint."""


class SafeOpenIndexError(_Message, IndexError, SafetensorError):
    """An index out of range, or too many indices."""


class SafeOpenValueError(_Message, ValueError, SafetensorError):
    """A bad argument: framework, slice step, a closed file."""


class SafeOpenTypeError(_Message, TypeError, SafetensorError):
    """An index of a type the framework's indexer does not take, or a dtype the framework lacks."""


class CheckpointNotFoundError(Error, FileNotFoundError):
    """The checkpoint is not served (as the library raises FileNotFoundError for a missing file)."""


_WRAP = {KeyError: SafeOpenKeyError, IndexError: SafeOpenIndexError, ValueError: SafeOpenValueError,
         TypeError: SafeOpenTypeError}

_FRAMEWORKS = {"pt": "torch", "torch": "torch", "pytorch": "torch", "np": "numpy", "numpy": "numpy"}
_OTHER_FRAMEWORKS = ("tf", "tensorflow", "flax", "jax", "mlx", "paddle", "paddlepaddle")


def _wrap(e, where):
    """Re-raises a torch or numpy indexing error as the same built-in type (and
    SafetensorError), its message prefixed with the checkpoint and tensor."""
    for base, cls in _WRAP.items():
        if isinstance(e, base):
            return cls(f"{where}: {e}")
    return e


def _is_int(x):
    import numpy as np
    return (isinstance(x, int) and not isinstance(x, bool)) or isinstance(x, np.integer)


def _slice_box(s, n):
    """(box start, box stop, relative slice) of a slice with a positive step over a dimension of n."""
    start, stop, step = s.indices(n)
    count = len(range(start, stop, step))
    if count == 0:
        return 0, 0, slice(0, 0)
    return start, start + (count - 1) * step + 1, slice(0, None, step)


def _torch_plan(index, shape):
    """Torch's basic indexing (ints, slices, None, one Ellipsis) as a box per
    dimension plus an index relative to the box; None when the index is not
    basic (the whole tensor is fetched and torch indexes it). The index was
    checked on a meta tensor already."""
    items = index if isinstance(index, tuple) else (index,)
    basic = all(it is None or it is Ellipsis or _is_int(it) or
                (isinstance(it, slice) and all(v is None or _is_int(v) for v in (it.start, it.stop, it.step)))
                for it in items)
    if not basic or sum(it is Ellipsis for it in items) > 1:
        return None
    consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
    expanded = []
    for it in items:
        if it is Ellipsis:
            expanded.extend([slice(None)] * (len(shape) - consuming))
        else:
            expanded.append(it)
    box, rel, dim = [], [], 0
    for it in expanded:
        if it is None:
            rel.append(None)
            continue
        n = shape[dim]
        if isinstance(it, slice):
            start, stop, r = _slice_box(it, n)
            box.append((start, stop))
            rel.append(r)
        else:
            i = operator.index(it)
            i = i + n if i < 0 else i
            box.append((i, i + 1))
            rel.append(0)
        dim += 1
    box.extend((0, n) for n in shape[dim:])
    return box, tuple(rel)


def _numpy_plan(index, shape, where):
    """The library's numpy indexer: (box, relative index)."""
    if isinstance(index, list):
        if index:
            raise SafeOpenTypeError(f"{where}: non-empty lists are not supported as an index (as in safetensors)")
        index = (slice(0, 0),)
    elif not isinstance(index, tuple):
        index = (index,)
    parsed = []
    for pos, it in enumerate(index):
        if it is Ellipsis:
            parsed.append(it)
        elif isinstance(it, slice):
            try:
                start, stop, step = (None if v is None else operator.index(v) for v in (it.start, it.stop, it.step))
            except TypeError as e:
                raise SafeOpenTypeError(f"{where}: slice at position {pos}: {e}") from None
            if step is not None and step <= 0:
                raise SafeOpenValueError(f"{where}: slice step must be a positive integer, got {step}")
            parsed.append(slice(start, stop, step))
        else:
            try:
                parsed.append(operator.index(it))
            except TypeError:
                raise SafeOpenTypeError(f"{where}: unsupported index at position {pos} ({type(it).__name__}): "
                                        "expected a slice, an int or an ellipsis") from None
    if sum(it is Ellipsis for it in parsed) > 1:
        raise SafeOpenIndexError(f"{where}: an index can only have a single ellipsis ('...')")
    consuming = sum(1 for it in parsed if it is not Ellipsis)
    if consuming > len(shape):
        raise SafeOpenIndexError(f"{where}: too many indices ({consuming}) for a tensor of {len(shape)} "
                                 "dimensions")
    expanded = []
    for it in parsed:
        expanded.extend([slice(None)] * (len(shape) - consuming) if it is Ellipsis else [it])
    box, rel = [], []
    for dim, it in enumerate(expanded):
        n = shape[dim]
        if isinstance(it, slice):
            start, stop, r = _slice_box(it, n)
            box.append((start, stop))
            rel.append(r)
        else:
            if not -n <= it < n:
                raise SafeOpenIndexError(f"{where}: index {it} is out of bounds for dimension {dim} with size {n}")
            i = it + n if it < 0 else it
            box.append((i, i + 1))
            rel.append(0)
    box.extend((0, n) for n in shape[len(expanded):])
    return box, tuple(rel) + (Ellipsis,)  # the Ellipsis keeps a 0-d result an array, not a numpy scalar


class safe_open:
    """safetensors.safe_open over a store: `url_or_store` is a URL as
    weightstore.connect takes ("host:port", "unix:/path", "file:/dir") or a
    Store, `name` the checkpoint. framework: "pt" (torch tensors) or "np"
    (numpy arrays). device: "cpu", or "cuda[:N]" for torch tensors where the
    store and torch have CUDA. Usable with or without `with`."""

    def __init__(self, url_or_store, name, framework="pt", device="cpu"):
        as_ = _FRAMEWORKS.get(str(framework).lower()) if isinstance(framework, str) else None
        if as_ is None:
            other = " (a framework safetensors has, but weightstore does not)" \
                if str(framework).lower() in _OTHER_FRAMEWORKS else ""
            raise SafeOpenValueError(f"framework {framework!r} is invalid{other}: 'pt' (torch) or 'np' (numpy)")
        if isinstance(device, int) and not isinstance(device, bool):
            device = f"cuda:{device}"  # as the library reads an integer device
        self._target = _ws._device(device, as_)  # ValueError or Error(FAILED_PRECONDITION) before anything else
        self._as, self._device, self._name = as_, device, name
        self._store = url_or_store if isinstance(url_or_store, _ws.Store) else _ws.connect(url_or_store)
        try:
            info = self._store.info(name)
            self._version = info["version"]
            listing = self._store.describe(name, version=self._version)
        except Error as e:
            if e.code == "NOT_FOUND":
                raise CheckpointNotFoundError(e.code, e.message) from None
            raise
        self._metadata = dict(info.get("metadata") or {}) or None
        self._infos = {t.name: t for t in listing}
        self._closed = False

    # The context manager: the library's file stays usable until __exit__.
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._closed = True
        return False

    def __repr__(self):
        return f"weightstore.safe_open({self._name!r}, framework={self._as!r}, store={self._store.kind!r})"

    def _open(self):
        if self._closed:
            raise SafeOpenValueError(f"checkpoint '{self._name}' is closed (File is closed)")

    def _info(self, key):
        self._open()
        info = self._infos.get(key)
        if info is None:
            raise SafeOpenKeyError(f"checkpoint '{self._name}' does not contain tensor '{key}' "
                                   "(File does not contain tensor)")
        return info

    def _numpy_has(self, key):
        dtype = self._infos[key].dtype
        if self._as == "numpy" and dtype not in _ws._NUMPY_DTYPES:  # the library: "data type ... not understood"
            raise SafeOpenTypeError(f"tensor '{key}' of checkpoint '{self._name}' is {dtype}, which numpy "
                                    "has no dtype for: open it with framework='pt'")

    def _fetch(self, key, box=None):
        """The tensor, or the box [(start, stop)] of it cut on the server."""
        self._numpy_has(key)
        selection = {"paths": [key], "version": self._version}
        if box is not None:
            selection["slices"] = {key: tuple(slice(a, b) for a, b in box)}
        return self._store.tensors(self._name, as_=self._as, device=self._device, **selection)[key]

    def keys(self):
        """Tensor names, sorted (as the library gives them)."""
        self._open()
        return sorted(self._infos)

    def offset_keys(self):
        """Tensor names in the store's order: by offset within a file."""
        self._open()
        return list(self._infos)

    def metadata(self):
        """The checkpoint's metadata (str to str), None when it has none."""
        self._open()
        return None if self._metadata is None else dict(self._metadata)

    def get_tensor(self, name):
        self._info(name)
        return self._fetch(name)

    def get_tensors(self):
        """Every tensor, by name in offset_keys() order."""
        self._open()
        for key in self._infos:
            self._numpy_has(key)
        got = self._store.tensors(self._name, as_=self._as, device=self._device, version=self._version)
        return {key: got[key] for key in self._infos}

    def get_slice(self, name):
        return _Slice(self, name, self._info(name))


class _Slice:
    """safetensors' PySafeSlice: shape and dtype without data, and indexing
    that fetches only the part asked for."""

    def __init__(self, f, name, info):
        self._f, self._key, self._info = f, name, info

    def get_shape(self):
        return list(self._info.shape)

    def get_dtype(self):
        return self._info.dtype

    def __repr__(self):
        return f"<weightstore slice of '{self._key}': {self._info.dtype} {list(self._info.shape)}>"

    def __getitem__(self, index):
        f, key, shape = self._f, self._key, tuple(self._info.shape)
        where = f"checkpoint '{f._name}', tensor '{key}' of shape {list(shape)}"
        if f._as == "numpy":
            box, rel = _numpy_plan(index, shape, where)
            part = self._part(box)[rel]
            return part if part.flags.c_contiguous else part.copy()
        import torch
        try:
            torch.empty(shape, dtype=torch.uint8, device="meta")[index]  # torch's checks, torch's errors
        except (IndexError, TypeError, ValueError) as e:
            raise _wrap(e, where) from None
        except Exception:  # an index meta tensors cannot check (a CPU index tensor): checked below
            pass
        plan = _torch_plan(index, shape)
        if plan is None:
            whole = f._fetch(key)
            try:
                return whole[index]
            except (IndexError, TypeError, ValueError) as e:
                raise _wrap(e, where) from None
        box, rel = plan
        return self._part(box)[rel].contiguous()

    def _part(self, box):
        if all(b == (0, n) for b, n in zip(box, self._info.shape)):
            return self._f._fetch(self._key)
        return self._f._fetch(self._key, box)
