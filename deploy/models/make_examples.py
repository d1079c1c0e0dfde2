"""Regenerates the bundled example models (deterministic; needs python3-torch).

  /usr/bin/python3 deploy/models/make_examples.py && \
  build/client/weightstore convert --overwrite --top-level-key model_state_dict --metadata model=tiny-mlp deploy/models/tiny-mlp-torch.pt deploy/models/tiny-mlp.safetensors && \
  build/client/weightstore convert --overwrite --top-level-key model_state_dict --metadata model=tiny-mlp deploy/models/tiny-mlp-torch.pt deploy/models/tiny-mlp-burn.bpk && \
  build/client/weightstore convert --overwrite --top-level-key model_state_dict --contiguous-indices deploy/models/tiny-mlp-torch.pt deploy/models/tiny-mlp-record.mpk

The last is a Burn NamedMpk record (Burn 0.14-0.21's .mpk), as Burn's
NamedMpkFileRecorder writes one: its layers renumbered 0, 1, 2, since a
record's Vec has no gaps.
"""
import os

import torch

torch.manual_seed(2026)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
here = os.path.dirname(os.path.abspath(__file__))
torch.save({"model_state_dict": model.state_dict(), "epoch": 1},
           os.path.join(here, "tiny-mlp-torch.pt"))
