"""Stopping a diverged run instead of training (and saving) NaNs.

fp16's loss scaler skips steps whose gradients overflow and halves the scale, which fixes overflow but nothing
else; in fp32 and bf16 nothing skipped at all. Here every step whose loss or gradient norm is NaN/inf is skipped
(never applied), and `max_nonfinite_steps` of them in a row end the run with an error. fp16 overflows count only
once the scale is down to 1, where halving it again cannot help (DeepSpeed stops at its min_loss_scale of 1
too). The loss and norm come from the step's one all-reduce, so every rank decides the same.
"""

from __future__ import annotations

import math

from ..errors import UserError


class NonFiniteGuard:
    def __init__(self, limit: int, lr: float):
        self.limit = limit
        self.lr = lr
        self.bad_steps: list[int] = []  # the current run of consecutive bad steps

    def skip(self, step: int, loss: float, grad_norm: float, loss_scale: float | None) -> bool:
        """Whether `step` must not be applied; raises UserError at the `limit`-th bad step in a row.
        `loss_scale`: the fp16 scale this step used, None without dynamic loss scaling."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.bad_steps = []
            return False
        scaler_handles_it = loss_scale is not None and loss_scale > 1 and math.isfinite(loss)
        if scaler_handles_it:
            return True
        self.bad_steps.append(step)
        if len(self.bad_steps) >= self.limit:
            first = self.bad_steps[0]
            raise UserError(
                f"training diverged: loss {loss:.4g}, grad_norm {grad_norm:.4g} at step {step}, non-finite for "
                f"{self.limit} steps in a row (steps {first}-{step}; max_nonfinite_steps={self.limit}); stopped, and "
                f"no checkpoint or export holds NaN/inf weights. Lower lr (now {self.lr:g}) or check the data"
            )
        return True
