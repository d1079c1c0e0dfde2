"""The load format "weightstore": a vLLM model's weights from weightstored,
under their checkpoint names, as vLLM's own loaders hand them to
model.load_weights (docs/vllm.md)."""
import logging
import time

from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from weightstore._errors import Error
from weightstore.vllm import Options

# A child of vLLM's logger: its lines come out as vLLM's do.
logger = logging.getLogger("vllm.weightstore")


def checkpoint_weights(store, options, version):
    """(name, tensor) for every tensor of the checkpoint at `version`: views
    of the daemon's shared memory through a socket (each tensor-parallel rank
    then reads only the pages of its own slice), fetched over gRPC or read
    from files with file: in batches of about batch_bytes
    (store.iter_tensors). A failure names the checkpoint and the URL."""
    try:
        yield from store.iter_tensors(options.checkpoint, batch_bytes=options.batch_bytes, version=version)
    except Error as e:
        raise Error(e.code, f"checkpoint '{options.checkpoint}' version '{version}' at '{options.url}': "
                            f"{e.message}") from None


def load_weights_checked(model, weights, what):
    """model.load_weights(weights), with a failure while loading a tensor
    said as a tensor that does not fit the model (ValueError naming it, its
    dtype and shape, and `what`). Returns the names it loaded, or None when the
    model does not say."""
    current = []

    def tracked():
        for name, tensor in weights:
            current[:] = [(name, tensor)]
            yield name, tensor

    try:
        return model.load_weights(tracked())
    except Error:
        raise  # the daemon's, already naming the checkpoint
    except (KeyError, AssertionError, ValueError, RuntimeError, IndexError, AttributeError) as e:
        if not current:
            raise
        name, tensor = current[0]
        raise ValueError(f"{what} does not fit the model ({type(model).__name__}): loading tensor '{name}' "
                         f"({str(tensor.dtype).replace('torch.', '')}, shape {list(tensor.shape)}) failed, as it "
                         f"does for a tensor the model has no parameter for, or of another shape: "
                         f"{type(e).__name__}: {e}") from e


def check_every_parameter_loaded(model, model_config, loaded, what):
    """What vLLM's default loader checks of an unquantized model: every
    parameter got a tensor (ValueError naming those that did not)."""
    if loaded is None or getattr(model_config, "quantization", None) is not None:
        return
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
    if missing:
        raise ValueError(f"{what} does not fit the model ({type(model).__name__}): {len(missing)} of its parameters "
                         f"got no tensor, e.g. {', '.join(repr(n) for n in missing[:5])} (missing from the checkpoint, "
                         "or named otherwise)")


class WeightstoreModelLoader(BaseModelLoader):
    """--load-format weightstore: model_loader_extra_config is {"url",
    "checkpoint"} and optionally "version", "token", "tls_ca", "tls_cert",
    "tls_key", "batch_bytes", "timeout" (weightstore.vllm.Options)."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = Options.parse(load_config.model_loader_extra_config, "model_loader_extra_config")

    def download_model(self, model_config):
        """Nothing to download: checks that the daemon serves the checkpoint."""
        self.options.current_version(self.options.connect())

    def load_weights(self, model, model_config):
        start = time.perf_counter()
        store = self.options.connect()
        for attempt in range(3):
            version = self.options.current_version(store)
            what = f"weightstore checkpoint '{self.options.checkpoint}' (version {version} at '{self.options.url}')"
            try:
                loaded = load_weights_checked(model, checkpoint_weights(store, self.options, version), what)
                break
            except Error as e:
                # The newest version was replaced while its batches came: the
                # next pass loads the one after it into every parameter.
                if self.options.version or e.code not in ("ABORTED", "NOT_FOUND") or attempt == 2:
                    raise
                logger.info("weightstore: %s was replaced while loading; loading the newest again", what)
        check_every_parameter_loaded(model, model_config, loaded, what)
        mark_loaded(model, self.options, version)
        model._weightstore_model_dir = model_config.model  # what a reload_weights(weights_path=...) moves away from
        logger.info("weightstore: loaded %s over %s in %.2f s", what, store.kind, time.perf_counter() - start)

    def get_all_weights(self, model_config, model):
        """The checkpoint's newest version (or the pinned one), for
        collective_rpc("reload_weights"). reload_weights(weights_path=P)
        points model_config.model at P: the files there are then read by
        vLLM's default loader, as that call means."""
        loaded_from = getattr(model, "_weightstore_model_dir", None)
        if loaded_from is not None and model_config.model != loaded_from:
            from vllm.config.load import LoadConfig
            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
            model._weightstore_loaded = None  # not a version of the checkpoint
            files = DefaultModelLoader(LoadConfig(load_format="auto", download_dir=self.load_config.download_dir))
            yield from files.get_all_weights(model_config, model)
            return
        store = self.options.connect()
        version = self.options.current_version(store)
        model._weightstore_loaded = None  # partly reloaded until the last tensor is in
        yield from checkpoint_weights(store, self.options, version)
        mark_loaded(model, self.options, version)


def mark_loaded(model, options, version):
    """Records on the model which checkpoint version it holds: the weight
    transfer backend then fetches only what changed since."""
    model._weightstore_loaded = {"checkpoint": options.checkpoint, "version": version}
