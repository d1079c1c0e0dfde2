"""Store.load_into for transformers models.

transformers 5 loads a checkpoint through conversions: it renames keys and
merges tensors (a Qwen3-MoE's per-expert gate_proj and up_proj become one 3-D
mlp.experts.gate_up_proj; a ViT's encoder.layer.N.attention.attention.query
becomes layers.N.attention.q_proj), and save_pretrained reverts them. Tied
weights (GPT-2's lm_head.weight is transformer.wte.weight) are written once. So
a model's state dict is not the layout of the files it reads and writes.

For a transformers model, load_into's target is therefore the checkpoint
layout: what save_pretrained would write, computed on the meta device (names,
shapes and dtypes; no weight is copied). Where that layout is the module's own
state dict less its tied aliases (Llama, GPT-2), the fetched tensors are copied
in by name. Where transformers converts (Qwen3-MoE, ViT), the fetched tensors,
in checkpoint names, go through transformers' own loading (from_pretrained with
a state dict builds the model on the meta device, converts and ties), and the
result is copied into the module's parameters and buffers in place.
"""
import sys

from weightstore._errors import Error

# The transformers whose save_pretrained _saved_layout repeats (its internals).
CHECKED_WITH = "5.24.0"


def is_model(module):
    """Whether `module` is a transformers PreTrainedModel (without importing
    transformers for a module that has nothing to do with it)."""
    if "transformers" not in sys.modules:
        return False
    if not any(c.__module__.partition(".")[0] == "transformers" for c in type(module).__mro__):
        return False
    from transformers import PreTrainedModel
    return isinstance(module, PreTrainedModel)


def _saved_layout(model, state):
    """What save_pretrained does to `state` before writing it: drops the keys
    it ignores on save and the tied aliases, then reverts the load-time
    conversions. The one place that uses transformers internals, as
    PreTrainedModel.save_pretrained uses them in transformers 5.24.0."""
    import transformers
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError as e:
        raise Error("UNIMPLEMENTED", f"load_into computes a transformers model's checkpoint layout as save_pretrained "
                                     f"does in transformers {CHECKED_WITH}, through internals this transformers "
                                     f"({transformers.__version__}) lacks: {e}") from None
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    layout = revert_weight_conversion(model, state)
    # With no conversion for the model, revert_weight_conversion returns the
    # dict it was given; were it ever a copy, load would convert, to the same end.
    return layout, layout is not state


def target_schema(model):
    """The target schema of a transformers model, its checkpoint layout (the
    names, shapes and dtypes save_pretrained writes, from meta tensors), and
    whether loading it needs transformers' conversion (else the names are the
    module's own)."""
    from weightstore import _TORCH_DTYPES
    if getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None) is not None:
        raise Error("UNIMPLEMENTED", f"load_into does not load into a quantized or PEFT {type(model).__name__}; "
                                     "fetch the tensors with store.tensors() and load them with transformers")
    meta = {k: v.to("meta") for k, v in model.state_dict().items()}
    layout, converts = _saved_layout(model, meta)
    names = {v: k for k, v in _TORCH_DTYPES.items()}
    owners = {name: type(m).__name__ for name, m in model.named_modules()}
    return [{"path": path, "shape": list(t.shape), "dtype": names.get(str(t.dtype).replace("torch.", "")),
             "module": owners.get(path.rpartition(".")[0], "")} for path, t in layout.items()], converts


def load(model, name, tensors, allow_partial):
    """Puts `tensors` (checkpoint names) into `model` through transformers'
    conversion, then copies them into its parameters and buffers in place
    (tied ones once, shared by every name). Checked before anything is copied:
    a failure raises Error FAILED_PRECONDITION and leaves the model untouched."""
    import torch
    kind = type(model)
    try:
        # Public API: from_pretrained without a path, from a state dict. The
        # model it builds views the fetched tensors where no conversion applies.
        loaded, info = kind.from_pretrained(None, config=model.config, state_dict=tensors, dtype=model.dtype,
                                            output_loading_info=True)
    except Exception as e:  # a conversion that fails raises RuntimeError, after its report
        raise Error("FAILED_PRECONDITION", f"transformers did not load '{name}' into {kind.__name__}: "
                                           f"{type(e).__name__}: {e}") from e
    problems = [f"{k}: transformers found no place for it" for k in sorted(info.get("unexpected_keys", ()))]
    problems += [f"{k}: shape {tuple(got)}, the model has {tuple(want)}"
                 for k, got, want in sorted(info.get("mismatched_keys", ()))]
    problems += [str(m) for m in info.get("error_msgs", ())]
    missing = set(info.get("missing_keys", ()))
    if missing and not allow_partial:
        problems += [f"{k}: not loaded (missing after conversion)" for k in sorted(missing)]
    targets = model.state_dict(keep_vars=True)
    converted = {k: v for k, v in loaded.state_dict().items() if k not in missing}
    problems += [f"{k}: not a parameter or buffer of the module" for k in converted if k not in targets]
    problems += [f"{k}: shape {tuple(v.shape)}, the module has {tuple(targets[k].shape)}"
                 for k, v in converted.items() if k in targets and v.shape != targets[k].shape]
    if problems:
        raise Error("FAILED_PRECONDITION", f"'{name}' does not load into {kind.__name__} through transformers "
                                           f"{sys.modules['transformers'].__version__}: " + "; ".join(problems[:8]))
    with torch.no_grad():
        for k, v in converted.items():
            targets[k].copy_(v)
