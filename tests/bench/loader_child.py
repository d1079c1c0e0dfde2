"""One load of a SafeTensors file's tensors into this process, timed: what
owned_copy_bench.py and peers_bench.py run in a fresh process per row.

    python loader_child.py MODE PATH [URL]

PATH is the SafeTensors file (for torch-mmap the .pt file, for tensorizer the
.tensors file); URL is weightstore's ("unix:...", "127.0.0.1:PORT"; default
"file:" of PATH's folder), which serves PATH's stem. weightstore's time
includes connect(). Prints one line:
seconds, a digest of every tensor's name and bytes (outside the timing; "-"
for the limits, which make no tensors), peak RSS in bytes, and "owned" or
"view" (whether the tensors own their memory, or view a mapping of a file or
of the daemon's shared memory).

The peers' modes need tests/bench/peers-requirements.txt (scripts/peers-env.sh)
and import their library only when asked for.
"""
import hashlib
import mmap
import os
import sys
import threading
import time


MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module lacks the name


def limit(path, huge, prefault=False):
    """The copy's limit: the file's bytes into fresh private memory, advised
    for huge pages or not, in 4 MiB pieces on every usable core (at most 8), as
    weightstore copies; with `prefault`, each piece's pages are faulted in one
    madvise(MADV_POPULATE_WRITE) first. No tensors."""
    import numpy as np
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    src = np.frombuffer(m, dtype=np.uint8)
    threads = min(len(os.sched_getaffinity(0)), 8)
    t0 = time.perf_counter()
    # Private: a shared anonymous mapping (mmap's default) is shmem, which
    # takes no transparent huge pages here.
    buffer = mmap.mmap(-1, src.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    dst = np.frombuffer(buffer, dtype=np.uint8)
    piece = 4 << 20
    if prefault:
        import ctypes
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes calls without the GIL
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))

    def copy(first):  # numpy copies without the GIL
        for at in range(first * piece, src.size, threads * piece):
            if prefault and madvise(base + at, min(piece, src.size - at), MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
            np.copyto(dst[at:at + piece], src[at:at + piece])

    workers = [threading.Thread(target=copy, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0, None, True


def one_thread_copy(path):
    """torch.empty + copy_ of the mapped file into one buffer, on one thread."""
    import torch
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    src = torch.frombuffer(m, dtype=torch.uint8)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dst = torch.empty(src.numel(), dtype=torch.uint8)
    dst.copy_(src)
    return time.perf_counter() - t0, None, True


def load(mode, path, url):
    """(seconds, {name: tensor} or None, owned) for `mode`. Imports and
    connections to open are outside the timing; the load is inside."""
    if mode == "limit-huge":
        return limit(path, huge=True)
    if mode == "limit-4k":
        return limit(path, huge=False)
    if mode == "limit-4k-prefault":
        return limit(path, huge=False, prefault=True)
    if mode == "plain":
        return one_thread_copy(path)
    import torch
    if mode in ("safetensors", "safetensors-pread"):  # the default views a mapping of the file
        from safetensors.torch import load_file
        t0 = time.perf_counter()
        tensors, owned = (load_file(path), False) if mode == "safetensors" else (load_file(path, backend="pread"), True)
    elif mode == "torch-mmap":  # PATH is a .pt file; the tensors view a mapping of it
        t0 = time.perf_counter()
        tensors, owned = torch.load(path, mmap=True, weights_only=True), False
    elif mode == "runai":  # its read mode and concurrency come from RUNAI_STREAMER_* in the environment
        from runai_model_streamer import SafetensorsStreamer
        t0 = time.perf_counter()
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path)
            # owned=True (its default): each tensor keeps the buffer slot it
            # was read into, which the streamer never reuses.
            tensors, owned = dict(streamer.get_tensors()), True
    elif mode == "fastsafetensors":  # O_DIRECT or not: FASTSAFETENSORS_ODIRECT in the environment
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        t0 = time.perf_counter()
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
        loader.add_filenames({0: [path]})
        files = loader.copy_files_to_device()
        # The tensors share ownership of the file's buffer and outlive close().
        tensors, owned = {k: files.get_tensor(k) for k in loader.get_keys()}, True
        files.close()
        loader.close()
    elif mode == "tensorizer":  # PATH is a .tensors file
        from tensorizer import TensorDeserializer
        t0 = time.perf_counter()
        reader = TensorDeserializer(path, device="cpu")  # lazy_load=False: reads everything here
        tensors, owned = {k: v.detach() for k, v in reader.items()}, True
        reader.close()
    elif mode.startswith("weightstore"):
        import weightstore
        if mode == "weightstore-grpc":
            weightstore.tune_allocator_for_streaming()  # what the README asks of a process that fetches a lot
        name = os.path.basename(path)[: -len(".safetensors")]
        t0 = time.perf_counter()
        store = weightstore.connect(url or "file:" + os.path.dirname(path))
        tensors = store.tensors(name)
        owned = store.kind != "socket"  # a socket's tensors view the daemon's shared memory
        if mode == "weightstore-clone":
            tensors, owned = {k: v.clone() for k, v in tensors.items()}, True
    else:
        sys.exit(f"loader_child: unknown mode {mode!r}")
    return time.perf_counter() - t0, tensors, owned


def digest(tensors):
    """Every tensor's name, dtype, shape and bytes, in name order."""
    import torch
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def main():
    mode, path = sys.argv[1], sys.argv[2]
    url = sys.argv[3] if len(sys.argv) > 3 else ""
    seconds, tensors, owned = load(mode, path, url)
    # The load's peak, before the digest reads (and so maps) every view. VmHWM,
    # not getrusage's maxrss: that one keeps the parent's peak across fork and
    # exec.
    with open("/proc/self/status") as f:
        rss = int([line for line in f if line.startswith("VmHWM:")][0].split()[1]) * 1024
    check = digest(tensors) if tensors is not None else "-"
    print(f"{seconds} {check} {rss} {'owned' if owned else 'view'}")


if __name__ == "__main__":
    main()
