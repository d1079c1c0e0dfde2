"""What several of the package's Python tests share (tests/python/test_*.py).
Imported by name: each test runs as a script from this folder."""
import hashlib
import json
import os
import shutil

import numpy as np
import torch

import grpc
from weightstore.v1 import weight_store_pb2, weight_store_pb2_grpc


def rescan(address=None):
    """Has the daemon at `address` (default: $WS_ADDRESS) rescan its models folder."""
    with grpc.insecure_channel(address or os.environ["WS_ADDRESS"]) as channel:
        weight_store_pb2_grpc.WeightStoreStub(channel).Rescan(weight_store_pb2.RescanRequest(), timeout=60)


def random_bits(shape, dtype, generator):
    """A tensor of `dtype` with random bits (NaNs, infinities, subnormals); bools 0/1."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    size = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape)) if shape else 1
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def write_hub_repo(models, repo, files):
    """Lays `files` ({name in the repo: path}) out as huggingface_hub writes a
    cache: models--ORG--NAME/blobs/<sha256 for LFS files, the git blob sha1
    for the others>, snapshots/<commit>/<name> relative symlinks into
    ../../blobs, refs/main holding the commit. Returns the commit."""
    root = os.path.join(models, "models--" + repo.replace("/", "--"))
    shutil.rmtree(root, ignore_errors=True)
    blobs = {}
    for name, path in sorted(files.items()):
        with open(path, "rb") as f:
            data = f.read()
        if name.endswith((".safetensors", ".bin")):  # stored with Git LFS: the etag is the sha256
            etag = hashlib.sha256(data).hexdigest()
        else:  # a plain git blob: the etag is its git hash
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blobs[name] = (etag, data)
    commit = hashlib.sha1(json.dumps(sorted((n, e) for n, (e, _) in blobs.items())).encode()).hexdigest()
    snapshot = os.path.join(root, "snapshots", commit)
    os.makedirs(os.path.join(root, "blobs"))
    os.makedirs(os.path.join(root, "refs"))
    for name, (etag, data) in blobs.items():
        blob = os.path.join(root, "blobs", etag)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(snapshot, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(commit)  # huggingface_hub writes the bare hash, no newline
    return commit


class Daemon:
    """A weightstored of a test's own (WS_DAEMON) on 127.0.0.1 port 0 over
    `models`, with its metrics endpoint, logging to a file beside its port
    file; waited for until it serves. stop() ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, models, *args, work=None):
        import subprocess
        import tempfile
        import time
        self.models = models
        os.makedirs(models, exist_ok=True)
        self.work = work or tempfile.mkdtemp(prefix="ws-daemon-")
        port_file = os.path.join(self.work, "port")
        self.log_path = os.path.join(self.work, "stderr.log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [os.environ["WS_DAEMON"], "--models", models, "--listen", "127.0.0.1:0", "--port-file", port_file,
                 "--metrics-listen", "127.0.0.1:0", *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        for _ in range(600):  # 30 s: only a daemon that never starts takes that long
            if os.path.exists(port_file + ".metrics") and os.path.exists(port_file):
                with open(port_file) as f, open(port_file + ".metrics") as m:
                    port, metrics = f.read().strip(), m.read().strip()
                if port and metrics:
                    self.address, self.metrics_port = "127.0.0.1:" + port, int(metrics)
                    return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"weightstored did not start: {self.log()}")

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metric(self, name, **labels):
        """One sample off /metrics (None when absent)."""
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=60) as r:
            text = r.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            series, value = line.rsplit(" ", 1)
            series_name, _, rest = series.partition("{")
            if series_name == name and ",".join(sorted(rest.rstrip("}").split(","))) == want:
                return float(value)
        return None

    def stop(self):
        import subprocess
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
