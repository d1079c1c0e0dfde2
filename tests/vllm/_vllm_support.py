"""What the vLLM tests share (tests/vllm/test_*.py): a weightstored of their
own, tiny transformers models with random weights (nothing comes from a
hub), the model folders vLLM reads, and engines run in this process.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
executor): an engine then starts in seconds, and several live side by side.
An engine that fails to start, or is shut down, takes vLLM's process groups
with it (close()). The test of vLLM's own processes (the entry point found
by the engine core and the worker) starts `vllm serve` instead.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from the hub
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from _support import write_hub_repo  # noqa: E402,F401

DAEMON = os.environ["WS_DAEMON"]
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()

# Greedy decoding of these from every engine: token ids compared exactly.
PROMPTS = [[3, 17, 42, 99, 5], [200, 7, 7, 64], [11, 250, 128, 33, 90, 4, 61]]
VOCAB = 256


def tiny_configs():
    """{key: config}: 2 layers, hidden 64, heads of 32 (vLLM's CPU attention
    takes head sizes from 32)."""
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                     max_position_embeddings=256)
    qwen = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                       moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                       max_position_embeddings=256)
    return {"llama": llama, "qwen3-moe": qwen}


def tiny_model(config, seed=7):
    """A causal LM of `config` with random weights, scaled up so that greedy
    decoding depends on them."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    return model


def write_tokenizer(path):
    """A word-level tokenizer of the tiny vocabulary ("t0" .. "t255")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(path)


def model_dir(path, model, weights):
    """A folder vLLM is given: config.json, the generation config and the
    tokenizer, and the weights (model.safetensors) only when `weights`."""
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    if not weights:
        os.remove(os.path.join(path, "model.safetensors"))
    return path


def hub_repo(models, repo, saved):
    """Serves the folder `saved` (save_pretrained's) as hub repo `repo` in the
    models folder. Returns the commit."""
    return write_hub_repo(models, repo, {n: os.path.join(saved, n) for n in sorted(os.listdir(saved))})


class Daemon:
    """A weightstored on 127.0.0.1 (a port of its own) and a socket, serving
    `models`."""

    def __init__(self, models, socket, *flags):
        self.models, self.socket, self.flags = models, socket, list(flags)
        self.process = None
        self.start()

    def start(self):
        port_file = self.socket + ".port"
        if os.path.exists(port_file):
            os.remove(port_file)
        self.log = open(self.socket + ".log", "ab")
        self.process = subprocess.Popen([DAEMON, "--models", self.models, "--listen", "127.0.0.1:0", "--port-file",
                                         port_file, "--socket", self.socket, "--drain-seconds", "0", *self.flags],
                                        stdout=self.log, stderr=self.log)
        for _ in range(1200):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            if self.process.poll() is not None:
                raise RuntimeError(f"weightstored exited with {self.process.returncode}: see {self.socket}.log")
            time.sleep(0.05)
        self.address = "127.0.0.1:" + open(port_file).read().strip()

    def kill(self):
        """SIGKILL: the connection drops with nothing said."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.log.close()

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def engine(model, **kwargs):
    """A vLLM engine in this process."""
    from vllm import LLM
    return LLM(model=model, max_model_len=128, enforce_eager=True, seed=0, max_num_seqs=4,
               distributed_executor_backend="uni", enable_prefix_caching=False, **kwargs)


def greedy(llm):
    """The token ids `llm` decodes greedily after each of PROMPTS."""
    from vllm import SamplingParams
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def close(llm=None):
    """Shuts an engine down (its KV cache is a GiB), or cleans up after one
    that failed to start, and tears down vLLM's process groups: the next
    engine in this process makes its own. Engines alive side by side share
    those groups, so close one only when none other lives on."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
        del llm
    gc.collect()
    cleanup_dist_env_and_memory()
