"""The reference language model behind `mhc train` and `mhc compare`: model, config, data,
train/ (the trainer and its checkpoints), parallel/ (DDP, FSDP2, pipelines, DCP checkpoints).

Imports the library (connections, ops, runtime); the library never imports this package.

    from torch_mhc.lm import load_model
    model = load_model("runs/a")          # a run folder (its ckpt/) or a checkpoint folder
    logits, _ = model(idx)                # the LM (lm.model.LM), in eval mode, on the CPU

`load_model(path, device="cpu", say=print)` is torch_mhc.lm.train.checkpoint.load_model:
a damaged ckpt falls back to ckpt.old / ckpt.prev with a message through `say`. It needs
the `train` extra (numpy), so it is imported on first use, not with this package.
"""

from __future__ import annotations

__all__ = ["load_model"]


def __getattr__(name: str):
    if name == "load_model":
        from torch_mhc.lm.train.checkpoint import load_model

        return load_model
    raise AttributeError(f"module 'torch_mhc.lm' has no attribute {name!r}")
