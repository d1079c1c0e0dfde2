"""Writes fresh PyTorch checkpoints with real torch, plus what torch reads back.

Usage: make_torch_cases.py OUT_DIR

For each case OUT_DIR/<case>.pt is written and OUT_DIR/expected.json gets either
{"tensors": {name: {"dtype", "shape", "sha256"}}} (what torch.load returns,
nested dicts joined with '.', bytes of the C-contiguous tensor), or
{"refuse": "<text the reader's error must contain>"} for files that must be
refused. Runs under Debian's /usr/bin/python3 with python3-torch.
"""
import collections
import hashlib
import io
import json
import os
import pickle
import struct
import sys
import tarfile
import zipfile

import torch

DT = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
      torch.uint8: "U8", torch.bool: "BOOL"}


def digest(t):
    t = t.detach().contiguous()
    raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def flatten(obj, prefix, out):
    if isinstance(obj, torch.Tensor):
        out[prefix] = {"dtype": DT[obj.dtype], "shape": list(obj.shape), "sha256": digest(obj)}
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)


def expect_from_torch(path, top_level_key=None):
    # Only files this script just wrote, so the full unpickler: torch >= 2.6
    # defaults to weights_only=True, which refuses protocol 4's FRAME opcode.
    obj = torch.load(path, map_location="cpu", weights_only=False)
    if top_level_key:
        obj = obj[top_level_key]
    out = collections.OrderedDict()
    flatten(obj, "", out)
    return {"tensors": out}


def write_tar_checkpoint(path, tensors):
    """The TAR layout of torch < 0.1.10, as torch.serialization.legacy_load reads it."""
    storages, table, roots = io.BytesIO(), io.BytesIO(), []
    pickle.dump(len(tensors), storages, protocol=2)
    for i, (name, t) in enumerate(tensors.items()):
        key = 100 + i  # old torch keyed storages and tensors by integer ids
        storage_type = {torch.float32: torch.FloatStorage, torch.int64: torch.LongStorage}[t.dtype]
        pickle.dump((key, "cpu", storage_type), storages, protocol=2)
        base = t.detach().contiguous().view(-1)
        storages.write(struct.pack("<q", base.numel()))
        storages.write(base.numpy().tobytes())
        roots.append((name, key, t))
    pickle.dump([], storages, protocol=2)  # no storage views
    pickle.dump(len(roots), table, protocol=2)
    for i, (name, key, t) in enumerate(roots):
        tensor_type = {torch.float32: torch.FloatTensor, torch.int64: torch.LongTensor}[t.dtype]
        pickle.dump((i, key, tensor_type), table, protocol=2)
        table.write(struct.pack("<i", t.dim()) + b"\0" * 4)
        table.write(struct.pack(f"<{t.dim()}q", *t.shape))
        table.write(struct.pack(f"<{t.dim()}q", *t.contiguous().stride()))
        table.write(struct.pack("<q", 0))

    class TensorRef:
        def __init__(self, key):
            self.key = key

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return obj.key if isinstance(obj, TensorRef) else None

    main = io.BytesIO()
    Pickler(main, protocol=2).dump({name: TensorRef(str(i)) for i, (name, _, _) in enumerate(roots)})
    sys_info = pickle.dumps({"protocol_version": 1001, "little_endian": True,
                             "type_sizes": {"short": 2, "int": 4, "long": 8}}, protocol=2)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for member, data in [("sys_info", sys_info), ("pickle", main.getvalue()),
                             ("storages", storages.getvalue()), ("tensors", table.getvalue())]:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


class Evil:
    """Its __reduce__ would run a shell command if the pickle were executed."""
    marker = ""

    def __reduce__(self):
        return (os.system, ("touch " + Evil.marker,))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(7)
    expected = {}

    def save(name, obj, **kwargs):
        path = os.path.join(out, name + ".pt")
        torch.save(obj, path, **kwargs)
        expected[name] = expect_from_torch(path, kwargs.pop("top_level_key", None))
        return path

    base = torch.randn(4, 6)
    save("strided", {
        "transposed": base.t(),
        "permuted": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).permute(2, 0, 1),
        "sliced": base[1:, ::2],
        "expanded": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    })
    shared = torch.arange(20, dtype=torch.float32)
    save("views", {"first": shared[0:10], "second": shared[5:15], "all": shared})
    tied = torch.randn(5, 3)
    save("tied", {"embed.weight": tied, "lm_head.weight": tied})
    save("dtypes", {
        "bf16": torch.randn(3, 2).to(torch.bfloat16), "f16": torch.randn(7).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64), "bool": torch.tensor([True, False, True]),
        "u8": torch.tensor([0, 255, 7], dtype=torch.uint8), "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "i16": torch.tensor([-3, 3], dtype=torch.int16), "i32": torch.tensor([1 << 30], dtype=torch.int32),
        "i64": torch.tensor([-(1 << 62)], dtype=torch.int64),
    })
    save("empty_and_scalar", {"empty": torch.zeros(0, 3), "scalar": torch.tensor(3.5),
                              "int_scalar": torch.tensor(9, dtype=torch.int64)})
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    save("module_state_dict", model.state_dict())
    save("parameters", {"p": torch.nn.Parameter(torch.randn(2, 2))})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    path = os.path.join(out, "training_checkpoint.pt")
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(),
                "epoch": 3, "loss": 0.25, "note": "text"}, path)
    expected["training_checkpoint"] = expect_from_torch(path)
    expected["training_checkpoint.model_state_dict"] = dict(expect_from_torch(path, "model_state_dict"),
                                                             file="training_checkpoint", top_level_key="model_state_dict")
    save("protocol4", {"w": torch.randn(3, 3), "nested": {"b": torch.randn(2)}}, pickle_protocol=4)
    save("legacy", {"w": base, "t": base.t(), "view": shared[3:8], "i": torch.arange(5)},
         _use_new_zipfile_serialization=False)

    # The same zip with every entry deflated: torch reads it, so must we.
    src = os.path.join(out, "dtypes.pt")
    dst = os.path.join(out, "deflated.pt")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            zout.writestr(item.filename, zin.read(item.filename))
    expected["deflated"] = expect_from_torch(dst)

    tar_path = os.path.join(out, "tar_format.pt")
    write_tar_checkpoint(tar_path, {"weight": torch.randn(3, 4), "index": torch.arange(6).reshape(2, 3)})
    expected["tar_format"] = expect_from_torch(tar_path)

    # Files that must be refused, never executed.
    Evil.marker = os.path.join(out, "PWNED")
    torch.save({"x": Evil()}, os.path.join(out, "reduce_os_system.pt"))
    expected["reduce_os_system"] = {"refuse": "'posix.system' is not on the allow-list"}
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    scripted.save(os.path.join(out, "torchscript.pt"))
    expected["torchscript"] = {"refuse": "TorchScript"}
    torch.save(torch.nn.Linear(2, 2), os.path.join(out, "full_module.pt"))
    expected["full_module"] = {"refuse": "'torch.nn.modules.linear.Linear' is not on the allow-list"}
    with zipfile.ZipFile(os.path.join(out, "zip_slip.pt"), "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({}, protocol=2))
        z.writestr("archive/../../escape", b"x")
    expected["zip_slip"] = {"refuse": "escapes the archive"}
    data = open(os.path.join(out, "dtypes.pt"), "rb").read()
    open(os.path.join(out, "truncated.pt"), "wb").write(data[: len(data) // 2])
    expected["truncated"] = {"refuse": "end-of-central-directory"}

    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
