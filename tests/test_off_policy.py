"""Off-policy corrections (rlvr.algorithms.off_policy), each worked by hand on two rows.

The inputs are log-probs with behaviour = 0, so each token's ratio rho = exp(old - behaviour) is
exp(old): old = log(rho) below. Row 0 has three policy tokens with ratios 1.5, 0.5, 4; row 1 two,
with ratios 1.0 and 1.5, and a masked third position holding a wild value (old = 30, rho = 1e13)
that no output may see.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from rlvr.algorithms import aggregate, gspo_loss, truncated_importance_weights
from rlvr.algorithms.off_policy import (
    build_correction,
    geo_mask,
    icepop,
    mis_sequence,
    mis_token,
    resolve_correction,
    sequence_ratio_loss,
    tis_geometric,
    tis_sequence,
    tis_token,
)
from rlvr.config import RunConfig, load_config
from rlvr.observe.tracking import read_metrics
from rlvr.registry import ALGORITHMS
from rlvr.train.loop import train

OLD = torch.tensor([[math.log(1.5), math.log(0.5), math.log(4.0)], [0.0, math.log(1.5), 30.0]])
BEHAVIOUR = torch.zeros(2, 3)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-5), actual


def test_tis_token_truncates_each_ratio_at_the_cap() -> None:
    out = tis_token(OLD, BEHAVIOUR, MASK, cap=2.0)
    # min(1.5, 2) = 1.5, min(0.5, 2) = 0.5, min(4, 2) = 2 (clipped); row 1: 1.0, 1.5, masked 0.
    close(out.weights_B_T, [[1.5, 0.5, 2.0], [1.0, 1.5, 0.0]])
    close(out.clipped_B_T, [[0, 0, 1], [0, 0, 0]])
    close(out.masked_B_T, [[0, 0, 0], [0, 0, 0]])


def test_tis_token_is_the_update_s_old_truncated_is_bit_for_bit() -> None:
    """The default (a config naming no correction, tis_cap set) trains exactly as before."""
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(4, 7, generator=gen)
    behaviour = torch.randn(4, 7, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) > 0.3).float()
    on = mask != 0
    # As train/update.py called it: inputs zeroed outside the mask first.
    before = truncated_importance_weights(
        torch.where(on, old, 0.0), torch.where(on, behaviour, 0.0), 2.0
    )
    now = tis_token(torch.where(on, old, 0.0), torch.where(on, behaviour, 0.0), mask, cap=2.0)
    assert torch.equal(now.weights_B_T[on], before[on])
    assert torch.equal(now.clipped_B_T[on], (before >= 2.0).float()[on])
    assert resolve_correction(None, 2.0) == "tis_token" and resolve_correction(None, None) == "none"


def test_tis_sequence_truncates_the_product_of_ratios() -> None:
    out = tis_sequence(OLD, BEHAVIOUR, MASK, cap=2.0)
    # Row 0: 1.5 * 0.5 * 4 = 3 -> min(3, 2) = 2 on every token (clipped); row 1: 1.0 * 1.5 = 1.5
    # (the masked position's 1e13 is not in the product).
    close(out.weights_B_T, [[2.0, 2.0, 2.0], [1.5, 1.5, 0.0]])
    close(out.clipped_B_T, [[1, 1, 1], [0, 0, 0]])


def test_mis_token_drops_tokens_above_the_cap_and_keeps_the_ratio_elsewhere() -> None:
    out = mis_token(OLD, BEHAVIOUR, MASK, cap=2.0)
    # 4 > 2: weight 0 (masked) instead of 2; the others keep their ratio.
    close(out.weights_B_T, [[1.5, 0.5, 0.0], [1.0, 1.5, 0.0]])
    close(out.masked_B_T, [[0, 0, 1], [0, 0, 0]])


def test_mis_sequence_drops_whole_sequences_whose_product_is_above_the_cap() -> None:
    out = mis_sequence(OLD, BEHAVIOUR, MASK, cap=2.0)
    # Row 0: product 3 > 2 -> all three tokens 0; row 1: product 1.5 <= 2 -> 1.5 per token.
    close(out.weights_B_T, [[0.0, 0.0, 0.0], [1.5, 1.5, 0.0]])
    close(out.masked_B_T, [[1, 1, 1], [0, 0, 0]])


def test_icepop_masks_both_tails_outside_the_bounds() -> None:
    out = icepop(OLD, BEHAVIOUR, MASK, bounds=(0.6, 3.0))
    # 1.5 in [0.6, 3] kept at 1.5; 0.5 < 0.6 and 4 > 3 masked; row 1: 1.0 and 1.5 kept.
    close(out.weights_B_T, [[1.5, 0.0, 0.0], [1.0, 1.5, 0.0]])
    close(out.masked_B_T, [[0, 1, 1], [0, 0, 0]])
    # IcePop's own bounds [0.5, 5] keep all of them (0.5 is on the boundary: kept).
    close(icepop(OLD, BEHAVIOUR, MASK).masked_B_T, [[0, 0, 0], [0, 0, 0]])


def test_geo_mask_drops_sequences_by_their_geometric_mean_ratio() -> None:
    out = geo_mask(OLD, BEHAVIOUR, MASK, bounds=(0.9, 1.3))
    # Row 0: 3^(1/3) = 1.442 > 1.3 -> masked; row 1: 1.5^(1/2) = 1.2247 in [0.9, 1.3] -> weight 1.
    close(out.weights_B_T, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    close(out.masked_B_T, [[1, 1, 1], [0, 0, 0]])


def test_tis_geometric_weighs_each_sequence_on_gspo_s_scale() -> None:
    out = tis_geometric(OLD, BEHAVIOUR, MASK, cap=1.3)
    # Row 0: 3^(1/3) = 1.44225 -> min(., 1.3) = 1.3 (clipped); row 1: 1.5^(1/2) = 1.22474.
    close(out.weights_B_T, [[1.3, 1.3, 1.3], [1.22474, 1.22474, 0.0]])
    close(out.clipped_B_T, [[1, 1, 1], [0, 0, 0]])


def test_no_output_sees_a_masked_position_or_carries_a_gradient() -> None:
    old = OLD.clone().requires_grad_(True)
    for name in ("tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop", "geo_mask"):
        fn = build_correction(name, cap=2.0)
        assert fn is not None
        out = fn(old, BEHAVIOUR, MASK)
        assert not out.weights_B_T.requires_grad, name
        assert out.weights_B_T[1, 2] == 0 and torch.isfinite(out.weights_B_T).all(), name
    assert build_correction("none", cap=2.0) is None
    with pytest.raises(ValueError, match=r"needs objective\.tis_cap"):
        build_correction("mis_token", cap=None)


def test_gspo_with_truncated_is_weighs_per_sequence() -> None:
    """GSPO's gradient treats a sequence as one unit: with the default correction every token of a
    sequence gets the same coefficient, as with GSPO alone. Per-token TIS would give token 3 of
    row 0 (ratio 4, clipped to 2) four times the weight of token 2 (ratio 0.5)."""
    gspo = ALGORITHMS.resolve("gspo").loss
    assert sequence_ratio_loss(gspo) and not sequence_ratio_loss(ALGORITHMS.resolve("grpo").loss)
    correction = build_correction("tis_token", cap=2.0, sequence_ratio=True)
    assert correction is not None
    weights = correction(OLD, BEHAVIOUR, MASK).weights_B_T
    # geometric means 1.442 and 1.2247, both under the cap 2
    close(weights, [[1.44225, 1.44225, 1.44225], [1.22474, 1.22474, 0.0]])

    logp = torch.full((2, 3), -1.0, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    loss = gspo_loss(logp, logp.detach(), advantages, MASK).loss_B_T * weights
    aggregate(loss, MASK, "seq-mean-token-mean").backward()
    assert logp.grad is not None
    # d/dlogp_t of -w_i * s_i * A_i / |y_i| / B with s_i = 1 on-policy: row 0 -1.44225 / 3 / 2,
    # row 1 +1.22474 / 2 / 2; the same for every token of a row.
    close(logp.grad, [[-0.24037, -0.24037, -0.24037], [0.30619, 0.30619, 0.0]])


def test_config_defaults_and_checks() -> None:
    async_cfg = RunConfig.model_validate({"rollout": {"async_rollouts": True}})
    assert async_cfg.objective.tis_cap == 2.0 and async_cfg.objective.off_policy_correction is None
    # Naming a capped correction brings the cap; icepop and geo_mask need none.
    named = RunConfig.model_validate({"objective": {"off_policy_correction": "mis_sequence"}})
    assert named.objective.tis_cap == 2.0
    assert RunConfig.model_validate({"objective": {"off_policy_correction": "icepop"}})
    with pytest.raises(ValidationError, match="needs tis_cap"):
        RunConfig.model_validate(
            {"objective": {"off_policy_correction": "tis_token", "tis_cap": None}}
        )
    with pytest.raises(ValidationError, match="0 < lo < hi"):
        RunConfig.model_validate({"objective": {"off_policy_bounds": [2.0, 1.0]}})


def test_a_run_logs_staleness_and_the_masked_fraction(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The loop end to end: async at k = 2 with a masking correction logs the per-trajectory
    staleness (0, 1, 2, 2) and the share of tokens the correction dropped."""
    cfg = load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "rollout.async_rollouts=true",
            "rollout.max_staleness=2",
            "objective.off_policy_correction=mis_sequence",
            "model.bf16='off'",
            "train.steps=4",
            "sampling.max_new_tokens=6",
            "eval.at_start=false",
            "eval.at_end=false",
            "tracking.progress=false",
            "checkpoint.save_final=false",
        ],
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 2]
    assert rows[-1]["rollout/staleness_hist/2"] == 1.0
    masked = [r["rollout_corr/rollout_is_masked_fraction"] for r in rows]
    assert all(0.0 <= m <= 1.0 for m in masked) and masked[0] == 0.0  # round 1 is on-policy
