"""The Python API under hostile arguments: every public call of the package
(connect, the Store's calls, safe_open) with values of every wrong type and
size (None, bools, negative and huge integers, NaN, long and non-UTF-8-able
strings, bytes, mappings that are not dicts, nested junk). Each batch of calls
runs in a child process, so that a crash is seen as what it is: a child killed
by a signal, or one that hangs, fails the test and names the call. A call may
succeed or raise any Python exception, never more.

Needs WS_ADDRESS, WS_SOCKET and WS_MODELS (a daemon serving it);
`python tests/python/test_api_fuzz.py`."""
import collections
import json
import os
import random
import subprocess
import sys
import types
import unittest

ADDRESS, SOCKET, MODELS = os.environ["WS_ADDRESS"], os.environ["WS_SOCKET"], os.environ["WS_MODELS"]
SEED, CASES_PER_STORE = 2026, 400
# What a call may take at most in a child; a child over it hangs.
CHILD_TIMEOUT_S = 300


def junk(rng, depth=0):
    """One hostile value: a random pick of wrong types and extreme sizes."""
    pool = [
        lambda: None, lambda: True, lambda: False, lambda: 0, lambda: -1, lambda: 2**31, lambda: 2**32,
        lambda: 2**63, lambda: 2**64, lambda: 2**100, lambda: -2**70, lambda: 1.5, lambda: float("nan"),
        lambda: float("inf"), lambda: "", lambda: "x" * 100_000, lambda: "\u00e9\u4e2d\U0001f600",
        lambda: "\ud800", lambda: "a\x00b", lambda: b"bytes", lambda: bytearray(b"\xff"), lambda: [], lambda: (),
        lambda: {}, lambda: set(), lambda: object(), lambda: collections.UserDict(path="w", shape=[1]),
        lambda: types.MappingProxyType({"path": "w", "shape": [1]}), lambda: collections.OrderedDict(a=1),
        lambda: (x for x in range(3)), lambda: range(5), lambda: slice(None, 2), lambda: Ellipsis,
        lambda: "^model\\.", lambda: "(unclosed", lambda: NAMES[0], lambda: "[0:1, :]",
    ]
    if depth < 2:
        pool += [lambda: [junk(rng, depth + 1) for _ in range(rng.randrange(4))],
                 lambda: tuple(junk(rng, depth + 1) for _ in range(rng.randrange(4))),
                 lambda: {junk_key(rng): junk(rng, depth + 1) for _ in range(rng.randrange(3))}]
    return rng.choice(pool)()


def junk_key(rng):
    value = junk(rng, 2)
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)[:20]


# Served by the daemon the test runs against (the shared fixtures).
NAMES = ["safetensors/multi_layer", "burnpack/mnist"]
SELECTION_KEYS = ["include", "exclude", "paths", "rename", "top_level_key", "contiguous_indices", "adapter", "dtype",
                  "shard", "slices", "version", "target", "allow_partial", "with_checksums", "nonsense"]


def near(rng, value):
    """`value`, or now and then junk in its place: a value of the right shape
    with a wrong part, which reaches past the first type check."""
    return junk(rng) if rng.random() < 0.3 else value


def name_key(rng):
    """A tensor name as a dict key: "w", or now and then hashable junk."""
    return junk_key(rng) if rng.random() < 0.3 else "w"


def integer(rng):
    return rng.choice([0, 1, 2, 3, -1, 2**31, 2**32, 2**64, 2**100, -2**70, True, 1.0])


def shaped(rng, key):
    """A value for selection keyword `key` shaped as the API expects, with
    wrong parts: mappings that are not dicts, integers out of range..."""
    mapping = rng.choice([dict, collections.OrderedDict, collections.UserDict, types.MappingProxyType,
                          lambda d: list(d.items())])
    if key == "target":
        return [mapping({"path": near(rng, "w"), "shape": near(rng, [integer(rng)]), "dtype": near(rng, "F32"),
                         "module": near(rng, "Linear")}) for _ in range(rng.randrange(3))]
    if key == "shard":
        rules = mapping({name_key(rng): near(rng, rng.choice([integer(rng), (integer(rng), integer(rng)),
                                                              (integer(rng), integer(rng), near(rng, True)),
                                                              f"{integer(rng)}x{integer(rng)}"]))})
        return (near(rng, integer(rng)), near(rng, integer(rng)), rules)
    if key == "slices":
        return mapping({name_key(rng): near(rng, rng.choice(["[0:1, :]", (slice(integer(rng), integer(rng)),),
                                                             slice(None, integer(rng), integer(rng))]))})
    if key == "rename":
        return [near(rng, (near(rng, "^w"), near(rng, "v")))]
    if key in ("include", "exclude", "paths"):
        return [near(rng, "w") for _ in range(rng.randrange(3))]
    return junk(rng)


def cases(seed, count):
    """Deterministic calls: (kind, args, kwargs), built the same in the parent
    and the child from the seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.choice(["tensors", "describe", "info", "update", "safe_open", "slice", "connect", "load_into",
                           "push", "changes", "iter_tensors"])
        kwargs = {}
        for key in rng.sample(SELECTION_KEYS, rng.randrange(4)):
            kwargs[key] = shaped(rng, key) if rng.random() < 0.6 else junk(rng)
        if kind == "tensors":
            kwargs.update(rng.choice([{}, {"as_": junk(rng)}, {"device": junk(rng)}]))
        name = rng.choice(NAMES + [junk(rng)])
        if rng.random() < 0.5:
            # Deep: a served name and one keyword shaped as expected, so that
            # the call reaches the extension's own conversions.
            kind, name = rng.choice(["tensors", "describe", "update", "changes", "iter_tensors"]), rng.choice(NAMES)
            key = rng.choice(["target", "target", "shard", "slices", "rename", "include"])
            kwargs = {key: shaped(rng, key)}
        out.append((kind, name, kwargs, [junk(rng) for _ in range(3)]))
    return out


def call(store, weightstore, kind, name, kwargs, extra):
    if kind == "tensors":
        return store.tensors(name, **kwargs)
    if kind == "describe":
        return store.describe(name, **kwargs)
    if kind == "info":
        return store.info(name)
    if kind == "update":
        return store.update(extra[0] if isinstance(extra[0], dict) else {}, name, since=extra[1], **kwargs)
    if kind == "push":  # the served fixtures are symlinks, which a push never rewrites
        state = extra[0] if isinstance(extra[0], dict) else {"w": extra[0]}
        return store.push(name, state, base=extra[1], max_patch_bytes=extra[2])
    if kind == "changes":
        patches = extra[2] if isinstance(extra[2], bool) else True
        changes = store.changes(name, since=extra[1], patches=patches, **kwargs)
        changes.decode()
        return changes.apply(extra[0] if isinstance(extra[0], dict) else {})
    if kind == "iter_tensors":
        ok = isinstance(extra[0], int) and not isinstance(extra[0], bool) and extra[0] > 0
        return list(store.iter_tensors(name, batch_bytes=extra[0] if ok else 1 << 20, **kwargs))
    if kind == "safe_open":
        with weightstore.safe_open(store, name, framework=extra[0], device=extra[1]) as f:
            return f.keys()
    if kind == "slice":
        with weightstore.safe_open(store, NAMES[0], framework=extra[2] if extra[2] == "np" else "pt") as f:
            key = name if isinstance(name, str) and name not in NAMES else f.keys()[0]
            return f.get_slice(key)[extra[0]]
    if kind == "connect":
        return weightstore.connect(name if isinstance(name, str) else extra[2], token=extra[0],
                                   parallel_streams=extra[1], timeout=1.0,
                                   **({"data_lane": extra[2]} if isinstance(extra[1], str) else {}))
    if kind == "load_into":
        import torch
        module = torch.nn.Sequential(torch.nn.Linear(16, 32))
        return store.load_into(module, name, **kwargs)
    raise AssertionError(kind)


def child(url, seed, first, last):
    """Runs cases [first, last) against `url`; prints one JSON line per case."""
    import weightstore
    store = weightstore.connect(url, timeout=60)
    for i, (kind, name, kwargs, extra) in enumerate(cases(seed, last)):
        if i < first:
            continue
        try:
            call(store, weightstore, kind, name, kwargs, extra)
            outcome = "ok"
        except BaseException as e:  # noqa: B902 - any exception is a fine outcome; only signals are not
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            outcome = type(e).__name__
        print(json.dumps([i, outcome]), flush=True)


def run_child(url, seed, first, last):
    """The child's exit status and the outcomes it printed."""
    proc = subprocess.run([sys.executable, __file__, "--child", url, str(seed), str(first), str(last)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    outcomes = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    return proc.returncode, outcomes, proc.stderr[-2000:]


class ApiFuzzTest(unittest.TestCase):
    def fuzz(self, url):
        seed = SEED + sum(url.partition(":")[0].encode())  # the same cases every run, per kind of store
        code, outcomes, stderr = run_child(url, seed, 0, CASES_PER_STORE)
        if code < 0 or len(outcomes) != CASES_PER_STORE:
            # Find the call: every case after the last one reported, alone.
            first = outcomes[-1][0] + 1 if outcomes else 0
            case = cases(seed, first + 1)[first]
            self.fail(f"{url}: the child ended with status {code} after {len(outcomes)} calls; the next call was "
                      f"{case[0]}({case[1]!r:.80}, {case[2]!r:.200}, extra={case[3]!r:.120})\n{stderr}")
        kinds = collections.Counter(o for _, o in outcomes)
        self.assertEqual(code, 0, stderr)
        # The fuzz reached past the argument checks sometimes: some calls succeed.
        self.assertGreater(kinds["ok"], 0, kinds)
        print(f"{url.split(':')[0]}: {dict(kinds)}", file=sys.stderr)

    def test_hostile_arguments_never_crash_or_hang_a_local_store(self):
        self.fuzz("file:" + MODELS)

    def test_hostile_arguments_never_crash_or_hang_a_grpc_store(self):
        self.fuzz(ADDRESS)

    def test_hostile_arguments_never_crash_or_hang_a_socket_store(self):
        self.fuzz("unix:" + SOCKET)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        unittest.main()
