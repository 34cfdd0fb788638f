"""Off-policy corrections: how much each sampled token may count when another policy sampled it.

The tokens were sampled by a behaviour policy mu (a stale weight copy under async rollouts, a bf16
copy, a vLLM server) while the update's surrogate is written for pi_old, the trainer's own
(detached) policy. Each correction turns the per-token ratio

    rho_t = pi_old(y_t | y_<t) / mu(y_t | y_<t) = exp(logp_old_t - logp_behaviour_t)

into a per-token weight w_t (detached) that multiplies the token's policy loss; a weight of 0 masks
the token (it adds no gradient; the loss normaliser still counts it, as TRL's mask modes do).
`objective.off_policy_correction` picks one:

    name          weight per token                                  from
    tis_token     min(rho_t, C)                                     Yao et al. 2025 (TIS)
    tis_sequence  min(prod_t rho_t, C), the same for every token     verl rollout_is: sequence
    mis_token     rho_t if rho_t <= C else 0                        Yao et al. 2025 (MIS); TRL token_mask
    mis_sequence  prod_t rho_t if that <= C else 0                  TRL sequence_mask
    icepop        rho_t if lo <= rho_t <= hi else 0                 IcePop (Ling team 2025): M(k)
    geo_mask      1 if lo <= (prod_t rho_t)^(1/T) <= hi else 0      verl rollout_rs: geometric
    none          1

C is `objective.tis_cap` (2.0 by default, Yao et al.); [lo, hi] is `objective.off_policy_bounds`
(IcePop's paper uses [0.5, 5]; geometric masking needs a band near 1, verl suggests 1.0002-1.001
for numeric mismatch, wider for staleness). Products run over the sequence's policy tokens (mask 1);
a sequence's log-ratio sum is clamped to +-20 before the exp, as verl's safety bound does, so a
long, far-off sequence gives a finite weight.

GSPO's ratio is per sequence (its length-normalised geometric mean), so a per-token weight would
hand each token of one sequence its own correction inside a sequence-level objective: with a
sequence-ratio loss (`SEQUENCE_RATIO_LOSSES`) `tis_token` weighs each sequence by
min(geomean_t rho_t, C) instead (`tis_geometric`), the correction at the level GSPO clips.

Shapes: (B, T) in and out; `mask_B_T` is 1 on policy tokens. Inputs at masked positions must be
finite (callers zero them); outputs there are 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from rlvr.algorithms.losses import gspo_loss, truncated_importance_weights

LOG_RATIO_BOUND = 20.0  # exp(20) = 4.9e8: verl's safety bound on a (sequence) log-ratio
ICEPOP_BOUNDS = (0.5, 5.0)  # IcePop's [alpha, beta] (Ling team 2025, "Small leak can sink a ship")
GEO_MASK_BOUNDS = (0.999, 1.001)  # a geometric-mean ratio stays near 1 (verl: 1.0002-1.001)


@dataclass(frozen=True)
class OffPolicyWeights:
    """Per-token weights (B, T), detached, 0 outside the mask and where masked; `clipped_B_T` is 1
    where a weight was truncated at the cap, `masked_B_T` 1 where a policy token got weight 0."""

    weights_B_T: torch.Tensor
    clipped_B_T: torch.Tensor
    masked_B_T: torch.Tensor


def _log_ratio(
    old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, on_B_T: torch.Tensor
) -> torch.Tensor:
    return torch.where(on_B_T, old_B_T - behaviour_B_T, 0.0)


def _finish(
    weights_B_T: torch.Tensor, clipped_B_T: torch.Tensor, masked_B_T: torch.Tensor, on: torch.Tensor
) -> OffPolicyWeights:
    zero = torch.zeros_like(weights_B_T)
    return OffPolicyWeights(
        torch.where(on, weights_B_T, zero).detach(),
        torch.where(on, clipped_B_T.to(weights_B_T.dtype), zero),
        torch.where(on, masked_B_T.to(weights_B_T.dtype), zero),
    )


def _sequence_log_ratio(log_ratio_B_T: torch.Tensor, mean: bool, on: torch.Tensor) -> torch.Tensor:
    """(B, 1): the sum (or mean) of each row's log-ratios over its policy tokens, bounded."""
    total_B = log_ratio_B_T.sum(dim=1)
    if mean:
        total_B = total_B / on.sum(dim=1).clamp(min=1).to(total_B.dtype)
    return total_B.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)[:, None]


@torch.no_grad()
def tis_token(
    old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float
) -> OffPolicyWeights:
    """Truncated IS per token: w_t = min(rho_t, cap) (Yao et al. 2025), computed by
    `rlvr.algorithms.losses.truncated_importance_weights`, the update's correction before this menu."""
    on = mask_B_T != 0
    weights_B_T = truncated_importance_weights(
        torch.where(on, old_B_T, 0.0), torch.where(on, behaviour_B_T, 0.0), cap
    )
    return _finish(weights_B_T, weights_B_T >= cap, torch.zeros_like(on), on)


@torch.no_grad()
def tis_sequence(
    old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float
) -> OffPolicyWeights:
    """Truncated IS per sequence: every token of row i gets min(prod_t rho_t, cap)."""
    on = mask_B_T != 0
    seq_B1 = torch.exp(_sequence_log_ratio(_log_ratio(old_B_T, behaviour_B_T, on), False, on))
    weights_B_T = seq_B1.clamp(max=cap).expand_as(old_B_T)
    return _finish(weights_B_T, (seq_B1 >= cap).expand_as(on), torch.zeros_like(on), on)


@torch.no_grad()
def tis_geometric(
    old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float
) -> OffPolicyWeights:
    """Truncated IS per sequence on GSPO's scale: every token of row i gets
    min((prod_t rho_t)^(1/|y_i|), cap), the length-normalised ratio GSPO itself uses."""
    on = mask_B_T != 0
    seq_B1 = torch.exp(_sequence_log_ratio(_log_ratio(old_B_T, behaviour_B_T, on), True, on))
    weights_B_T = seq_B1.clamp(max=cap).expand_as(old_B_T)
    return _finish(weights_B_T, (seq_B1 >= cap).expand_as(on), torch.zeros_like(on), on)


@torch.no_grad()
def mis_token(
    old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float
) -> OffPolicyWeights:
    """Masked IS per token: w_t = rho_t where rho_t <= cap, else 0 (the token is dropped rather
    than kept at weight cap: Yao et al. 2025's MIS, TRL's token_mask)."""
    on = mask_B_T != 0
    ratio_B_T = torch.exp(_log_ratio(old_B_T, behaviour_B_T, on))
    over_B_T = ratio_B_T > cap
    return _finish(torch.where(over_B_T, 0.0, ratio_B_T), torch.zeros_like(on), over_B_T, on)


@torch.no_grad()
def mis_sequence(
    old_B_T: torch.Tensor, behaviour_B_T: torch.Tensor, mask_B_T: torch.Tensor, cap: float
) -> OffPolicyWeights:
    """Masked IS per sequence: row i's tokens get prod_t rho_t when it is <= cap, else all 0."""
    on = mask_B_T != 0
    seq_B1 = torch.exp(_sequence_log_ratio(_log_ratio(old_B_T, behaviour_B_T, on), False, on))
    over_B_T = (seq_B1 > cap).expand_as(on)
    weights_B_T = torch.where(over_B_T, 0.0, seq_B1.expand_as(old_B_T))
    return _finish(weights_B_T, torch.zeros_like(on), over_B_T, on)


@torch.no_grad()
def icepop(
    old_B_T: torch.Tensor,
    behaviour_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    bounds: tuple[float, float] = ICEPOP_BOUNDS,
) -> OffPolicyWeights:
    """IcePop: w_t = rho_t inside [lo, hi], 0 outside (both tails masked, the kept ones calibrated
    by their ratio: the paper's M(k) = k on [alpha, beta], 0 elsewhere)."""
    lo, hi = bounds
    on = mask_B_T != 0
    ratio_B_T = torch.exp(_log_ratio(old_B_T, behaviour_B_T, on))
    out_B_T = (ratio_B_T < lo) | (ratio_B_T > hi)
    return _finish(torch.where(out_B_T, 0.0, ratio_B_T), torch.zeros_like(on), out_B_T, on)


@torch.no_grad()
def geo_mask(
    old_B_T: torch.Tensor,
    behaviour_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    bounds: tuple[float, float] = GEO_MASK_BOUNDS,
) -> OffPolicyWeights:
    """Geometric sequence masking: row i is dropped (every token 0) when its geometric-mean ratio
    (prod_t rho_t)^(1/|y_i|) leaves [lo, hi]; kept rows weigh 1 (rejection only, no IS weight: verl's
    rollout_rs geometric). Length-normalised, so a long sequence is not masked for its length."""
    lo, hi = bounds
    on = mask_B_T != 0
    geo_B1 = torch.exp(_sequence_log_ratio(_log_ratio(old_B_T, behaviour_B_T, on), True, on))
    out_B_T = ((geo_B1 < lo) | (geo_B1 > hi)).expand_as(on)
    weights_B_T = torch.where(out_B_T, 0.0, torch.ones_like(old_B_T))
    return _finish(weights_B_T, torch.zeros_like(on), out_B_T, on)


Correction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], OffPolicyWeights]
CORRECTIONS = ("tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop", "geo_mask")


def resolve_correction(name: str | None, tis_cap: float | None) -> str:
    """The correction a config asks for: `name`, or when unset `tis_token` exactly when a cap is set
    (`objective.tis_cap`, on by default whenever another engine, older weights or a bf16 copy
    sample), else none. So a config that never names a correction trains as before this menu."""
    if name is not None:
        return name
    return "tis_token" if tis_cap is not None else "none"


def build_correction(
    name: str,
    *,
    cap: float | None,
    bounds: tuple[float, float] | None = None,
    sequence_ratio: bool = False,
) -> Correction | None:
    """The weight function for `name` (None for "none"), its cap / bounds bound in.

    `sequence_ratio`: the policy loss has one ratio per sequence (GSPO): tis_token then weighs per
    sequence on the loss's own (geometric-mean) scale, `tis_geometric`."""
    if name == "none":
        return None
    if name in ("tis_token", "tis_sequence", "mis_token", "mis_sequence"):
        if cap is None:
            raise ValueError(f"objective.off_policy_correction {name} needs objective.tis_cap")
        if name == "tis_token" and sequence_ratio:
            return partial(tis_geometric, cap=cap)
        by_name = {
            "tis_token": tis_token,
            "tis_sequence": tis_sequence,
            "mis_token": mis_token,
            "mis_sequence": mis_sequence,
        }
        return partial(by_name[name], cap=cap)
    if name == "icepop":
        return partial(icepop, bounds=bounds or ICEPOP_BOUNDS)
    if name == "geo_mask":
        return partial(geo_mask, bounds=bounds or GEO_MASK_BOUNDS)
    raise ValueError(f"unknown off-policy correction {name!r}; one of {', '.join(CORRECTIONS)}")


# Policy losses whose importance ratio is one number per sequence: a correction meant per token
# is applied per sequence for them (see the module docstring). A custom sequence-ratio loss joins
# with `SEQUENCE_RATIO_LOSSES.add(my_loss)`.
SEQUENCE_RATIO_LOSSES: set[Callable[..., Any]] = {gspo_loss}


def sequence_ratio_loss(loss_fn: Callable[..., Any]) -> bool:
    return loss_fn in SEQUENCE_RATIO_LOSSES
