"""weightstore in vLLM: a load format and an RL weight-transfer backend, both
named "weightstore" (docs/vllm.md).

    vllm serve MODEL_DIR --load-format weightstore \\
        --model-loader-extra-config '{"url": "unix:/run/weightstore.sock", "checkpoint": "acme/llama"}'

    llm = LLM(MODEL_DIR, load_format="weightstore",
              model_loader_extra_config={"url": "host:50051", "checkpoint": "acme/llama"},
              weight_transfer_config=WeightTransferConfig(backend="weightstore"))
    llm.init_weight_transfer_engine({"init_info": {"url": "host:50051", "checkpoint": "acme/llama"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {}})         # or {"version": ID}
    llm.finish_weight_update()
    llm.get_weight_version()                        # weightstore's content-named id

MODEL_DIR holds config.json and the tokenizer; the weights come from the
daemon. vLLM finds both through the `vllm.general_plugins` entry point, which
calls register() in its front end, engine core and every worker: nothing here
is imported by vLLM otherwise, and nothing here imports vLLM until then.
"""
import dataclasses

from weightstore._errors import Error

__all__ = ["register", "Options"]

# The keys of model_loader_extra_config and of init_info, and what each is.
_KEYS = {
    "url": "what weightstore.connect takes: unix:/path (same host), host:port (gRPC), file:/path",
    "checkpoint": "the served checkpoint's name (weightstore ls)",
    "version": "a version id to load (default: the newest); not in init_info: pass it to update_weights",
    "token": "the daemon's bearer token (default: $WEIGHTSTORE_TOKEN)",
    "tls_ca": "PEM file of the CA the daemon's certificate is checked with (gRPC over TLS)",
    "tls_cert": "PEM file of this client's certificate (mutual TLS)",
    "tls_key": "PEM file of this client's key (mutual TLS)",
    "batch_bytes": "loading over gRPC or from files, the bytes fetched per batch (two at most are held; "
                   "default 256 MiB)",
    "timeout": "seconds a call may take (default 600)",
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Where the weights come from: model_loader_extra_config or init_info,
    checked."""
    url: str
    checkpoint: str
    version: str = ""
    token: str = None
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    batch_bytes: int = 256 << 20
    timeout: float = 600.0

    @classmethod
    def parse(cls, config, where):
        """Options from a dict (`where` names it in errors): ValueError naming
        the key that is missing, unknown or of the wrong kind."""
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise ValueError(f"weightstore: {where} must be a JSON object with 'url' and 'checkpoint', "
                             f"not {type(config).__name__}")
        unknown = sorted(set(config) - set(_KEYS))
        if unknown:
            raise ValueError(f"weightstore: unknown key '{unknown[0]}' in {where}; the keys are: " +
                             "; ".join(f"{k} ({v})" for k, v in _KEYS.items()))
        for key in ("url", "checkpoint"):
            if not isinstance(config.get(key), str) or not config[key]:
                raise ValueError(f"weightstore: {where} needs '{key}': {_KEYS[key]}")
        for key in ("version", "tls_ca", "tls_cert", "tls_key"):
            if not isinstance(config.get(key, ""), str):
                raise ValueError(f"weightstore: '{key}' in {where} must be a string: {_KEYS[key]}")
        if config.get("token") is not None and not isinstance(config["token"], str):
            raise ValueError(f"weightstore: 'token' in {where} must be a string")
        batch = config.get("batch_bytes", cls.batch_bytes)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 << 20 <= batch <= 1 << 40:
            raise ValueError(f"weightstore: 'batch_bytes' in {where} must be an integer from 1 MiB to 1 TiB, "
                             f"not {batch!r}")
        timeout = config.get("timeout", cls.timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise ValueError(f"weightstore: 'timeout' in {where} must be seconds, more than 0 and at most a day")
        return cls(url=config["url"], checkpoint=config["checkpoint"], version=config.get("version", ""),
                   token=config.get("token"), tls_ca=config.get("tls_ca", ""), tls_cert=config.get("tls_cert", ""),
                   tls_key=config.get("tls_key", ""), batch_bytes=batch, timeout=float(timeout))

    def connect(self):
        """A Store, or Error naming the URL."""
        import weightstore
        try:
            return weightstore.connect(self.url, token=self.token, tls_ca=self.tls_ca, tls_cert=self.tls_cert,
                                       tls_key=self.tls_key, timeout=self.timeout)
        except Error as e:
            raise Error(e.code, f"weightstore at '{self.url}': {e.message}") from None

    def current_version(self, store):
        """The version to load: the pinned one, checked, or the newest. Error
        NOT_FOUND naming the checkpoint and the URL when it is not served."""
        try:
            newest = store.info(self.checkpoint)["version"]
            if self.version and self.version != newest:
                store.describe(self.checkpoint, version=self.version)  # still served?
        except Error as e:
            raise Error(e.code, f"checkpoint '{self.checkpoint}'" +
                        (f" version '{self.version}'" if self.version else "") +
                        f" at '{self.url}': {e.message}") from None
        return self.version or newest


_REGISTERED = []


def register():
    """The `vllm.general_plugins` entry point: registers the load format
    "weightstore" and the weight-transfer backend "weightstore". vLLM calls it
    in every process it starts, maybe more than once: later calls do nothing."""
    if _REGISTERED:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from weightstore.vllm._loader import WeightstoreModelLoader
    register_model_loader("weightstore")(WeightstoreModelLoader)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    if "weightstore" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("weightstore", "weightstore.vllm._transfer",
                                                    "WeightstoreWeightTransferEngine")
    from weightstore.vllm._transfer import patch_vllm
    patch_vllm()
    _REGISTERED.append(True)
