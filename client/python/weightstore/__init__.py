"""weightstore: model weights from weightstored (or local files), as torch or
numpy tensors, through the C++ client.

    import weightstore
    store = weightstore.connect("host:50051")        # or "unix:/run/ws.sock", "file:/models"
    tensors = store.tensors("llama/8b", include=[r"^model\\.layers\\.0\\."], dtype="bf16")
    result = store.load_into(model, "llama/8b", rename=[(r"^model\\.", "")])
    update = store.update(model, "llama/8b", since=held_version)  # only what changed since
    changes = store.changes("llama/8b", since=held_version)   # the same, unapplied: changes.decode() for indices
    pushed = store.push("policy", model, base=last_pushed)  # a trainer publishes what changed

Tensors come without a copy: a fetch lands in memory the tensors own, and a
socket store maps the daemon's shared memory copy-on-write (a tensor written
in place gets private pages; the daemon's bytes never change). Failures raise
weightstore.Error with the gRPC status code.
"""
import dataclasses
import re

from weightstore._errors import Error
from weightstore._safe_open import safe_open

try:
    from weightstore import _native
except ImportError as e:  # the stubs in weightstore.v1 stay usable without the extension
    _native, _native_error = None, e

__all__ = ["connect", "digests_metadata", "Store", "Error", "TensorInfo", "LoadResult", "Update", "Push", "Changes", "ElementPatch",
           "tune_allocator_for_streaming", "safe_open"]

# SafeTensors dtype -> torch's name for it. torch has the unsigned 16-64 bit
# types from 2.3, the F8 types from 2.1 (FNUZ 2.2, E8M0 2.7) and
# float4_e2m1fn_x2 from 2.8; an older torch lacks them, and _as_tensor says
# what to do instead. F4 is float4_e2m1fn_x2: a byte of two values, so its
# last dimension is half the served one. torch has no F6 (F6_E2M3, F6_E3M2).
_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
                 "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                 "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
                 "F4": "float4_e2m1fn_x2", "C64": "complex64"}
# numpy has no narrow float types (F8, F6, F4) and no BF16.
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                 "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?", "C64": "<c8"}


def _torch_shape(dtype, shape):
    """The shape of a served tensor as torch holds it: F4's last dimension
    halved (float4_e2m1fn_x2), None when its rows are not whole bytes."""
    shape = tuple(shape)
    if dtype != "F4":
        return shape
    if not shape or shape[-1] % 2:
        return None
    return shape[:-1] + (shape[-1] // 2,)


@dataclasses.dataclass
class TensorInfo:
    name: str           # as served (after renaming)
    dtype: str          # "F32", "BF16", ...
    shape: tuple
    byte_size: int
    source_name: str    # in the file
    crc32c: int = None  # when asked for
    # Set when part of the tensor is served (a shard or slice): the whole
    # tensor's shape, and per dimension the (start, stop) ranges served.
    unsliced_shape: tuple = None
    slice: tuple = None
    # A quantization scale served as its weight's shard asks: the weight's
    # served name, and whether a block it serves is shared with another rank.
    scale_of: str = None
    shares_scale_blocks: bool = False
    # ...and the weight elements one scale element covers, per dimension.
    scale_block: tuple = None
    # A weight the checkpoint's quantization config (hf_quant_config.json or
    # config.json) describes: "NVFP4, 4-bit values, blocks of 1x16 (...)".
    quantization: str = None


@dataclasses.dataclass
class LoadResult:
    """burn-store's load result."""
    applied: list
    skipped: list
    missing: list
    unused: list
    errors: list
    suggestions: list

    @property
    def ok(self):
        return not self.errors


@dataclasses.dataclass
class Update:
    """What Store.update did."""
    version: str        # now held: pass it as `since` next time
    delta: bool         # only the changed tensors were fetched
    full_reason: str    # when not a delta, why
    changed: list       # served names fetched again
    added: list         # served names fetched for the first time
    removed: list       # served names no longer selected (dropped from a dict)
    fetched_bytes: int  # received: whole tensors and element patches
    patched: list = dataclasses.field(default_factory=list)  # of `changed`, those that came as element patches
    patch_reason: str = ""  # why changed tensors came whole: the daemon keeps no patches from `since`
    patch_failure: str = ""  # why patches that came were not used (the changed tensors then came whole)


@dataclasses.dataclass
class Push:
    """What Store.push published."""
    version: str           # the new version
    previous_version: str  # the version it replaced
    whole: list            # tensors sent whole (changed, new, or redefined)
    patched: list          # tensors sent as element patches of `base`'s
    removed: list          # served tensors the state lacks (and those redefined)
    unchanged: int         # tensors left out: the served digest is theirs
    sent_bytes: int        # whole tensors and patches sent


@dataclasses.dataclass
class ElementPatch:
    """One changed tensor's changed elements (Changes.decode()): on the tensor as
    held at `since`, `tensor.view(-1)[indices] = values` gives the new
    version's bytes, whose XXH3-128 is `digest`. An element is one of the
    tensor's dtype (one byte, two values, of F4)."""
    name: str      # served name
    dtype: str     # the tensor's SafeTensors dtype
    shape: tuple   # the tensor's served shape
    indices: object  # 1-D int64 (torch or numpy): flat element positions, ascending, each once
    values: object   # 1-D, the tensor's dtype (torch: float4_e2m1fn_x2 for F4), values[i] goes to indices[i]
    digest: str    # of the whole tensor after the patch (32 hex digits)


@dataclasses.dataclass
class Changes:
    """What changed in `name` from version `since` to `version`
    (Store.changes), nothing applied: the changed tensors that came as element
    patches, and the changed or new ones that came whole."""
    version: str        # the version these changes lead to
    since: str
    delta: bool         # False: `tensors` holds every selected tensor (full_reason says why)
    full_reason: str
    names: list         # every served name at `version`, in listing order
    unchanged: list     # of `names`, those equal to `since`'s
    patched: list       # of `names`, the changed tensors that came as element patches (decode(), apply())
    tensors: dict       # served name -> tensor: changed tensors sent whole, and new ones
    fetched_bytes: int  # received: whole tensors and element patches
    patch_reason: str = ""  # why changed tensors came whole: the daemon keeps no patches from `since`
    _native: object = dataclasses.field(default=None, repr=False, compare=False)
    _raw: object = dataclasses.field(default=None, repr=False, compare=False)  # the received patches
    _specs: dict = dataclasses.field(default=None, repr=False, compare=False)  # name: (dtype, shape)
    _as: str = dataclasses.field(default="torch", repr=False, compare=False)
    _decoded: list = dataclasses.field(default=None, repr=False, compare=False)

    def decode(self):
        """The patches as ElementPatch (flat indices and values), decoded
        natively with the GIL released on the first call (each patch checked
        in full first) and kept. Decoding holds 8 bytes of index and one
        element of value per changed element."""
        if self._decoded is None:
            out = []
            for n, dtype, shape, digest, indices, values in self._native.decode_patches(self._raw):
                count = len(indices) // 8
                if self._as == "numpy":
                    import numpy as np
                    indices = np.frombuffer(indices, dtype="<i8")
                else:
                    torch = _torch()
                    indices = torch.from_dlpack(indices).view(torch.int64) if count else \
                        torch.empty(0, dtype=torch.int64)
                # F4's element is a byte of two values: served shapes count values.
                values = _as_tensor(n, dtype, (count * 2 if dtype == "F4" else count,), values, self._as)
                out.append(ElementPatch(name=n, dtype=dtype, shape=tuple(shape), indices=indices, values=values,
                                        digest=digest))
            self._decoded = out
        return self._decoded

    def apply(self, held, in_place=False):
        """Writes each patch into a copy of held[name] (the tensor at `since`:
        torch on the CPU or a usable GPU, or numpy), or with `in_place` into
        held[name] itself, in one native call with the GIL released, checks
        every result against its digest, and returns {name: patched tensor}.
        Error DATA_LOSS naming the tensor when a result is not the version's
        (held was not `since`'s bytes; in place, the held tensors are then
        written in part), FAILED_PRECONDITION, with nothing written, when a
        held tensor is missing or of another dtype or shape."""
        if not isinstance(in_place, bool):
            raise TypeError(f"in_place={in_place!r}: True or False")
        for n in self.patched:
            dtype, shape = self._specs[n]
            if not _holds(held.get(n), dtype, shape) or not _patchable(held.get(n)):
                raise Error("FAILED_PRECONDITION", f"tensor '{n}': the patch is for {dtype} {list(shape)} in "
                                                   "contiguous memory, which the held tensors do not have")
        if not self.patched:
            return {}
        return _apply_patches(self._native, {"patched": list(self.patched), "patches": self._raw}, held,
                              in_place=in_place, raise_errors=True)


_FROM_TORCH = {torch_name: name for name, torch_name in _TORCH_DTYPES.items()}


def _torch():
    import torch
    return torch


def _push_views(state, what):
    """[(name, dtype, shape, address, bytes)] of a dict of tensors or a
    module's state_dict, and the objects that own that memory (contiguous
    CPU copies where a tensor was not one), to keep while it is read."""
    if not isinstance(state, dict):
        state = state.state_dict()
    views, keep = [], []
    for n, t in state.items():
        if hasattr(t, "element_size"):  # torch
            t = t.detach()
            if t.layout != _torch().strided:
                raise Error("INVALID_ARGUMENT", f"{what} tensor '{n}' is {t.layout}: push dense tensors")
            if t.is_conj() or t.is_neg():  # lazy views: their bytes are not their values
                t = t.resolve_conj().resolve_neg()
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.to("cpu").contiguous()
            dtype = _FROM_TORCH.get(str(t.dtype)[len("torch."):])
            if dtype is None:
                raise Error("INVALID_ARGUMENT", f"{what} tensor '{n}' is {t.dtype}, which weightstore does not store")
            shape = tuple(t.shape)
            if dtype == "F4":  # two values a byte: the last dimension counts values
                if not shape:
                    raise Error("INVALID_ARGUMENT", f"{what} tensor '{n}' is a float4_e2m1fn_x2 scalar")
                shape = shape[:-1] + (shape[-1] * 2,)
            views.append((n, dtype, list(shape), t.data_ptr(), t.element_size() * t.nelement()))
        else:
            import numpy as np
            t = np.asarray(t, order="C")  # keeps a 0-d array 0-d
            dtype = next((k for k, v in _NUMPY_DTYPES.items() if np.dtype(v) == t.dtype), None)
            if dtype is None:
                raise Error("INVALID_ARGUMENT", f"{what} tensor '{n}' is {t.dtype}, which weightstore does not store")
            views.append((n, dtype, list(t.shape), t.ctypes.data, t.nbytes))
        keep.append(t)
    return views, keep


def connect(url, *, token=None, tls_ca="", tls_cert="", tls_key="", parallel_streams=0, pipeline=None,
            max_resumes=3, timeout=600.0, record_layout="", data_lane=True):
    """A store: "host:port" (gRPC; TLS with tls_ca, a bearer token from `token`
    or $WEIGHTSTORE_TOKEN), "unix:/path" (the daemon's same-host socket), or
    "file:/path" (files read in this process). Over gRPC, `data_lane` takes a
    fetch's bytes over the daemon's data lane where it has one (weightstored
    --data-listen): one copy fewer. With "file:", `record_layout`
    is the layout JSON Burn bincode records (.bin, .bin.gz) are read with: the
    target schema's {"parameters": [{"path", "shape"}]}, in the module's
    declaration order (a daemon takes --record-layout)."""
    if _native is None:
        raise ImportError(f"weightstore's extension is not built: {_native_error}")
    if not isinstance(record_layout, str):
        raise TypeError(f"record_layout={record_layout!r}: a path to a layout JSON")
    if record_layout and not (isinstance(url, str) and url.startswith(("file:", "/", "."))):
        raise ValueError(f"record_layout is read by file: stores; the daemon at {url!r} takes --record-layout")
    if not isinstance(parallel_streams, int) or not 0 <= parallel_streams <= 64:
        raise ValueError(f"parallel_streams={parallel_streams!r}: 0 (automatic) to 64")
    if not isinstance(data_lane, bool):
        raise TypeError(f"data_lane={data_lane!r}: True or False")
    if not isinstance(max_resumes, int) or not 0 <= max_resumes <= 100:
        raise ValueError(f"max_resumes={max_resumes!r}: 0 to 100")
    if not 0 < float(timeout) <= 86400 * 365:
        raise ValueError(f"timeout={timeout!r}: seconds, more than 0 and at most a year")
    if token is None:
        import os
        token = os.environ.get("WEIGHTSTORE_TOKEN", "")
    return Store(_native.connect(url, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                 parallel_streams=parallel_streams, pipeline=pipeline, max_resumes=max_resumes,
                                 timeout=timeout, record_layout=record_layout, data_lane=data_lane))


def tune_allocator_for_streaming():
    """Opt-in, process-wide: glibc keeps freed large blocks instead of unmapping
    them, so repeated fetches reuse memory rather than fault in new pages (the
    C++ client's TuneAllocatorForStreaming). Call once, early."""
    if _native is None:
        raise ImportError(f"weightstore's extension is not built: {_native_error}")
    _native.tune_allocator_for_streaming()


def digests_metadata(tensors):
    """The SafeTensors metadata entry that states each tensor's digest (XXH3-128
    of its bytes, as a weightstore daemon computes it), for a trainer that
    uploads its checkpoints to S3: a node following the object then fetches
    only the tensors whose digest changed, and copies the others from the file
    it holds (docs/origin.md). `tensors`: a dict of torch tensors or numpy
    arrays, or a module (its state_dict): what is saved, computed after the
    last change to it (a digest that is not its tensor's makes the node
    fetch the whole file; the node takes ranges only from objects whose MD5
    ETag or CRC32C checksum S3 states).

        save_file(state, path, metadata={"format": "pt", **weightstore.digests_metadata(state)})
    """
    if _native is None:
        raise ImportError(f"weightstore's extension is not built: {_native_error}")
    import json
    views, keep = _push_views(tensors, "a")
    hexes = _native.digests([(v[3], v[4]) for v in views])
    del keep
    return {"weightstore.digests": json.dumps(dict(zip((v[0] for v in views), hexes)), separators=(",", ":"))}


def _split(pattern, split):
    """A shard rule's split: a dimension (0), "DIMxPARTS[:uneven]", or (dim, parts[, uneven])."""
    if isinstance(split, int) and not isinstance(split, bool):
        return (pattern, split, 1, False)
    if isinstance(split, tuple):
        return (pattern, split[0], split[1] if len(split) > 1 else 1, bool(split[2]) if len(split) > 2 else False)
    match = re.fullmatch(r"([0-9]+)(?:x([0-9]+))?(:uneven)?", str(split).strip())
    if match is None:
        raise ValueError(f"shard rule '{pattern}': '{split}' is not DIM, DIMxPARTS or DIMxPARTS:uneven")
    return (pattern, int(match[1]), int(match[2] or 1), bool(match[3]))


def _bounds(name, spec):
    """A slice: Python slices ((slice(0, 512), slice(None))) or text ("[0:512, :]")."""
    if isinstance(spec, str):
        body = spec.strip()
        if not (body.startswith("[") and body.endswith("]")):
            raise ValueError(f"slice of '{name}': '{spec}' is not like '[0:512, :]'")
        out = []
        for dim in filter(None, body[1:-1].split(",")) if body[1:-1].strip() else []:
            match = re.fullmatch(r"\s*([0-9]*)\s*:\s*([0-9]*)\s*", dim)
            if match is None:
                raise ValueError(f"slice of '{name}': '{dim.strip()}' is not start:stop")
            out.append((int(match[1]) if match[1] else None, int(match[2]) if match[2] else None))
        return out
    out = []
    for dim in spec if isinstance(spec, (tuple, list)) else (spec,):
        if not isinstance(dim, slice) or dim.step not in (None, 1):
            raise ValueError(f"slice of '{name}': {dim!r} is not a slice without a step")
        for end in (dim.start, dim.stop):
            if end is not None and (not isinstance(end, int) or not 0 <= end < 2**64):
                raise ValueError(f"slice of '{name}': {dim!r} needs non-negative integer ends")
        out.append((dim.start, dim.stop))
    return out


def _strings(name, values):
    """A list of strings; a lone string is refused (list("ab") would be ["a", "b"])."""
    if isinstance(values, (str, bytes)) or not all(isinstance(v, str) for v in values):
        raise TypeError(f"{name} takes a list of strings, e.g. {name}=[r\"^model\\.\"]")
    return list(values)


def _selection(include=(), exclude=(), paths=(), rename=(), top_level_key="", contiguous_indices=None, adapter=None,
               dtype=None, shard=None, slices=None, version="", allow_partial=False, with_checksums=False,
               target=None, shard_scales=None, shard_experts=None, detect_scales=True):
    include, exclude, paths = _strings("include", include), _strings("exclude", exclude), _strings("paths", paths)
    if isinstance(rename, (str, bytes)) or not all(
            isinstance(r, (tuple, list)) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in rename):
        raise TypeError("rename takes a list of (regex, replacement) pairs")
    if not isinstance(version, str) or not isinstance(top_level_key, str):
        raise TypeError("version and top_level_key are strings")
    s = {"include": list(include), "exclude": list(exclude), "paths": list(paths),
         "renames": [tuple(r) for r in rename], "top_level_key": top_level_key,
         "contiguous_indices": contiguous_indices, "version": version, "allow_partial": allow_partial,
         "with_checksums": with_checksums, "target": target}
    if adapter:
        s["adapter"] = adapter
    if dtype:
        # "bf16", "BF16" or torch.bfloat16 alike.
        name = str(dtype).replace("torch.", "")
        s["dtype"] = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32",
                      "float64": "F64", "double": "F64"}.get(name, name.upper())
    if shard is not None:
        rank, world, rules = shard
        if not all(isinstance(v, int) and 0 <= v < 2**32 for v in (rank, world)):
            raise ValueError(f"shard=({rank!r}, {world!r}, ...): rank and world size are non-negative integers")
        items = rules.items() if isinstance(rules, dict) else rules
        s["shard"] = (rank, world, [_split(pattern, split) for pattern, split in items])
        # Scales that follow their weights: {regex: weight} or {regex: (weight, (block, ...))}.
        scales = []
        for pattern, follow in (shard_scales or {}).items():
            weight, block = (follow, ()) if isinstance(follow, str) else follow
            scales.append((pattern, weight, list(block)))
        s["shard_scales"] = scales
        s["shard_experts"] = _strings("shard_experts", shard_experts or [])
        s["detect_scales"] = bool(detect_scales)
    elif shard_scales or shard_experts:
        raise ValueError("shard_scales and shard_experts need shard=(rank, world, rules)")
    if slices:
        s["slices"] = [(name, _bounds(name, spec)) for name, spec in slices.items()]
    return s


def _served_spec(tensor):
    """(dtype, shape) of a held torch tensor or numpy array as the daemon
    serves it: SafeTensors' dtype name ("" for none) and the served shape
    (F4's last dimension counts elements, where torch's float4_e2m1fn_x2
    packs two a byte)."""
    if hasattr(tensor, "element_size"):  # torch
        names = {v: k for k, v in _TORCH_DTYPES.items()}
        dtype = names.get(str(tensor.dtype).replace("torch.", ""), "")
        shape = list(tensor.shape)
        if dtype == "F4" and shape:
            shape[-1] *= 2
        return dtype, shape
    import numpy as np
    if not isinstance(tensor, np.ndarray):
        return "", []
    names = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}
    return names.get(tensor.dtype, ""), list(tensor.shape)


def _holds(tensor, dtype, shape):
    """Whether a held torch tensor or numpy array is `dtype` (SafeTensors' name)
    and `shape`."""
    if tensor is None:
        return False
    if hasattr(tensor, "element_size"):  # torch
        return (str(tensor.dtype) == "torch." + _TORCH_DTYPES.get(dtype, "?") and
                tuple(tensor.shape) == _torch_shape(dtype, shape))
    import numpy as np
    return (tuple(tensor.shape) == tuple(shape) and dtype in _NUMPY_DTYPES and
            tensor.dtype == np.dtype(_NUMPY_DTYPES[dtype]))


_CUDA_PATCHES = []  # [usable], asked of the extension once


def _cuda_patches_usable():
    """Whether this build's scatter kernel can write into GPU memory here."""
    if not _CUDA_PATCHES:
        _CUDA_PATCHES.append(bool(_native.cuda_patches_usable()))
    return _CUDA_PATCHES[0]


def _place(tensor):
    """(dtype, shape, address, bytes) of a torch tensor that load_into can
    write into as served bytes (contiguous, on the CPU, of a served dtype, not
    a conjugate or negative view), else None."""
    import torch
    # Plain dense tensors only: a subclass (DTensor, a quantized wrapper) or a
    # sparse one keeps its bytes its own way, which copy_ knows.
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter, getattr(torch.nn, "Buffer", torch.Tensor)) \
            or tensor.layout != torch.strided:
        return None
    dtype, shape = _served_spec(tensor)
    if not dtype or tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj() \
            or tensor.is_neg() or (dtype == "F4" and not shape):  # a packed F4 scalar has no served byte
        return None
    return dtype, shape, tensor.data_ptr(), tensor.element_size() * tensor.nelement()


def _patchable(tensor):
    """Whether an element patch can be written into `tensor`'s memory: a
    contiguous torch tensor on the CPU (or on a CUDA device, where this
    build's scatter kernel can run), or a writable C-contiguous numpy array."""
    if hasattr(tensor, "element_size"):  # torch
        on = tensor.device.type
        return tensor.is_contiguous() and (on == "cpu" or (on == "cuda" and _cuda_patches_usable()))
    flags = getattr(tensor, "flags", None)
    return flags is not None and flags.c_contiguous and flags.writeable


def _patch_destinations(names, held, in_place):
    """Where the patches of `names` are written: into the held tensors
    themselves (in_place) or into copies of them. Returns ({name: tensor
    written}, {name: (address, bytes[, device])}) as the native calls take
    them, once torch's work pending on each GPU written (the clones, a forward
    pass) has finished: the scatter runs on a stream of its own."""
    targets, destinations = {}, {}
    gpus = set()
    for n in names:
        t = held[n]
        if hasattr(t, "element_size"):  # torch
            t = t.detach() if in_place else t.detach().clone()
            device = t.device.index if t.device.type == "cuda" else -1
            if device >= 0:
                gpus.add(device)
            destinations[n] = (t.data_ptr(), t.element_size() * t.nelement(), device)
        else:
            t = t if in_place else t.copy()
            destinations[n] = (t.ctypes.data, t.nbytes)
        targets[n] = t
    if gpus:
        import torch
        for device in sorted(gpus):
            torch.cuda.synchronize(device)
    return targets, destinations


def _apply_patches(native, got, held, in_place, raise_errors=False):
    """Applies the element patches `got` (a delta) carries to the held tensors
    (each _patchable and as its patch expects), in one native call with the
    GIL released: into their own memory, or into copies. Returns {name:
    patched tensor}, or None when a patch fails (tensors written in place may
    then be partly written: the caller fetches the changed tensors whole);
    with `raise_errors`, the failure's Error instead of None."""
    targets, destinations = _patch_destinations(got["patched"], held, in_place)
    try:
        native.apply_patches(got["patches"], destinations)
    except Error:
        if raise_errors:
            raise
        return None
    return targets


def _as_tensor(name, dtype, shape, buffer, as_):
    """A view of `buffer` (no copy) as a torch or numpy tensor: a host Buffer
    through DLPack or the buffer protocol, a DeviceBuffer (GPU memory) through
    DLPack. The tensor keeps the buffer's memory alive."""
    if as_ == "numpy":
        import numpy as np
        if dtype not in _NUMPY_DTYPES:
            instead = "torch tensors, or " if dtype in _TORCH_DTYPES else ""
            raise Error("UNIMPLEMENTED", f"tensor '{name}' is {dtype}, which numpy has no dtype for: ask for "
                                         f"{instead}a cast with dtype='f32'")
        return np.frombuffer(buffer, dtype=_NUMPY_DTYPES[dtype]).reshape(shape)
    import torch
    torch_dtype = getattr(torch, _TORCH_DTYPES.get(dtype, ""), None)
    if not isinstance(torch_dtype, torch.dtype):
        instead = "as_='numpy'" if dtype in _NUMPY_DTYPES else "a cast with dtype='f32' (or 'bf16')"
        raise Error("UNIMPLEMENTED", f"tensor '{name}' is {dtype}, which torch {torch.__version__} has no dtype for: "
                                     f"ask for {instead}")
    shape = _torch_shape(dtype, shape)
    if shape is None:
        raise Error("UNIMPLEMENTED", f"tensor '{name}' is F4 with rows of an odd length, which torch's "
                                     "float4_e2m1fn_x2 (two values a byte) cannot shape: ask for a cast with "
                                     "dtype='bf16'")
    if len(buffer) == 0:
        kind, index = buffer.__dlpack_device__()
        return torch.empty(shape, dtype=torch_dtype, device="cpu" if kind == 1 else f"cuda:{index}")
    # The export is flat bytes (DLPack 0.6 has no bool or float8): viewed as
    # the dtype, then shaped.
    return torch.from_dlpack(buffer).view(torch_dtype).reshape(shape)


def _device(device, as_):
    """The torch device tensors are moved to, or None for the CPU (checked
    before anything is fetched)."""
    if str(device) == "cpu":
        return None
    if as_ != "torch":
        raise ValueError(f"device={device!r}: numpy arrays live on the CPU; ask for as_='torch'")
    import torch
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: {e}") from None
    if target.type != "cuda":
        raise ValueError(f"device={device!r}: 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise Error("FAILED_PRECONDITION", f"device '{device}': this torch ({torch.__version__}) has no CUDA "
                                           "device (torch.cuda.is_available() is False)")
    if target.index is not None and target.index >= torch.cuda.device_count():
        raise Error("FAILED_PRECONDITION", f"device '{device}': torch sees {torch.cuda.device_count()} CUDA devices")
    if not _native.has_cuda:
        raise Error("FAILED_PRECONDITION", f"device '{device}': this build of weightstore's extension has no CUDA "
                                           "support; build it where the CUDA toolkit is installed")
    return torch.device("cuda", target.index if target.index is not None else torch.cuda.current_device())


def _target_schema(module, served=None):
    """The target schema of a torch module: every entry of its state dict (parameters and persistent buffers;
    not, say, a rotary embedding's inv_freq) with its shape, dtype and module type. A tied parameter (one tensor
    under several names) is asked for under the names of it the checkpoint holds, or under its first name when it
    holds none: loading one name loads them all. `served()` gives the checkpoint's served names, and is called only
    when the module has tied parameters."""
    owners = {name: type(m).__name__ for name, m in module.named_modules()}
    state = module.state_dict(keep_vars=True)
    tied = {}
    for path, tensor in state.items():
        tied.setdefault(id(tensor), []).append(path)
    dropped = set()
    held = served() if served is not None and any(len(names) > 1 for names in tied.values()) else None
    for names in tied.values():
        if len(names) > 1 and held is not None:
            dropped.update(set(names) - set([n for n in names if n in held] or names[:1]))
    dtypes = {v: k for k, v in _TORCH_DTYPES.items()}
    schema = []
    for path, tensor in state.items():
        if path in dropped:
            continue
        owner = path.rpartition(".")[0]
        name = dtypes.get(str(tensor.dtype).replace("torch.", ""))
        schema.append({"path": path, "shape": list(tensor.shape), "dtype": name, "module": owners.get(owner, "")})
    return schema


class Store:
    """A connected store (weightstore.connect)."""

    def __init__(self, native):
        self._native = native
        # (id of the state, name, version) -> the selection update() fetched
        # that version into that state with.
        self._selections = {}

    @property
    def kind(self):
        """"remote", "socket" or "local"."""
        return self._native.kind

    def list(self):
        """Every checkpoint served: dicts of name, format, path, total_bytes, tensor_count, metadata, version,
        quantization (what its quantization config says, or None), follow (on a node that follows the
        checkpoint's origin, over gRPC: a dict of upstream, upstream_version, lag_versions, lag_seconds,
        upstream_connected, blocked; else None)."""
        return self._native.list()

    def info(self, name):
        return self._native.info(name)

    def describe(self, name, with_checksums=False, **selection):
        """The selected tensors, without their data: a list of TensorInfo."""
        listing = self._native.listing(name, _selection(with_checksums=with_checksums, **selection))
        return [TensorInfo(**t) for t in listing["tensors"]]

    def tensors(self, name, as_="torch", device="cpu", **selection):
        """Every selected tensor by served name, in listing order: torch tensors
        (as_="torch") or numpy arrays (as_="numpy"), viewing memory they own.
        device="cuda:N" puts torch tensors on that GPU through the C++
        client's CUDA paths, with no host copy in Python: from a socket, DMA
        straight out of the daemon's mappings (registered for the call); from
        gRPC or files, a pinned staging ring that overlaps the transfer. It is
        an Error when torch or this build has no CUDA.
        Selection keywords: include, exclude, paths, rename=[(regex, replacement)],
        top_level_key, contiguous_indices, dtype ("f16", "bf16", "f32", "f64"),
        shard=(rank, world, rules), slices={name: slices}, version."""
        if as_ not in ("torch", "numpy"):
            raise ValueError(f"as_={as_!r}: 'torch' or 'numpy'")
        target = _device(device, as_)
        s = _selection(**selection)
        if target is None:
            fetched = self._native.fetch(name, s)
        else:
            fetched = self._native.fetch_to_device(name, s, target.index)
        out = {n: _as_tensor(n, dtype, shape, buffer, as_) for n, dtype, shape, buffer in fetched["tensors"]}
        if fetched["version"]:  # the version the tensors are, where the store tells
            self._record(out, name, fetched["version"], s)  # update(out, since=it) may then be a delta
        return out

    def iter_tensors(self, name, batch_bytes=256 << 20, **selection):
        """Yields (served name, torch tensor) for every selected tensor, in
        listing order, holding at most two batches of about `batch_bytes` at
        a time: what a loader hands a model that copies each tensor into its
        own parameters (vLLM's load_weights). Through a socket the tensors are
        views of the daemon's shared memory, as in tensors(); over gRPC and
        from files they are fetched (read) in batches, the next while the
        caller consumes one, all pinned to one version (the current one unless
        `version=` is given). A tensor larger than `batch_bytes` is a batch of
        its own."""
        if not isinstance(batch_bytes, int) or isinstance(batch_bytes, bool) or batch_bytes <= 0:
            raise ValueError(f"batch_bytes={batch_bytes!r}: a positive number of bytes")
        if self.kind == "socket":  # views of the daemon's mappings: nothing to bound
            yield from self.tensors(name, **selection).items()
            return
        s = _selection(**selection)
        listing = self._native.listing(name, s)
        pinned = dict(selection, version=listing["version"])
        batches, batch, size = [], [], 0
        for t in listing["tensors"]:
            if batch and size + t["byte_size"] > batch_bytes:
                batches.append(batch)
                batch, size = [], 0
            batch.append(t["name"])
            size += t["byte_size"]
        if batch:
            batches.append(batch)
        # Each batch asks for its served names (`paths` are names after
        # renaming; the filters already chose them).
        for key in ("include", "exclude", "paths"):
            pinned.pop(key, None)
        import concurrent.futures
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightstore-prefetch")
        try:
            ahead = pool.submit(self._fetch_batch, name, batches[0], pinned) if batches else None
            for k in range(len(batches)):
                tensors = ahead.result()
                ahead = pool.submit(self._fetch_batch, name, batches[k + 1], pinned) \
                    if k + 1 < len(batches) else None
                while tensors:
                    served = next(iter(tensors))
                    yield served, tensors.pop(served)  # the caller's reference is the last one
        finally:
            # A batch in flight finishes on its thread, and is dropped: a
            # caller that stops early does not wait for it.
            pool.shutdown(wait=False, cancel_futures=True)

    def _fetch_batch(self, name, names, pinned):
        """One batch of iter_tensors: the tensors served as `names`."""
        fetched = self._native.fetch(name, _selection(**dict(pinned, paths=list(names))))
        return {n: _as_tensor(n, dtype, shape, buffer, "torch") for n, dtype, shape, buffer in fetched["tensors"]}

    def load_into(self, module, name, allow_partial=False, **selection):
        """Loads `name` into a torch module's parameters and buffers (burn-store's
        apply: its target is the module) and returns the LoadResult. A load that
        does not fit raises Error (FAILED_PRECONDITION) and leaves the module
        untouched. Each tensor of the module's dtype, in contiguous CPU memory,
        is written straight into it from the mapping or the wire, with the GIL
        released (no copy in between; a socket's or file's pages are dropped
        from this process once copied); the others are fetched, then copied
        with torch's conversion. A fetch that fails once writing began (a
        broken connection, a checksum mismatch, Ctrl-C) raises an error that
        says the module may be partly written. Leave the module alone while
        the call runs: its memory is written from other threads.
        Tied parameters are loaded from whichever of their names the checkpoint
        holds. A transformers model's target is its checkpoint layout (what
        save_pretrained writes), and the tensors reach the module through
        transformers' own conversion; the result names the checkpoint's tensors."""
        import torch
        from weightstore import _transformers
        # Contiguous indices default off: a PyTorch module keeps the gaps its
        # parameter-free layers leave (Sequential's ReLU at index 2).
        selection.setdefault("contiguous_indices", False)
        convert = False
        if _transformers.is_model(module):
            target, convert = _transformers.target_schema(module)
        else:
            target = _target_schema(module, lambda: {t["name"] for t in self._native.listing(
                name, _selection(**selection))["tensors"]})
        s = _selection(allow_partial=allow_partial, target=target, **selection)
        targets = {} if convert else module.state_dict(keep_vars=True)
        # What is written behind autograd's back gets a new version, as copy_
        # gives it, so a graph that saved it sees the change; a torch without
        # increment_version (before 2.1) has torch copy everything.
        bump = getattr(torch.autograd.graph, "increment_version", None)
        places = [(n, *p) for n, t in targets.items() if bump is not None and (p := _place(t))]
        # The storages written stay alive for the call, whatever else runs.
        storages = [targets[n].untyped_storage() for n, *_ in places]
        written = []  # True once anything may have been written in place, error or not
        try:
            fetched = self._native.load_into(name, s, places, written)
            moved = [n for n, _, _, address, _ in places if targets[n].data_ptr() != address]
            if moved:
                raise Error("FAILED_PRECONDITION", f"'{name}': the module's tensors {moved[:4]} moved while "
                                                   "load_into wrote into them (leave the module alone meanwhile)")
            tensors = {n: _as_tensor(n, dtype, shape, buffer, "torch")
                       for n, dtype, shape, buffer in fetched["tensors"]}
            if convert:
                _transformers.load(module, name, tensors, allow_partial)
            else:
                with torch.no_grad():
                    for n, tensor in tensors.items():  # another dtype, or memory not written in place
                        targets[n].copy_(tensor)
        finally:
            # Every place, once any may have been written: a failure leaves
            # some written, and which is not known.
            for n, *_ in places if written else ():
                if not targets[n].is_inference():  # inference tensors keep no version
                    bump(targets[n])
            del storages
        return LoadResult(**fetched["apply_result"])

    def update(self, state, name, since=None, as_="torch", **selection):
        """Brings `state` to the current version of `name`: a dict of tensors
        by served name (from an earlier update or tensors() of this Store
        with the same selection) or a torch.nn.Module, changed in place. A
        state this Store did not fill with version `since` (by update() or
        tensors()) is fetched whole, since its selection (a shard rank, a
        dtype) is not known. Only the tensors
        changed since version `since` (the last Update.version; None: nothing
        held) are fetched from a remote store, or mapped through a socket
        (the others keep their mappings); a local store reads everything.
        A dict gets new tensors and loses those no longer selected; a module's
        parameters and buffers are copied into, and every fetched name must be
        one of them with the same shape, checked before anything is copied
        (Error FAILED_PRECONDITION otherwise, the module untouched).
        From a remote or socket store a changed tensor may come as an element
        patch (its changed elements), written in one call with the GIL released
        into a module's tensors in place (CPU, or CUDA by a scatter kernel in a
        build with CUDA), or into copies of a dict's; each
        result is checked against the version's digest, and patches that
        cannot be used are followed by the tensors whole (docs/updates.md).
        Returns an Update."""
        if as_ not in ("torch", "numpy"):
            raise ValueError(f"as_={as_!r}: 'torch' or 'numpy'")
        return self._update(state, name, since, as_, selection)

    def changes(self, name, since, as_="torch", patches=True, **selection):
        """What changed in `name` since version `since` (a version this store
        served; None or "": everything), received but not applied: a Changes
        whose `patched` tensors came as element patches (where the daemon
        keeps them) and whose `tensors` are the changed tensors that came whole
        and the new ones. Changes.apply(held) writes the patches into copies of
        the held tensors (or into them) and checks each result's digest;
        Changes.decode() gives them as ElementPatch (flat int64 indices and
        their new values), for writers of their own such as vLLM's
        load_checkpoint_weight_patches, unchecked: `digest` is what the result
        must be. Pin the version reached with version=ID. patches=False asks
        for the changed tensors whole. A local store sends every tensor whole;
        a socket store maps them (views, as tensors() gives)."""
        if as_ not in ("torch", "numpy"):
            raise ValueError(f"as_={as_!r}: 'torch' or 'numpy'")
        if since is not None and not isinstance(since, str):
            raise TypeError(f"since={since!r}: a version id (str) or None")
        if not isinstance(patches, bool):
            raise TypeError(f"patches={patches!r}: True or False")
        got = self._native.delta(name, _selection(**selection), since or "", bool(since) and patches)
        tensors = {n: _as_tensor(n, dtype, shape, buffer, as_) for n, dtype, shape, buffer in got["tensors"]}
        nbytes = sum(len(buffer) for _, _, _, buffer in got["tensors"]) + got["patch_bytes"]
        return Changes(version=got["version"], since=since or "", delta=got["delta"],
                       full_reason="" if got["delta"] else got["full_reason"], names=list(got["names"]),
                       unchanged=list(got["unchanged"]), patched=list(got["patched"]), tensors=tensors,
                       fetched_bytes=nbytes, patch_reason=got["patch_reason"], _native=self._native,
                       _raw=got["patches"], _specs=dict(got["patched"]), _as=as_)

    def _update(self, state, name, since, as_, selection):
        """update(): the algorithm is the C++ client's (client::UpdateInto);
        this gives it what `state` holds and where patches go, and takes in
        what arrived."""
        is_module = not isinstance(state, dict)
        if is_module:
            as_ = "torch"
            held = state.state_dict(keep_vars=True)
        else:
            held = state
            bad = next((k for k in held if not isinstance(k, str)), None)
            if bad is not None:
                raise TypeError(f"state: a dict of tensors by served name (str), not one with the key {bad!r:.80}")
        s = _selection(**selection)
        recorded = self._selections.get((id(state), name, since)) if since else None
        written = {}  # kept alive until the native call returns: patches are written there without the GIL

        def patch_into(names):
            """Where each patch goes: a module's tensors themselves, or copies
            of a dict's (taken in below)."""
            targets, destinations = _patch_destinations(names, held, in_place=is_module)
            written.update(targets)
            return [destinations[n] for n in names], is_module

        got = self._native.update(name, s, since or "", recorded or b"",
                                  [(n, *_served_spec(t), _patchable(t)) for n, t in held.items()], is_module,
                                  patch_into)
        fetched = {n: _as_tensor(n, dtype, shape, buffer, as_) for n, dtype, shape, buffer in got["tensors"]}
        removed = got["removed"]
        if is_module:
            import torch
            with torch.no_grad():
                for n, tensor in fetched.items():
                    held[n].copy_(tensor)
            removed = []  # a module keeps its parameters
        else:
            for n in removed:
                del state[n]
            state.update({n: written[n] for n in got["patched"]})
            state.update(fetched)
        self._selections_record(state, name, got["version"], got["selection"])
        return Update(version=got["version"], delta=got["delta"], full_reason="" if got["delta"] else got["full_reason"],
                      changed=got["changed"], added=got["added"], removed=removed, fetched_bytes=got["fetched_bytes"],
                      patched=got["patched"], patch_reason=got["patch_reason"], patch_failure=got["patch_failure"])

    def _record(self, state, name, version, selection):
        """Remembers that `state` holds `version` of `name` as `selection`
        chose it, for update(state, name, since=version)."""
        self._selections_record(state, name, version, self._native.selection_key(selection))

    def _selections_record(self, state, name, version, key):
        """_record, with the selection's key (the native selection_key())."""
        recorded = (id(state), name, version)
        self._selections.pop(recorded, None)  # re-inserted: the most recent
        self._selections[recorded] = key
        while len(self._selections) > 1024:  # the states and versions recently returned
            self._selections.pop(next(iter(self._selections)), None)

    def push(self, name, state, base=None, max_patch_bytes=1 << 30):
        """Publishes `state` (a dict of tensors by name, or a torch module)
        as the next version of checkpoint `name` on the daemon (a remote
        store; the admin scope). Only what changed since the served version
        is sent: tensors whose digest is the served one's are left out, and a
        changed tensor that `base` holds as served (the state pushed last,
        kept as it was: a copy, since training writes in place) goes as an
        element patch of it where that is smaller (at most max_patch_bytes,
        the daemon's --max-push-patch-bytes); the rest go whole. Served
        tensors `state` lacks are removed, new ones added. Digests, diffs and
        the upload run with the GIL released, reading the tensors in place:
        no other thread may change them meanwhile. The daemon checks every
        patch and result and publishes all or nothing (docs/updates.md).
        Keep `base` on the CPU (`t.detach().to("cpu", copy=True)`) for a GPU
        model. Returns a Push."""
        if not isinstance(max_patch_bytes, int) or isinstance(max_patch_bytes, bool) or \
                not 0 < max_patch_bytes < 2**63:
            raise ValueError(f"max_patch_bytes={max_patch_bytes!r}: a positive number of bytes")
        views, keep = _push_views(state, "state")
        base_views, base_keep = _push_views(base, "base") if base is not None else ([], [])
        got = self._native.push(name, views, base_views, int(max_patch_bytes))
        del keep, base_keep  # read by then
        return Push(version=got["version"], previous_version=got["previous_version"], whole=got["whole"],
                    patched=got["patched"], removed=got["removed"], unchanged=got["unchanged"],
                    sent_bytes=got["whole_bytes"] + got["patch_bytes"])

    def watch(self, on_event, name="", prefix="", known=None):
        """Follows checkpoints (one by name, or those under a prefix; all by
        default) as they are added, replaced and removed: calls on_event(event)
        with a dict (kind: "added", "replaced", "removed" or "synced"; name,
        old_version, new_version; for "replaced", delta and the changed,
        added and removed tensor names, or full_reason) until it returns
        False. `known`: {name: version} held already. A broken connection is
        reopened by itself; Ctrl-C ends the watch."""
        self._native.watch(name, prefix, dict(known or {}), on_event)
