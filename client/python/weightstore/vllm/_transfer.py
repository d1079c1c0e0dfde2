"""The RL weight-transfer backend "weightstore": a running vLLM engine
follows a checkpoint that a trainer pushes to weightstored (docs/vllm.md).

Each worker keeps the checkpoint at the version its model holds ("held"),
which is what element patches apply to: a host copy (over gRPC fetched,
through a socket copied once out of the daemon's mapping, so that no
version's segment stays mapped), or with init_info's "patches": false through
a socket, views of the daemon's shared memory, refreshed by mapping the
changed tensors anew. An update, in order:

1. the engine core pins "the newest" to one version for every rank;
2. each rank receives what changed since its version, checks that the
   tensors still fit, writes the patches into the held tensors and checks
   every result against the new version's digest ("staging");
3. the ranks agree that every one of them staged (an all-reduce over vLLM's
   world group), or none touches its model;
4. each rank reloads each changed decoder layer through vLLM's layerwise
   reload, sending every tensor of that layer (vLLM rebuilds a layer from
   what arrives for it), or on a GPU writes the patches' elements with vLLM's
   load_checkpoint_weight_patches.

A failure in steps 1-3 (a version that is not served, a dropped connection,
a patch whose result fails its digest with on_patch_failure "fail", a
version that does not fit) leaves every model as it was: the engine keeps
serving its version, and the error says which failure it was. A failure in
step 4 leaves layers mixed: the engine then reports its weight version as
INCONSISTENT until an update reloads every layer.
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
# The weight version an engine reports when a reload failed partway.
INCONSISTENT = "weightstore:inconsistent"


@dataclasses.dataclass
class WeightstoreInitInfo(WeightTransferInitInfo):
    options: Options = None
    # On a GPU, write element patches with load_checkpoint_weight_patches
    # instead of reloading the changed layers.
    sparse_patches: bool = True
    # A patch whose result fails its digest: "fetch_whole" fetches tensors
    # whole and goes on; "fail" refuses the update.
    on_patch_failure: str = "fetch_whole"
    # Ask for element patches. False: the changed tensors come whole (through
    # a socket, mapped anew: the held checkpoint is then views, not a copy).
    patches: bool = True


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


def _backend(worker):
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine if isinstance(engine, WeightstoreWeightTransferEngine) else None


def _newest_version(worker):
    """Run on each worker by the engine core: the newest version its daemon
    serves, or None when it cannot say (the update then says why)."""
    engine = _backend(worker)
    return engine.newest_version() if engine is not None else None


def _held_version(worker):
    """Run on each worker by the engine core: the version its model holds
    (INCONSISTENT after a reload that failed partway), or None."""
    engine = _backend(worker)
    return engine.model_version() if engine is not None else None


def _forget_version(method, discards):
    """Wraps a Worker method that changes the model's weights from outside
    the backend (reload_weights, sleep): the model's recorded version is
    cleared first, so that the next update reloads every layer. The
    weightstore load format records the version again when it reloaded.
    `discards(args, kwargs)` says whether this call changes the weights."""
    def wrapper(self, *args, **kwargs):
        if discards(args, kwargs):
            model_runner = getattr(self, "model_runner", None)
            model = getattr(model_runner, "model", None)
            if model is not None:
                model._weightstore_loaded = None
        return method(self, *args, **kwargs)
    wrapper._weightstore = True
    return wrapper


def patch_vllm():
    """Once per process:

    - vLLM's engine core pins an update to "the newest" to one version for
      every rank, and reports the version the weightstore backend reached as
      its weight version (get_weight_version) after finish_weight_update and
      after a failed update. vLLM sets that version only from the caller's
      finish_weight_update(weight_version=...), which a caller following "the
      newest" cannot know.
    - Worker.reload_weights and Worker.sleep(level=2) clear the model's
      recorded version (see _forget_version).
    """
    try:
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.gpu_worker import Worker
    except Exception as e:  # another vLLM layout: versions are then the caller's
        logger.warning("weightstore: vLLM's engine core or worker was not found (%s): get_weight_version() is "
                       "the caller's, and outside reloads are not noticed", e)
        return
    if not getattr(Worker.reload_weights, "_weightstore", False):
        Worker.reload_weights = _forget_version(Worker.reload_weights, lambda args, kwargs: True)
        Worker.sleep = _forget_version(Worker.sleep, lambda args, kwargs: kwargs.get("level", (args or (1,))[0]) == 2)
    original = EngineCore.collective_rpc
    if getattr(original, "_weightstore", False):
        return

    def report(core, timeout):
        try:
            versions = set(original(core, _held_version, timeout))
        except Exception as e:  # the update's own outcome stands
            logger.warning("weightstore: the workers' versions could not be read back: %s", e)
            return
        if versions == {None}:
            return
        version = versions.pop() if len(versions) == 1 else INCONSISTENT
        core.set_weight_version(version or INCONSISTENT)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        config = getattr(getattr(self, "vllm_config", None), "weight_transfer_config", None)
        if getattr(config, "backend", None) != "weightstore" or method not in ("update_weights",
                                                                                "finish_weight_update"):
            return original(self, method, timeout, args, kwargs)
        if method == "finish_weight_update":
            out = original(self, method, timeout, args, kwargs)
            report(self, timeout)
            return out
        info = (kwargs or {}).get("update_info")
        if isinstance(info, dict) and not info.get("version"):
            newest = [v for v in original(self, _newest_version, timeout) if v]
            if newest:  # rank 0's view, for every rank
                kwargs = dict(kwargs, update_info=dict(info, version=newest[0]))
        try:
            return original(self, method, timeout, args, kwargs)
        except BaseException:
            report(self, timeout)  # what the models hold after the failure
            raise

    collective_rpc._weightstore = True
    EngineCore.collective_rpc = collective_rpc


class _QuietUnchangedLayers(logging.Filter):
    """vLLM's layerwise reload warns "Failed to load weights" for every layer
    that received nothing, though it then keeps that layer's tensors, as an
    update of some layers wants: those lines are left out while the backend
    finalizes its reload."""

    def filter(self, record):
        return "Failed to load weights" not in record.getMessage()


class WeightstoreWeightTransferEngine(WeightTransferEngine):
    """WeightTransferConfig(backend="weightstore"). init_info: {"url",
    "checkpoint"} and optionally "token", "tls_ca", "tls_cert", "tls_key",
    "timeout" (as the load format's), "patches" (bool), "sparse_patches"
    (bool), "on_patch_failure" ("fetch_whole" or "fail"). update_info: {} for the
    newest version, or {"version": ID}."""

    init_info_cls = WeightstoreInitInfo
    update_info_cls = WeightstoreUpdateInfo
    # A draft model is another checkpoint: follow it with an engine of its own.
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._info = None
        self._store = None
        self._held = None     # {name: tensor}: the checkpoint at _version, or None when not held
        self._version = None  # the version _held is
        self._model_version = None  # what the model holds (None: not known to come from this checkpoint)
        self._inconsistent = False  # a reload failed partway: layers are mixed
        self._marked = None   # the model's own record of its version (mark_loaded) when _held was taken
        self.last_update = {}  # what the last update did, for logs and tests

    def parse_init_info(self, init_dict):
        init = dict(init_dict or {})
        sparse = init.pop("sparse_patches", True)
        failure = init.pop("on_patch_failure", "fetch_whole")
        patches = init.pop("patches", True)
        for key, value in (("sparse_patches", sparse), ("patches", patches)):
            if not isinstance(value, bool):
                raise ValueError(f"weightstore: '{key}' in init_info must be true or false, not {value!r}")
        if failure not in _PATCH_FAILURE_CHOICES:
            raise ValueError(f"weightstore: 'on_patch_failure' in init_info must be one of "
                             f"{', '.join(_PATCH_FAILURE_CHOICES)}, not {failure!r}")
        if "version" in init:
            raise ValueError("weightstore: init_info takes no 'version': pass it to update_weights "
                             "({'update_info': {'version': ID}})")
        return WeightstoreInitInfo(options=Options.parse(init, "init_info"), sparse_patches=sparse,
                                   on_patch_failure=failure, patches=patches)

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
        self._sync_with_model()
        logger.info("weightstore: following checkpoint '%s' at '%s' (%s) from version %s", options.checkpoint,
                    options.url, store.kind, self._version or "unknown: the first update reloads every layer")

    def _sync_with_model(self):
        """Takes the version the model records (the load format's, or the
        last update's) as held: a full fetch over gRPC, mappings through a
        socket. Another checkpoint's, none, or one no longer served leaves
        nothing held: the next update reloads every layer."""
        loaded = getattr(self.model, "_weightstore_loaded", None)
        # Whatever reloaded the model replaced every layer.
        self._held, self._version, self._marked, self._inconsistent = None, None, loaded, False
        self._model_version = None
        if not loaded or loaded["checkpoint"] != self._info.options.checkpoint:
            return
        self._model_version = loaded["version"]
        try:
            self._held = self._own(self._store.changes(self._info.options.checkpoint, since=None,
                                                       version=loaded["version"]).tensors)
            self._version = loaded["version"]
        except Error as e:
            self._held = None
            logger.warning("weightstore: version %s of '%s', which the model holds, is not served (%s): the next "
                           "update reloads every layer", loaded["version"], self._info.options.checkpoint, e)

    def _own(self, tensors):
        """Tensors to hold: through a socket with patches, copies of the
        daemon's views (a patch written into a copy-on-write view would copy
        its pages anyway, and keep that version's segment mapped for good)."""
        if self._store.kind != "socket" or not self._info.patches:
            return tensors
        return {n: t.clone() for n, t in tensors.items()}

    def newest_version(self):
        try:
            return self._store.info(self._info.options.checkpoint)["version"] if self._store else None
        except Error:
            return None

    def model_version(self):
        return INCONSISTENT if self._inconsistent else self._model_version

    def start_weight_update(self):
        self._require_init()

    def finish_weight_update(self):
        self._require_init()

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
        what = f"checkpoint '{options.checkpoint}' at '{options.url}'"
        staged, failure = None, None
        try:
            staged = self._stage(update_info, what)
        except Exception as e:  # said after every rank has answered
            failure = e
        if not self._every_rank_staged(failure is None):
            if failure is None:
                # This rank staged, another did not: the held tensors may be
                # patched already, so they are dropped.
                self._held, self._version = None, None
                raise RuntimeError(f"weightstore: update of {what} failed on another rank (its error says why); "
                                   f"{self._keeps()}")
            raise failure
        if staged is None:  # nothing changed
            return
        held, changes, target = staged
        unchanged = set(changes.unchanged)
        changed = [n for n in changes.names if n not in unchanged]
        groups = [g for g in layer_groups(changes.names) if any(n not in unchanged for n in g)]
        if changed or self._inconsistent:
            clock = time.perf_counter()
            self._load(groups, held, changes, changed, what, target)
            self.last_update["seconds"]["load"] = time.perf_counter() - clock
        self._held, self._version, self._model_version, self._inconsistent = held, target, target, False
        mark_loaded(self.model, options, target)
        self._marked = getattr(self.model, "_weightstore_loaded", None)
        self.last_update.update(layers=len(groups), fetched_bytes=changes.fetched_bytes,
                                patched=list(changes.patched), whole=sorted(changes.tensors))
        logger.info("weightstore: %s to version %s in %.3f s: %d tensors changed (%d as element patches), %d "
                    "layers %s, %d bytes received", what, target, time.perf_counter() - start, len(changed),
                    len(changes.patched), len(groups), "patched" if self.last_update["sparse"] else "reloaded",
                    changes.fetched_bytes)

    def _keeps(self):
        if self._inconsistent:
            return "the engine's layers are mixed from an earlier failed reload: update again"
        return f"the engine keeps serving version {self._model_version or '(the one it was loaded with)'}"

    def _stage(self, update_info, what):
        """Steps 1-2 of an update on this rank: the version to reach, and
        what the model is to receive. None when the model holds it already."""
        if getattr(self.model, "_weightstore_loaded", None) != self._marked:
            self._sync_with_model()  # reload_weights or sleep changed the model meanwhile
        keeps = self._keeps()
        try:
            target = update_info.version or self._store.info(self._info.options.checkpoint)["version"]
        except Error as e:
            raise Error(e.code, f"weightstore: update of {what} failed, {keeps}: {e.message}") from None
        self.last_update = {"version": target, "since": self._version, "patched": [], "whole": [], "layers": 0,
                            "fetched_bytes": 0, "patch_failure": "", "sparse": False, "seconds": {}}
        if target == self._model_version and not self._inconsistent:
            return None
        try:
            held, changes = self._next_held(target, what, keeps)
        except Error as e:
            if e.code in ("NOT_FOUND", "ABORTED"):
                raise Error(e.code, f"weightstore: version '{target}' of {what} is not served ({e.message}); "
                                    f"{keeps}") from None
            raise Error(e.code, f"weightstore: update of {what} to version {target} failed, {keeps}: "
                                f"{e.message}") from None
        return held, changes, target

    def _every_rank_staged(self, staged):
        """Step 3: whether every rank of the engine staged its update (an
        all-reduce over vLLM's world group; every rank gets here, staged or
        not)."""
        from vllm.distributed.parallel_state import get_world_group
        group = get_world_group()
        if group.world_size == 1:
            return staged
        failed = torch.tensor([0 if staged else 1], dtype=torch.int32)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return int(failed.item()) == 0

    def _sparse_possible(self):
        """Whether vLLM's sparse patch path may take this update: on a GPU,
        for an unquantized model (a quantized or repacked parameter is not
        the checkpoint's tensor)."""
        return (self._info.sparse_patches and self.device is not None and torch.device(self.device).type == "cuda"
                and getattr(self.model_config, "quantization", None) is None)

    def _next_held(self, target, what, keeps):
        """The checkpoint at `target` ({name: tensor}, every patched result
        checked against its digest), and the Changes it came from. The
        patches are written into the held tensors themselves, with no second
        copy: when one fails its digest they are written in part, so the
        whole checkpoint is fetched in their place (or, with on_patch_failure
        "fail", nothing is held: the next update reloads every layer)."""
        name = self._info.options.checkpoint
        since = self._version if self._held is not None else None
        patches = self._info.patches
        clock = time.perf_counter()
        changes = self._store.changes(name, since=since, version=target, patches=patches)
        self.last_update["seconds"]["receive"] = time.perf_counter() - clock
        self._check_fits(changes, what, target, keeps)
        clock = time.perf_counter()
        before = self._held
        patched = {}
        if changes.delta and changes.patched:
            try:
                patched = changes.apply(before, in_place=True)
            except Error as e:
                if e.code == "DATA_LOSS":  # written in part: the held checkpoint is not `since`'s bytes
                    self._held, self._version, before = None, None, None
                if self._info.on_patch_failure == "fail":
                    raise Error(e.code, f"an element patch failed ({e.message}); nothing was loaded") from None
                logger.warning("weightstore: an element patch of '%s' failed (%s): fetching %s whole", name,
                               e.message, "every tensor" if before is None else "the changed tensors")
                self.last_update["patch_failure"] = e.message
                changes = self._store.changes(name, since=since if before is not None else None, version=target,
                                              patches=False)
                self._check_fits(changes, what, target, keeps)
                patched = {}
        held = {n: before[n] for n in changes.unchanged} if changes.delta else {}
        held.update(patched)
        held.update(self._own(changes.tensors))
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
        """Step 4: writes version `target` into the model: element patches on
        a GPU where vLLM's sparse path takes them, else every tensor of each
        changed layer (every layer after a failed reload) through vLLM's
        layerwise reload. A failure partway leaves the layers mixed: the
        engine then reports INCONSISTENT, and the next update reloads every
        layer."""
        if not self._inconsistent and self._sparse_ok(changes, changed):
            from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                                  load_checkpoint_weight_patches)
            try:
                load_checkpoint_weight_patches(self.model, [
                    CheckpointWeightPatch(name=p.name, shape=tuple(p.shape), dtype=p.values.dtype,
                                          values=p.values.to(self.device), indices=p.indices.to(self.device))
                    for p in changes.decode()])
                self.last_update["sparse"] = True
                return
            except Exception as e:  # written in part, maybe: the changed layers are reloaded whole below
                logger.warning("weightstore: vLLM's sparse patch path refused the update (%s): reloading the "
                               "changed layers", e)
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                      initialize_layerwise_reload)
        if self._inconsistent:
            groups = layer_groups(changes.names)
        names = [n for group in groups for n in group]
        quiet = _QuietUnchangedLayers()
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        try:
            initialize_layerwise_reload(self.model)
            load_weights_checked(self.model, ((n, held[n]) for n in names),
                                 f"weightstore version {target} of {what}")
            layerwise.addFilter(quiet)
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                layerwise.removeFilter(quiet)
        except BaseException as e:
            self._held, self._version, self._model_version, self._marked = None, None, None, None
            self._inconsistent = True
            self.model._weightstore_loaded = None
            raise RuntimeError(f"weightstore: vLLM's layerwise reload of version {target} of {what} failed partway "
                               f"({type(e).__name__}: {e}); the engine's layers are now mixed and it reports its "
                               f"weight version as {INCONSISTENT}: update again (every layer is then reloaded) or "
                               "reload_weights") from e

    def _sparse_ok(self, changes, changed):
        """vLLM's sparse path: on a GPU, for floating-point patches only (NaN
        marks an unchanged element there, so no new value may be NaN), every
        changed tensor a patch."""
        if not self._sparse_possible() or not changes.delta or changes.tensors:
            return False
        if len(changes.patched) != len(changed):
            return False
        return all(p.values.dtype.is_floating_point and p.values.element_size() > 1 and
                   not bool(torch.isnan(p.values).any()) for p in changes.decode())
