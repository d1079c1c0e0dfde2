"""The RL weight-transfer backend "weightstore": a running vLLM engine
follows a checkpoint that a trainer pushes to weightstored (docs/vllm.md).

Each worker keeps the checkpoint at the version its model holds ("held":
views of the daemon's shared memory through a socket, a host copy over gRPC),
which is what element patches apply to. An update lists what changed since,
receives the changed tensors (element patches where the daemon keeps them),
writes the patches into the held tensors and checks every result against the
new version's digest, and only then touches the model: it
reloads each changed decoder layer through vLLM's layerwise reload, sending
every tensor of that layer (vLLM rebuilds a layer from what arrives for it),
or, on a GPU, writes the patches' elements with vLLM's
load_checkpoint_weight_patches. A failure before that point (a version that
is not served, a dropped connection, a patch whose result fails its digest
with on_patch_failure "fail") leaves the model and the held tensors as they
were: the engine keeps serving its version.
"""
import dataclasses
import logging
import time

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from weightstore._errors import Error
from weightstore.vllm import Options
from weightstore.vllm._loader import load_weights_checked, mark_loaded

logger = logging.getLogger("vllm.weightstore")

_PATCH_FAILURE_CHOICES = ("fetch_whole", "fail")


@dataclasses.dataclass
class WeightstoreInitInfo(WeightTransferInitInfo):
    options: Options = None
    # On a GPU, write element patches with load_checkpoint_weight_patches
    # instead of reloading the changed layers.
    sparse_patches: bool = True
    # A patch whose result fails its digest: "fetch_whole" fetches the changed
    # tensors whole and goes on; "fail" refuses the update.
    on_patch_failure: str = "fetch_whole"


@dataclasses.dataclass
class WeightstoreUpdateInfo(WeightTransferUpdateInfo):
    version: str = ""  # "" is the newest


def layer_groups(names):
    """The checkpoint's names by decoder layer, in order: one group per
    outermost numbered prefix (model.layers.3.*, experts included), and one
    for the names outside any layer (embeddings, the final norm, the head:
    tied ones then travel together)."""
    groups, loose = {}, []
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if index is None:
            loose.append(name)
        else:
            groups.setdefault(".".join(parts[:index + 1]), []).append(name)
    return ([loose] if loose else []) + list(groups.values())


def _committed_version(worker):
    """Run on each worker by the engine core: the version its weightstore
    backend committed last, or None."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine.committed_version if isinstance(engine, WeightstoreWeightTransferEngine) else None


def report_versions_to_engine_core():
    """After finish_weight_update, vLLM's engine core reports the version
    the weightstore backend reached as its weight version (get_weight_version),
    when every worker agrees on it. vLLM sets that version only from the
    caller's finish_weight_update(weight_version=...), which a caller following
    "the newest" cannot know, so the engine core's collective_rpc is wrapped
    once per process."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # another vLLM layout: versions are then the caller's
        return
    original = EngineCore.collective_rpc
    if getattr(original, "_weightstore", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        out = original(self, method, timeout, args, kwargs)
        config = getattr(getattr(self, "vllm_config", None), "weight_transfer_config", None)
        if method == "finish_weight_update" and getattr(config, "backend", None) == "weightstore":
            versions = set(original(self, _committed_version, timeout))
            if len(versions) == 1 and None not in versions:
                self.set_weight_version(versions.pop())
        return out

    collective_rpc._weightstore = True
    EngineCore.collective_rpc = collective_rpc


class WeightstoreWeightTransferEngine(WeightTransferEngine):
    """WeightTransferConfig(backend="weightstore"). init_info: {"url",
    "checkpoint"} and optionally "token", "tls_ca", "tls_cert", "tls_key",
    "batch_bytes", "timeout" (as the load format's), "sparse_patches" (bool),
    "on_patch_failure" ("fetch_whole" or "fail"). update_info: {} for the
    newest version, or {"version": ID}."""

    init_info_cls = WeightstoreInitInfo
    update_info_cls = WeightstoreUpdateInfo
    # A draft model is another checkpoint: follow it with an engine of its own.
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._info = None
        self._store = None
        self._held = None     # {name: tensor}: the checkpoint at _version, or None when unknown
        self._version = None  # what the model holds (None: not known to come from this checkpoint)
        self._marked = None   # the model's own record of its version (mark_loaded) when _held was taken
        self.committed_version = None  # _version at the last finish_weight_update
        self.last_update = {}  # what the last update did, for logs and tests

    def parse_init_info(self, init_dict):
        init = dict(init_dict or {})
        sparse = init.pop("sparse_patches", True)
        failure = init.pop("on_patch_failure", "fetch_whole")
        if not isinstance(sparse, bool):
            raise ValueError(f"weightstore: 'sparse_patches' in init_info must be true or false, not {sparse!r}")
        if failure not in _PATCH_FAILURE_CHOICES:
            raise ValueError(f"weightstore: 'on_patch_failure' in init_info must be one of "
                             f"{', '.join(_PATCH_FAILURE_CHOICES)}, not {failure!r}")
        if "version" in init:
            raise ValueError("weightstore: init_info takes no 'version': pass it to update_weights "
                             "({'update_info': {'version': ID}})")
        return WeightstoreInitInfo(options=Options.parse(init, "init_info"), sparse_patches=sparse,
                                   on_patch_failure=failure)

    def parse_update_info(self, update_dict):
        update = dict(update_dict or {})
        unknown = sorted(set(update) - {"version"})
        if unknown:
            raise ValueError(f"weightstore: unknown key '{unknown[0]}' in update_info; it takes 'version' (a "
                             "version id; default: the newest)")
        version = update.get("version", "")
        if not isinstance(version, str):
            raise ValueError(f"weightstore: 'version' in update_info must be a version id (a string), not "
                             f"{version!r}")
        return WeightstoreUpdateInfo(version=version)

    def init_transfer_engine(self, init_info):
        options = init_info.options
        store = options.connect()
        options.current_version(store)  # the checkpoint is served
        self._info, self._store = init_info, store
        self._held, self._version = None, None
        loaded = getattr(self.model, "_weightstore_loaded", None)
        if loaded and loaded["checkpoint"] == options.checkpoint:
            self._hold(loaded["version"])
        self._marked = loaded
        self.committed_version = self._version
        logger.info("weightstore: following checkpoint '%s' at '%s' (%s) from version %s", options.checkpoint,
                    options.url, store.kind, self._version or "unknown: the first update reloads every layer")

    def _hold(self, version):
        """Takes the checkpoint at `version` as what the model holds: a full
        fetch over gRPC, mappings through a socket. A version no longer
        served leaves nothing held (the next update reloads every layer)."""
        try:
            self._held = self._store.changes(self._info.options.checkpoint, since=None, version=version).tensors
            self._version = version
        except Error as e:
            self._held, self._version = None, None
            logger.warning("weightstore: version %s of '%s', which the model holds, is not served (%s): the next "
                           "update reloads every layer", version, self._info.options.checkpoint, e)

    def start_weight_update(self):
        self._require_init()

    def finish_weight_update(self):
        self._require_init()
        self.committed_version = self._version

    def update_weights(self, update_info):
        # The base class ends with torch.accelerator.synchronize(), which
        # raises on a machine without an accelerator: only a GPU waits here.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self):
        self._store, self._held, self._info = None, None, None

    def _require_init(self):
        if self._store is None:
            raise RuntimeError("weightstore: call init_weight_transfer_engine({'init_info': {'url': ..., "
                               "'checkpoint': ...}}) before updating weights")

    def receive_weights(self, update_info):
        self._require_init()
        options = self._info.options
        start = time.perf_counter()
        loaded = getattr(self.model, "_weightstore_loaded", None)
        if loaded != self._marked:  # reload_weights moved the model meanwhile
            self._held, self._version = None, None
            if loaded and loaded["checkpoint"] == options.checkpoint:
                self._hold(loaded["version"])
            self._marked = loaded
        what = f"checkpoint '{options.checkpoint}' at '{options.url}'"
        keeps = f"the engine keeps serving version {self._version or '(the one it was loaded with)'}"
        try:
            target = update_info.version or self._store.info(options.checkpoint)["version"]
        except Error as e:
            raise Error(e.code, f"weightstore: update of {what} failed, {keeps}: {e.message}") from None
        self.last_update = {"version": target, "since": self._version, "patched": [], "whole": [], "layers": 0,
                            "fetched_bytes": 0, "patch_failure": "", "sparse": False, "seconds": {}}
        if target == self._version:
            return
        try:
            held, changes = self._next_held(target, what, keeps)
        except Error as e:
            if update_info.version and e.code in ("NOT_FOUND", "ABORTED"):
                raise Error(e.code, f"weightstore: version '{target}' of {what} is not served ({e.message}); "
                                    f"{keeps}") from None
            raise Error(e.code, f"weightstore: update of {what} to version {target} failed, {keeps}: "
                                f"{e.message}") from None
        unchanged = set(changes.unchanged)
        changed = [n for n in changes.names if n not in unchanged]
        groups = [g for g in layer_groups(changes.names) if any(n not in unchanged for n in g)]
        if changed:
            clock = time.perf_counter()
            self._load(groups, held, changes, changed, what, target)
            self.last_update["seconds"]["load"] = time.perf_counter() - clock
        self._held, self._version = held, target
        mark_loaded(self.model, options, target)
        self._marked = getattr(self.model, "_weightstore_loaded", None)
        self.last_update.update(layers=len(groups), fetched_bytes=changes.fetched_bytes,
                                patched=[p.name for p in changes.patches], whole=sorted(changes.tensors))
        logger.info("weightstore: %s to version %s in %.3f s: %d tensors changed (%d as element patches), %d "
                    "layers %s, %d bytes received", what, target, time.perf_counter() - start, len(changed),
                    len(changes.patches), len(groups), "patched" if self.last_update["sparse"] else "reloaded",
                    changes.fetched_bytes)

    def _next_held(self, target, what, keeps):
        """The checkpoint at `target` ({name: tensor}, every patched result
        checked against its digest), and the Changes it came from. The patches
        are written into the held tensors themselves, with no second copy:
        when one fails its digest they are written in part, so they are
        dropped (the next update reloads every layer) unless the changed
        tensors then come whole in their place."""
        name = self._info.options.checkpoint
        since = self._version if self._held is not None else None
        clock = time.perf_counter()
        changes = self._store.changes(name, since=since, version=target)
        self.last_update["seconds"]["receive"] = time.perf_counter() - clock
        self._check_fits(changes, what, target, keeps)
        clock = time.perf_counter()
        before = self._held
        patched = {}
        if changes.delta:
            try:
                patched = changes.apply(before, in_place=True)
            except Error as e:
                if e.code == "DATA_LOSS":  # written in part
                    self._held, self._version = None, None
                if self._info.on_patch_failure == "fail":
                    raise Error(e.code, f"an element patch failed ({e.message}); nothing was loaded") from None
                logger.warning("weightstore: an element patch of '%s' failed (%s): fetching the changed tensors "
                               "whole", name, e.message)
                self.last_update["patch_failure"] = e.message
                changes = self._store.changes(name, since=since, version=target, patches=False)
                self._check_fits(changes, what, target, keeps)
                patched = {}
        held = {n: before[n] for n in changes.unchanged} if changes.delta else {}
        held.update(patched)
        held.update(changes.tensors)
        self.last_update["seconds"]["apply"] = time.perf_counter() - clock
        missing = [n for n in changes.names if n not in held]
        if missing:
            self._held, self._version = None, None
            raise Error("DATA_LOSS", f"tensor '{missing[0]}' of version {target} came neither whole nor as a patch")
        return {n: held[n] for n in changes.names}, changes

    def _check_fits(self, changes, what, target, keeps):
        """Version `target` must have the tensors, dtypes and shapes of the
        version held (when one is): ValueError otherwise, before anything is
        written. (A patch is checked against its held tensor by apply.)"""
        if self._held is None:
            return
        added = [n for n in changes.names if n not in self._held]
        listed = set(changes.names)
        removed = [n for n in self._held if n not in listed]
        reshaped = [n for n, t in changes.tensors.items() if n in self._held and
                    (t.dtype != self._held[n].dtype or tuple(t.shape) != tuple(self._held[n].shape))]
        problems = [f"new tensor '{n}'" for n in added[:3]] + [f"tensor '{n}' is gone" for n in removed[:3]]
        problems += [f"tensor '{n}' is {str(changes.tensors[n].dtype).replace('torch.', '')} "
                     f"{list(changes.tensors[n].shape)}, was {str(self._held[n].dtype).replace('torch.', '')} "
                     f"{list(self._held[n].shape)}" for n in reshaped[:3]]
        if problems:
            raise ValueError(f"weightstore: version {target} of {what} does not fit the model the engine serves "
                             f"({'; '.join(problems)}); {keeps}")

    def _load(self, groups, held, changes, changed, what, target):
        """Writes version `target` into the model: element patches on a GPU
        where vLLM's sparse path takes them, else every tensor of each changed
        layer through vLLM's layerwise reload."""
        if self._sparse_ok(changes, changed):
            from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                                  load_checkpoint_weight_patches)
            try:
                load_checkpoint_weight_patches(self.model, [
                    CheckpointWeightPatch(name=p.name, shape=tuple(p.shape), dtype=p.values.dtype,
                                          values=p.values.to(self.device), indices=p.indices.to(self.device))
                    for p in changes.patches])
                self.last_update["sparse"] = True
                return
            except Exception as e:  # written in part, maybe: the changed layers are reloaded whole below
                logger.warning("weightstore: vLLM's sparse patch path refused the update (%s): reloading the "
                               "changed layers", e)
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                      initialize_layerwise_reload)
        names = [n for group in groups for n in group]
        initialize_layerwise_reload(self.model)
        try:
            load_weights_checked(self.model, ((n, held[n]) for n in names),
                                 f"weightstore version {target} of {what}")
        except BaseException:
            # The layers are mixed now: the next update reloads every one.
            self._held, self._version, self._marked = None, None, None
            self.model._weightstore_loaded = None
            raise
        finally:
            finalize_layerwise_reload(self.model, self.model_config)

    def _sparse_ok(self, changes, changed):
        """vLLM's sparse path: on a GPU, for floating-point patches only (NaN
        marks an unchanged element there, so no new value may be NaN), every
        changed tensor a patch."""
        if not self._info.sparse_patches or self.device is None or torch.device(self.device).type != "cuda":
            return False
        if not changes.delta or changes.tensors or len(changes.patches) != len(changed):
            return False
        return all(p.values.dtype.is_floating_point and p.values.element_size() > 1 and
                   not bool(torch.isnan(p.values).any()) for p in changes.patches)
