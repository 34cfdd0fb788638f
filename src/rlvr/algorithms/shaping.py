"""Reward shaping that depends on the rollout, not on the answer: pure tensor functions."""

from __future__ import annotations

import torch


def soft_overlong_penalty(
    lengths_B: torch.Tensor,
    max_length: torch.Tensor | float,
    buffer: torch.Tensor | float,
    penalty: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward. (B,) -> (B,).

        R_len(y) = 0                                   if |y| <= L_max - L_cache
                 = -penalty * (|y| - (L_max - L_cache)) / L_cache    if inside the buffer
                 = -penalty                            if |y| >= L_max (cut off)

    A hard penalty on truncation punishes sound reasoning that merely ran long; ramping it over the
    last `buffer` tokens tells the policy *how* long is too long. `max_length` and `buffer` may be
    per-row tensors (multi-turn rows have their own limit).
    """
    limit = torch.as_tensor(max_length, dtype=torch.float32, device=lengths_B.device)
    cache = torch.as_tensor(buffer, dtype=torch.float32, device=lengths_B.device).clamp(min=1.0)
    over = (lengths_B.float() - (limit - cache)).clamp(min=0.0)
    return -penalty * torch.clamp(over / cache, max=1.0)
