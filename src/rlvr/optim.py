"""The one optimizer every trainer here uses: AdamW, fused where torch has the kernel.

torch's default AdamW (`foreach`) builds temporaries the size of all the parameters on each step
(for SmolLM2-135M full fine-tuning, ~0.5 GB on top of the weights, gradients and moments) and makes
several passes over them; the fused kernel updates each tensor in one pass with none. Measured here
(135M fp32 parameters, 2 CPU cores): 0.73 s -> 0.15 s per step. Same update rule; tests check the
two agree to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> torch.optim.AdamW:
    params = list(params)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None
    )
