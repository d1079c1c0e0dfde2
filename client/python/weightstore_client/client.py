"""RemoteClient (gRPC) and SocketClient (same-host socket). See __init__.py."""
import array
import dataclasses
import fcntl
import mmap
import os
import socket
import struct
import time
import warnings

import crc32c
import grpc
import numpy as np

from weightstore_client import _stubs

pb, pb_grpc, shm_pb = _stubs.load()

_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_, "U16": np.uint16,
          "U32": np.uint32, "U64": np.uint64}
_TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_MAX_FDS = 253  # SCM_MAX_FD
_ALL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _Chunk:
    __slots__ = ("index", "offset", "data", "last", "crc32c")

    def __init__(self):
        self.index, self.offset, self.data, self.last, self.crc32c = 0, 0, b"", False, 0


def _varint(buf, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WeightStoreError("DATA_LOSS", "a malformed TensorChunk (varint)")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _parse_chunk(raw):
    """The fields of a serialized TensorChunk; `data` is a view of `raw`, not a copy."""
    view, pos, chunk = memoryview(raw), 0, _Chunk()
    while pos < len(view):
        key, pos = _varint(view, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(view, pos)
            if field == 2:
                chunk.index = value
            elif field == 3:
                chunk.offset = value
            elif field == 5:
                chunk.last = bool(value)
        elif wire == 2:
            length, pos = _varint(view, pos)
            if pos + length > len(view):
                raise WeightStoreError("DATA_LOSS", "a malformed TensorChunk (length)")
            if field == 4:
                chunk.data = view[pos:pos + length]
            pos += length
        elif wire == 5:
            if field == 6:
                chunk.crc32c = int.from_bytes(view[pos:pos + 4], "little")
            pos += 4
        elif wire == 1:
            pos += 8
        else:
            raise WeightStoreError("DATA_LOSS", f"a malformed TensorChunk (wire type {wire})")
    return chunk


class WeightStoreError(Exception):
    """A failed call. `code` is the gRPC status code name ("NOT_FOUND", ...)."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass
class Checkpoint:
    name: str
    format: str
    container: str
    path: str
    total_bytes: int
    tensor_count: int
    metadata: dict
    version: str


@dataclasses.dataclass
class TensorInfo:
    name: str          # as served (after renaming)
    dtype: str         # "F32", "BF16", ...
    shape: tuple
    byte_size: int
    source_name: str   # in the file
    crc32c: int = None


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


def _selection(include=(), exclude=(), paths=(), renames=(), top_level_key="", contiguous_indices=None,
               adapter="", dtype="", target=None, allow_partial=False):
    s = pb.Selection(top_level_key=top_level_key, include=list(include), exclude=list(exclude), paths=list(paths),
                     adapter=adapter, dtype=dtype, allow_partial=allow_partial)
    for pattern, replacement in renames:
        s.renames.add(pattern=pattern, replacement=replacement)
    if contiguous_indices is not None:
        s.contiguous_indices = contiguous_indices
    if target is not None:
        s.target.CopyFrom(target)
    return s


def _checkpoint(info):
    return Checkpoint(info.name, info.format, info.container, info.path, info.total_bytes, info.tensor_count,
                      dict(info.metadata), info.version)


def _tensor_info(info):
    return TensorInfo(info.name, info.dtype, tuple(info.shape), info.byte_size,
                      info.source_name or info.name, info.crc32c if info.HasField("crc32c") else None)


def _load_result(r):
    return LoadResult(list(r.applied), list(r.skipped), list(r.missing), list(r.unused), list(r.errors),
                      list(r.suggestions))


def _torch_dtype(info):
    import torch
    name = _TORCH_NAMES.get(info.dtype)
    if name is None:
        raise WeightStoreError("UNIMPLEMENTED", f"tensor '{info.name}' is {info.dtype}, which torch 1.13 cannot hold")
    return getattr(torch, name)


def _numpy_dtype(info):
    dtype = _NUMPY.get(info.dtype)
    if dtype is None:
        raise WeightStoreError("UNIMPLEMENTED", f"tensor '{info.name}' is {info.dtype}, which numpy cannot hold; "
                                                "ask for torch tensors or pass dtype='F32'")
    return dtype


def _view(buffer, offset, info, as_):
    """A tensor over `buffer` (any object with the buffer protocol): no copy."""
    if as_ == "numpy":
        dtype = _numpy_dtype(info)
        count = info.byte_size // np.dtype(dtype).itemsize
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(tuple(info.shape))
    import torch
    dtype = _torch_dtype(info)
    if info.byte_size == 0:
        return torch.empty(tuple(info.shape), dtype=dtype)
    count = info.byte_size // torch.tensor([], dtype=dtype).element_size()
    with warnings.catch_warnings():  # read-only mappings: torch warns, the tensor is still valid to read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(tuple(info.shape))


def _target_schema(module):
    """The TargetSchema of a torch.nn.Module: every state_dict entry, with its owner's class name."""
    owners = {name: type(m).__name__ for name, m in module.named_modules()}
    schema = pb.TargetSchema()
    for path, tensor in module.state_dict(keep_vars=True).items():
        owner = path.rsplit(".", 1)[0] if "." in path else ""
        dtype = str(tensor.dtype).replace("torch.", "")
        name = {v: k for k, v in _TORCH_NAMES.items()}.get(dtype, "")
        schema.parameters.add(path=path, shape=list(tensor.shape), dtype=name, module=owners.get(owner, ""))
    return schema


def _module_selection(module, allow_partial, selection):
    """The selection for loading into a torch module. Contiguous indices default
    off: a PyTorch target keeps the gaps its parameter-free layers leave
    (Sequential's ReLU at index 2), unlike a Burn target."""
    selection.setdefault("contiguous_indices", False)
    return _selection(target=_target_schema(module), allow_partial=allow_partial, **selection)


def _copy_into(module, tensors):
    import torch
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)


class RemoteClient:
    """weightstored over gRPC. Fetched tensors are owned arrays (one copy, from the wire)."""

    def __init__(self, address, timeout=600.0, max_resumes=3, resume_window=60.0, token=None, tls_ca=None,
                 tls_cert=None, tls_key=None):
        """tls_ca (a PEM file) turns TLS on; tls_cert and tls_key add a client
        certificate (mutual TLS). token is sent as "authorization: Bearer ...".
        A broken stream resumes up to max_resumes times, each resume waiting up
        to resume_window seconds for the daemon to come back (a restart)."""
        options = [("grpc.max_receive_message_length", 16 << 20)]
        if tls_ca:
            read = lambda path: open(path, "rb").read() if path else None
            credentials = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.WeightStoreStub(self._channel)
        # FetchTensors as raw bytes: chunks are parsed here, without a protobuf copy of their data.
        self._raw_fetch = self._channel.unary_stream("/weightstore.v1.WeightStore/FetchTensors",
                                                     request_serializer=pb.FetchTensorsRequest.SerializeToString,
                                                     response_deserializer=None)
        self._timeout = timeout
        self._max_resumes = max_resumes
        self._resume_window = resume_window
        self._metadata = [("authorization", f"Bearer {token}")] if token else None

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise WeightStoreError(e.code().name, e.details()) from None

    def list_checkpoints(self):
        return [_checkpoint(c) for c in self._call(self._stub.ListCheckpoints, pb.ListCheckpointsRequest()).checkpoints]

    def get_checkpoint(self, name):
        return _checkpoint(self._call(self._stub.GetCheckpoint, pb.GetCheckpointRequest(name=name)))

    def list_tensors(self, name, with_checksums=False, **selection):
        r = self._call(self._stub.ListTensors, pb.ListTensorsRequest(name=name, selection=_selection(**selection),
                                                                     with_checksums=with_checksums))
        return [_tensor_info(t) for t in r.tensors]

    def _fetch(self, name, selection, as_):
        """Returns ({name: tensor}, the ListTensors response). Streams every selected tensor into one arena allocated up front (one
        prefaulting mmap: faulting fresh pages in one by one costs more than the
        transfer here), checks each CRC32C, and resumes a broken stream pinned to
        its version. The tensors are views of the arena, which lives while any of
        them does."""
        listing = self._call(self._stub.ListTensors, pb.ListTensorsRequest(name=name, selection=selection))
        infos = list(listing.tensors)
        offsets, total = [], 0
        for info in infos:
            total = (total + 63) // 64 * 64
            offsets.append(total)
            total += info.byte_size
        arena = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
        target = np.frombuffer(arena, dtype=np.uint8)
        version, done, resumes = listing.version, 0, 0
        while done < len(infos):
            request = pb.FetchTensorsRequest(name=name, selection=selection, version=version, start_index=done)
            crc = 0
            # A resume waits for the channel to come back, within the window.
            call = dict(timeout=self._timeout, metadata=self._metadata)
            if resumes:
                call.update(timeout=min(self._timeout, self._resume_window), wait_for_ready=True)
            try:
                for raw in self._raw_fetch(request, **call):
                    chunk = _parse_chunk(raw)
                    if chunk.index != done:
                        raise WeightStoreError("DATA_LOSS", f"a chunk of tensor {chunk.index}; expected {done}")
                    info, data = infos[done], chunk.data
                    if chunk.offset == 0:
                        crc = 0
                    if chunk.offset + len(data) > info.byte_size:
                        raise WeightStoreError("DATA_LOSS", f"tensor '{info.name}' overflows its declared size")
                    begin = offsets[done] + chunk.offset
                    target[begin:begin + len(data)] = np.frombuffer(data, dtype=np.uint8)
                    crc = crc32c.crc32c(data, crc)
                    if chunk.last:
                        if crc != chunk.crc32c or chunk.offset + len(data) != info.byte_size:
                            raise WeightStoreError("DATA_LOSS", f"tensor '{info.name}' does not match its CRC32C")
                        done += 1
                if done < len(infos):
                    raise WeightStoreError("DATA_LOSS", f"the stream ended after {done} of {len(infos)} tensors")
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or resumes >= self._max_resumes:
                    raise WeightStoreError(e.code().name, e.details()) from None
                resumes += 1
                time.sleep(min(0.5 * 2 ** (resumes - 1), 5.0))
        return {info.name: _view(arena, offsets[i], info, as_) for i, info in enumerate(infos)}, listing

    def fetch(self, name, as_="torch", **selection):
        """Every selected tensor, by served name, in selection order."""
        return self._fetch(name, _selection(**selection), as_)[0]

    def load_into(self, module, name, allow_partial=False, **selection):
        """Loads `name` into `module` (a torch.nn.Module) and returns the LoadResult.
        Raises WeightStoreError (FAILED_PRECONDITION, with the summary) if the load fails."""
        tensors, listing = self._fetch(name, _module_selection(module, allow_partial, selection), "torch")
        _copy_into(module, tensors)
        return _load_result(listing.apply_result)


class _Segment:
    """A received descriptor, checked and mapped read-only."""

    @staticmethod
    def map(fd, segment, index):
        try:
            size = os.fstat(fd).st_size
            what = f"segment {index} ('{segment.description}')"
            if size != segment.size:
                raise WeightStoreError("DATA_LOSS", f"{what} has {size} bytes; the daemon declared {segment.size}")
            if segment.kind == shm_pb.Segment.SEALED_MEMFD:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                if seals & _ALL_SEALS != _ALL_SEALS:
                    raise WeightStoreError("FAILED_PRECONDITION", f"{what} is not fully sealed")
            if size == 0:
                return b""
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps what it needs


class SocketClient:
    """weightstored's same-host socket (--socket). Fetched tensors are read-only
    views into the daemon's shared mappings: nothing is copied, and they stay
    valid after the daemon unloads the checkpoint or exits. Writing to them
    crashes the process; .clone() (torch) or .copy() (numpy) to modify."""

    def __init__(self, path, timeout=60.0):
        self._path = path
        self._timeout = timeout
        self._sock = None
        self._connect()

    def _connect(self):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(self._timeout)
        self._sock.connect(self._path)

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _recv_exactly(self, n, fds):
        parts, got = [], 0
        while got < n:
            data, received, flags, _ = socket.recv_fds(self._sock, n - got, _MAX_FDS)
            fds.extend(received)
            if flags & socket.MSG_CTRUNC:
                raise WeightStoreError("DATA_LOSS", "descriptors were dropped by the kernel")
            if not data:
                raise ConnectionError("the daemon closed the connection")
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    def _call(self, request):
        payload = request.SerializeToString()
        for attempt in range(2):  # a daemon restart closes the connection: reconnect once
            fds = []
            try:
                if self._sock is None:
                    self._connect()
                try:
                    self._sock.sendall(struct.pack("<I", len(payload)) + payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a refusal may already be queued: read it
                (length,) = struct.unpack("<I", self._recv_exactly(4, fds))
                response = shm_pb.ShmResponse.FromString(self._recv_exactly(length, fds))
            except (ConnectionError, OSError) as e:
                for fd in fds:
                    os.close(fd)
                self.close()
                if attempt == 1:
                    raise WeightStoreError("UNAVAILABLE", f"weightstored socket '{self._path}': {e}") from None
                continue
            if response.code != 0:
                for fd in fds:
                    os.close(fd)
                raise WeightStoreError(_code_name(response.code), response.message)
            return response, fds

    def list_checkpoints(self):
        r, _ = self._call(shm_pb.ShmRequest(list_checkpoints=pb.ListCheckpointsRequest()))
        return [_checkpoint(c) for c in r.list_checkpoints.checkpoints]

    def get_checkpoint(self, name):
        r, _ = self._call(shm_pb.ShmRequest(get_checkpoint=pb.GetCheckpointRequest(name=name)))
        return _checkpoint(r.checkpoint)

    def list_tensors(self, name, with_checksums=False, **selection):
        request = shm_pb.MapTensorsRequest(name=name, selection=_selection(**selection), table_only=True,
                                           skip_checksums=not with_checksums)
        r, _ = self._call(shm_pb.ShmRequest(map_tensors=request))
        return [_tensor_info(t.info) for t in r.map_tensors.tensors]

    def _map(self, name, selection, as_):
        request = shm_pb.MapTensorsRequest(name=name, selection=selection)
        r, fds = self._call(shm_pb.ShmRequest(map_tensors=request))
        m = r.map_tensors
        if len(fds) != len(m.segments):
            for fd in fds:
                os.close(fd)
            raise WeightStoreError("DATA_LOSS", f"{len(fds)} descriptors for {len(m.segments)} segments")
        segments = [_Segment.map(fd, s, i) for i, (fd, s) in enumerate(zip(fds, m.segments))]
        out = {}
        for t in m.tensors:
            buffer = segments[t.segment]
            if t.offset + t.info.byte_size > len(buffer):
                raise WeightStoreError("DATA_LOSS", f"tensor '{t.info.name}' lies outside segment {t.segment}")
            out[t.info.name] = _view(buffer, t.offset, t.info, as_)
        return out, m, segments

    def fetch(self, name, as_="torch", verify=False, **selection):
        """Every selected tensor as a read-only view, by served name, in selection
        order. verify=True reads every byte once to check its CRC32C."""
        out, m, segments = self._map(name, _selection(**selection), as_)
        if verify:
            for t in m.tensors:
                data = memoryview(segments[t.segment])[t.offset:t.offset + t.info.byte_size]
                if t.info.HasField("crc32c") and crc32c.crc32c(data) != t.info.crc32c:
                    raise WeightStoreError("DATA_LOSS", f"tensor '{t.info.name}' does not match its CRC32C")
        return out

    def load_into(self, module, name, allow_partial=False, **selection):
        """Copies `name` from the mappings into `module`'s parameters and buffers;
        returns the LoadResult (FAILED_PRECONDITION if the load fails)."""
        s = _module_selection(module, allow_partial, selection)
        tensors, m, _ = self._map(name, s, "torch")
        _copy_into(module, tensors)
        return _load_result(m.apply_result)


def _code_name(code):
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return "UNKNOWN"
