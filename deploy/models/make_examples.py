"""Regenerates the bundled example models (deterministic; needs python3-torch).

  /usr/bin/python3 deploy/models/make_examples.py && \
  build/client/weightstore convert --overwrite --top-level-key model_state_dict --metadata model=tiny-mlp deploy/models/tiny-mlp-torch.pt deploy/models/tiny-mlp.safetensors && \
  build/client/weightstore convert --overwrite --top-level-key model_state_dict --metadata model=tiny-mlp deploy/models/tiny-mlp-torch.pt deploy/models/tiny-mlp-burn.bpk
"""
import os

import torch

torch.manual_seed(2026)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
here = os.path.dirname(os.path.abspath(__file__))
torch.save({"model_state_dict": model.state_dict(), "epoch": 1},
           os.path.join(here, "tiny-mlp-torch.pt"))
