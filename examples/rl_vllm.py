"""A toy RL loop on a CPU: a trainer changes about 1% of a tiny Llama's weights
per step and publishes each step to weightstored with
store.push(name, module, base=last); a vLLM engine that loaded the policy from
the daemon follows with update_weights and generates after each step.

    python examples/rl_vllm.py [--daemon build/server/weightstored] [--steps 5] [--grpc]

Runs in the vLLM environment with the weightstore package installed
(docs/vllm.md: `scripts/vllm-env.sh`, then `pip install` the package's wheel),
and starts a weightstored of its own on a temporary models folder, reached
through its same-host socket (or over gRPC with --grpc).
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the model is tiny

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import weightstore  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VOCAB = 256


def policy_model():
    """A 2-layer Llama with random weights (heads of 32: vLLM's CPU attention
    takes head sizes from 32)."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5)
    return model


def model_folder(path, model):
    """What vLLM needs besides the weights: config.json and a tokenizer (here
    a word-level one: "t0" .. "t255")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    model.config.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(path)
    return path


def training_step(model, generator):
    """Stands in for an optimizer step: about 1% of every weight's elements
    take new values."""
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            picked = torch.randperm(flat.numel(), generator=generator)[:max(1, flat.numel() // 100)]
            flat[picked] = torch.randn(picked.numel(), generator=generator) * 0.5


def start_daemon(binary, models, socket):
    port_file = socket + ".port"
    daemon = subprocess.Popen([binary, "--models", models, "--listen", "127.0.0.1:0", "--port-file", port_file,
                               "--socket", socket, "--drain-seconds", "0"], stderr=subprocess.DEVNULL)
    for _ in range(1200):
        if os.path.exists(port_file) and open(port_file).read().strip():
            return daemon, "127.0.0.1:" + open(port_file).read().strip()
        if daemon.poll() is not None:
            sys.exit(f"weightstored exited with {daemon.returncode}")
        time.sleep(0.05)
    sys.exit("weightstored did not start")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--daemon", default=os.path.join(ROOT, "build", "server", "weightstored"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--grpc", action="store_true", help="follow over gRPC instead of the socket")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    work = tempfile.mkdtemp(prefix="weightstore-rl-example-")
    os.makedirs(f"{work}/models")
    trainer = policy_model()
    save_file({n: t.contiguous() for n, t in trainer.state_dict().items()}, f"{work}/models/policy.safetensors")
    daemon, address = start_daemon(args.daemon, f"{work}/models", f"{work}/ws.sock")
    try:
        url = address if args.grpc else f"unix:{work}/ws.sock"
        store = weightstore.connect(address)  # the trainer pushes over gRPC
        source = {"url": url, "checkpoint": "policy"}
        llm = LLM(model=model_folder(f"{work}/model", trainer), load_format="weightstore",
                  model_loader_extra_config=source, weight_transfer_config=WeightTransferConfig(backend="weightstore"),
                  max_model_len=128, enforce_eager=True, seed=0)
        llm.init_weight_transfer_engine({"init_info": source})
        greedy = SamplingParams(temperature=0, max_tokens=8)
        prompt = "t3 t17 t42 t99 t5"

        def generate(label):
            text = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text
            print(f"{label}: version {llm.get_weight_version()}: {prompt} ->{text}", flush=True)

        generate("step 0")
        last = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
        generator = torch.Generator().manual_seed(1)
        for step in range(1, args.steps + 1):
            training_step(trainer, generator)
            pushed = store.push("policy", trainer, base=last)
            last = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
            start = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {}})  # the newest version: what changed since the engine's
            llm.finish_weight_update()
            llm.reset_prefix_cache()  # cached prompts were computed with the old weights
            print(f"step {step}: pushed {pushed.version} ({len(pushed.patched)} tensors as element patches, "
                  f"{pushed.sent_bytes} bytes); the engine updated in {time.perf_counter() - start:.2f} s", flush=True)
            generate(f"step {step}")
            assert llm.get_weight_version() == pushed.version
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait()


if __name__ == "__main__":  # vLLM starts processes of its own
    main()
