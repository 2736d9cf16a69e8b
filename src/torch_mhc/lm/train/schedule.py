"""The learning-rate schedule and the spike policy: pure functions of the step and of the
accepted losses, so that restoring a step and a window of losses restores them exactly."""

from __future__ import annotations

import math
from collections import deque

from torch_mhc.lm.config import TrainConfig

__all__ = ["STEP_DECAY_AT", "LRSchedule", "SpikeGuard"]

STEP_DECAY_AT = (0.8, 0.9)  # fractions of training at which the step schedule decays


class LRSchedule:
    """lr(step) for step = updates done so far (0-based): a pure function of the step.

    Warmup: lr * (step + 1) / warmup for step < warmup. Then
    - "cosine": min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2, p from 0 to 1 over the rest;
    - "step" (the mHC paper's schedule): lr until 80% of the steps, lr * step_decay until
      90%, lr * step_decay^2 after (0.316^2 ~ 0.1).
    Having no state of its own, the schedule is restored by restoring the step.
    """

    def __init__(self, cfg: TrainConfig):
        self.lr, self.min_lr, self.warmup = cfg.lr, cfg.min_lr, cfg.warmup
        self.steps, self.kind, self.decay = cfg.steps, cfg.schedule, cfg.step_decay

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.kind == "step":
            drops = sum(step >= frac * self.steps for frac in STEP_DECAY_AT)
            return self.lr * self.decay**drops
        span = max(1, self.steps - self.warmup)
        p = min(1.0, (step - self.warmup) / span)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))

    def state_dict(self) -> dict:
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup": self.warmup,
                "steps": self.steps, "kind": self.kind, "decay": self.decay}


class SpikeGuard:
    """Stops the run on a non-finite loss or gradient norm, or a loss spike.

    A spike is a loss above factor x the mean of the last `window` accepted losses (checked
    once at least one loss was accepted; factor 0 turns spike checks off).
    """

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def check_loss(self, step: int, loss: float) -> str | None:
        """None if the loss may be used, else the reason it may not."""
        if not math.isfinite(loss):
            return f"the training loss is {loss} (not finite) at step {step}"
        if self.factor > 0 and self.recent:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.factor * mean:
                return (
                    f"loss spike at step {step}: loss {loss:.4f} > {self.factor:g} x the running "
                    f"mean {mean:.4f} of the last {len(self.recent)} steps"
                )
        return None

    @staticmethod
    def check_grad_norm(step: int, norm: float) -> str | None:
        if not math.isfinite(norm):
            return f"the gradient norm is {norm} (not finite) at step {step}"
        return None

    def accept(self, loss: float) -> None:
        self.recent.append(loss)

    def state_dict(self) -> dict:
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(float(v) for v in state["recent"])
