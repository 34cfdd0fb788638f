"""The offline objectives on inputs small enough to work out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr.algorithms.preference import (
    bradley_terry_loss,
    dpo_loss,
    sequence_logps,
    sft_loss,
    target_logprobs,
)


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


# Two pairs. Log-ratios (policy - reference): chosen [1, 0], rejected [-1, 1]; so h = [2, -1].
POLICY_CHOSEN = torch.tensor([-1.0, -2.0])
POLICY_REJECTED = torch.tensor([-3.0, -1.0])
REF_CHOSEN = torch.tensor([-2.0, -2.0])
REF_REJECTED = torch.tensor([-2.0, -2.0])


def test_dpo_sigmoid_by_hand() -> None:
    loss, chosen_rewards, rejected_rewards = dpo_loss(
        POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5
    )
    # beta * h = [1, -0.5]; -log sigmoid(x) = log(1 + e^-x): (log(1 + e^-1) + log(1 + e^0.5)) / 2
    expected = (softplus(-1.0) + softplus(0.5)) / 2  # = (0.31326 + 0.97408) / 2 = 0.64367
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    # rewards = beta * log-ratio: chosen 0.5 * [1, 0], rejected 0.5 * [-1, 1]
    assert chosen_rewards.tolist() == pytest.approx([0.5, 0.0])
    assert rejected_rewards.tolist() == pytest.approx([-0.5, 0.5])
    assert not chosen_rewards.requires_grad


def test_dpo_label_smoothing_by_hand() -> None:
    loss, _, _ = dpo_loss(
        POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, label_smoothing=0.1
    )
    # per pair: 0.9 * log(1 + e^-x) + 0.1 * log(1 + e^x), x = beta * h = [1, -0.5]
    per_pair = [0.9 * softplus(-x) + 0.1 * softplus(x) for x in (1.0, -0.5)]
    assert float(loss) == pytest.approx(sum(per_pair) / 2, abs=1e-6)


def test_dpo_ipo_by_hand() -> None:
    loss, _, _ = dpo_loss(
        POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss_type="ipo"
    )
    # (h - 1/(2 beta))^2 = (2 - 1)^2 = 1 and (-1 - 1)^2 = 4; mean 2.5
    assert float(loss) == pytest.approx(2.5)


def test_dpo_hinge_by_hand() -> None:
    loss, _, _ = dpo_loss(
        POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss_type="hinge"
    )
    # relu(1 - beta h) = relu(1 - 1) = 0 and relu(1 + 0.5) = 1.5; mean 0.75
    assert float(loss) == pytest.approx(0.75)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_gradient_raises_chosen_lowers_rejected(loss_type: str) -> None:
    # Policy equal to the reference: every loss wants the chosen log-prob up, the rejected down.
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    loss, _, _ = dpo_loss(
        chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), 0.1, loss_type
    )  # type: ignore[arg-type]
    loss.backward()
    assert chosen.grad is not None and rejected.grad is not None
    assert float(chosen.grad) < 0 < float(rejected.grad)


def test_dpo_rejects_bad_arguments() -> None:
    args = (POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, 0.1)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*args, loss_type="kto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, loss_type="ipo", label_smoothing=0.1)


def test_bradley_terry_by_hand() -> None:
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # differences [1, -1]: (log(1 + e^-1) + log(1 + e^1)) / 2 = (0.31326 + 1.31326) / 2 = 0.81326
    assert float(bradley_terry_loss(chosen, rejected)) == pytest.approx(
        (softplus(-1.0) + softplus(1.0)) / 2, abs=1e-6
    )
    # a margin of 0.5 on the first pair: differences [0.5, -1]
    with_margin = bradley_terry_loss(chosen, rejected, torch.tensor([0.5, 0.0]))
    assert float(with_margin) == pytest.approx((softplus(-0.5) + softplus(1.0)) / 2, abs=1e-6)


def test_sft_loss_masks_and_normalises() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # trained tokens -2, -3, -4: NLL sum 9 over 3 tokens = 3; over a step of 6 tokens = 1.5
    assert sft_loss(logprobs, mask).item() == pytest.approx(3.0)
    assert sft_loss(logprobs, mask, num_tokens=6).item() == pytest.approx(1.5)
    sft_loss(logprobs, mask).backward()
    assert logprobs.grad is not None
    # d/dlogp = -1/3 on trained tokens, exactly 0 elsewhere
    assert torch.equal(logprobs.grad, -mask / 3)


def test_sequence_logps_sum_and_mean() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert sequence_logps(logprobs, mask).tolist() == [-5.0]
    assert sequence_logps(logprobs, mask, average=True).tolist() == [-2.5]


def test_target_logprobs_by_hand() -> None:
    # logits [0, ln 3]: softmax [1/4, 3/4]; target 1 -> log(3/4), target 0 -> log(1/4)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    found = target_logprobs(logits, torch.tensor([[1, 0]]))
    assert found.tolist()[0] == pytest.approx([math.log(0.75), math.log(0.25)])
