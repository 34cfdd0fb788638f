"""Which groups reach the update: StarPO-S variance filtering and DAPO's zero-variance rule.

A group whose G rewards are all equal has zero advantage everywhere: it costs a forward/backward
and teaches nothing (and, under token-mean, dilutes the informative groups). RAGEN (Wang et al.
2025) found that keeping only the groups with the most in-group reward variance (StarPO-S) delays
the "Echo Trap" collapse; DAPO (Yu et al. 2025) drops zero-variance groups and samples more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def select_groups(
    std_P: Sequence[float],
    mode: str = "none",
    top_p: float = 1.0,
    top_k_fraction: float = 1.0,
    drop_zero_std: bool = False,
    tol: float = 0.0,
) -> list[int]:
    """Indices of the groups to keep, in their original order.

    mode "std-top-p": sort groups by std, highest first, and keep the shortest prefix whose stds
    sum to at least top_p of the total (all groups when the total is 0). mode "std-top-k": keep the
    ceil(top_k_fraction * P) highest-std groups (ties keep the earlier group). Then, with
    drop_zero_std, groups with std <= tol are removed.

    `std_P` comes from rlvr.algorithms.group_reward_std, which is exactly 0 for a group whose rewards
    are all equal and > 0 otherwise; hence tol 0. A positive tol would also drop groups that have
    a (tiny) signal, and a float32 std with tol 1e-8 kept constant groups (0.7 x 8: std 6.4e-8).
    """
    n = len(std_P)
    ranked = sorted(range(n), key=lambda i: (-std_P[i], i))
    if mode == "none":
        keep = list(range(n))
    elif mode == "std-top-k":
        keep = ranked[: max(1, math.ceil(top_k_fraction * n))]
    elif mode == "std-top-p":
        total = sum(std_P)
        if total <= tol:
            keep = list(range(n))
        else:
            keep, mass = [], 0.0
            for i in ranked:
                keep.append(i)
                mass += std_P[i]
                # isclose: summing in rank order rounds (0.4 + 0.3 + 0.2 + 0.1 < 1.0 in floats).
                if mass >= top_p * total or math.isclose(mass, top_p * total, rel_tol=1e-9):
                    break
    else:
        raise ValueError(f"unknown group filter {mode!r}")
    if drop_zero_std:
        keep = [i for i in keep if std_P[i] > tol]
    return sorted(keep)
