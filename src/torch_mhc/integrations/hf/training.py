"""transformers.Trainer with the weight decay torch_mhc.param_groups gives.

Trainer's default optimizer decays every parameter whose name does not look like a bias or a
norm weight (Trainer.get_decay_parameter_names), so it would decay the connections' static
maps and gates, which torch_mhc.param_groups keeps out of weight decay. No parameter name can
tell Trainer otherwise without renaming the connections' tensors (and breaking checkpoints),
so the trainer's rule is narrowed instead:

    trainer = torch_mhc.hf.exclude_from_weight_decay(transformers.Trainer(model=model, ...))
"""

from __future__ import annotations

from torch import nn

from torch_mhc.connections import param_groups

__all__ = ["exclude_from_weight_decay", "decayed_parameter_names"]


def decayed_parameter_names(model: nn.Module) -> set[str]:
    """The names (as model.named_parameters() gives them) of the trainable parameters
    torch_mhc.param_groups(model) puts in its weight-decay group."""
    decayed = {id(p) for p in param_groups(model, weight_decay=0.0)[0]["params"]}
    return {name for name, p in model.named_parameters() if id(p) in decayed}


def exclude_from_weight_decay(trainer):
    """Make trainer's default optimizer decay only what both its own rule and
    torch_mhc.param_groups decay: the connections' static maps and gates and every parameter
    with fewer than two dimensions get no weight decay. Works on any Trainer subclass (it
    narrows the instance's get_decay_parameter_names); call it before the optimizer is built
    (before train() or create_optimizer()). Returns the trainer."""
    rule = getattr(trainer, "get_decay_parameter_names", None)
    if not callable(rule):
        raise TypeError(
            f"exclude_from_weight_decay expects a transformers.Trainer, got "
            f"{type(trainer).__name__}"
        )
    if getattr(trainer, "optimizer", None) is not None:
        raise ValueError(
            "exclude_from_weight_decay: the trainer already has its optimizer; call it before "
            "train() or create_optimizer(), or build the optimizer with torch_mhc.param_groups"
        )

    def get_decay_parameter_names(model: nn.Module) -> list[str]:
        keep = decayed_parameter_names(model)
        return [name for name in rule(model) if name in keep]

    trainer.get_decay_parameter_names = get_decay_parameter_names
    return trainer
