"""Finds (or generates) the Python protobuf stubs of weightstore's API.

The stubs are generated from proto/weightstore/v1/*.proto by the CMake build
into <build>/python. Lookup order: $WEIGHTSTORE_PYTHON_STUBS, then build*/python
of the source tree this package sits in, then a fresh generation with protoc and
grpc_python_plugin (Debian's protobuf-compiler and protobuf-compiler-grpc) into
a temporary folder.
"""
import glob
import importlib
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE_ROOT = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
_PROTO_ROOT = os.path.join(_SOURCE_ROOT, "proto")
_PROTOS = ["weightstore/v1/weight_store.proto", "weightstore/v1/shm.proto"]


def _has_stubs(folder):
    return os.path.isfile(os.path.join(folder, "weightstore", "v1", "shm_pb2.py"))


def _generate():
    out = tempfile.mkdtemp(prefix="weightstore-stubs-")
    subprocess.check_call(["protoc", f"-I{_PROTO_ROOT}", f"--python_out={out}", f"--grpc_out={out}",
                           "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin", *_PROTOS])
    return out


def _stub_folder():
    env = os.environ.get("WEIGHTSTORE_PYTHON_STUBS")
    if env:
        if not _has_stubs(env):
            raise ImportError(f"WEIGHTSTORE_PYTHON_STUBS={env} holds no weightstore/v1/shm_pb2.py")
        return env
    for candidate in sorted(glob.glob(os.path.join(_SOURCE_ROOT, "build*", "python"))):
        if _has_stubs(candidate):
            return candidate
    return _generate()


def load():
    """Returns (weight_store_pb2, weight_store_pb2_grpc, shm_pb2)."""
    folder = _stub_folder()
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return (importlib.import_module("weightstore.v1.weight_store_pb2"),
            importlib.import_module("weightstore.v1.weight_store_pb2_grpc"),
            importlib.import_module("weightstore.v1.shm_pb2"))
