"""Collation and trainer-side log-probs on the tiny random model (rlvr.train.batch)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.algorithms import AGGREGATIONS, aggregate, ppo_clip_loss
from rlvr.models import load_policy
from rlvr.records import Trajectory
from rlvr.train.batch import TrainBatch, collate, token_logprobs

PAD = 0  # tiny_tokenizer's <pad>


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    """The tiny random Llama (written once per session by conftest), loaded once per module."""
    policy = load_policy(str(tiny_model_dir))
    assert policy.tokenizer.pad_token_id == PAD
    return policy.model, policy.tokenizer


def make_traj(
    prompt: Sequence[int],
    completion: Sequence[int],
    policy_mask: Sequence[int] | None = None,
    logprobs: Sequence[float] | None = None,
    task_id: str = "t",
) -> Trajectory:
    mask = tuple(policy_mask) if policy_mask is not None else (1,) * len(completion)
    lps = tuple(logprobs) if logprobs is not None else tuple(-0.5 * m for m in mask)
    return Trajectory(
        task_id=task_id,
        token_ids=tuple(prompt) + tuple(completion),
        policy_mask=(0,) * len(prompt) + mask,
        logprobs=(0.0,) * len(prompt) + lps,
        prompt_length=len(prompt),
        completion_text="",
        finish_reason="length",
    )


def random_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, 128, (n,), generator=gen).tolist()  # no special tokens


def completion_len(t: Trajectory) -> int:
    return len(t.token_ids) - t.prompt_length


def collate_with(trajs: Sequence[Trajectory], advantages: Sequence[float]) -> TrainBatch:
    token_adv = [[a] * completion_len(t) for t, a in zip(trajs, advantages, strict=True)]
    return collate(trajs, token_adv, PAD)


@pytest.fixture(scope="module")
def two_by_four() -> list[Trajectory]:
    """2 prompts (5 and 9 tokens) x 4 completions of lengths 3, 7, 1, 5; rows interleaved."""
    gen = torch.Generator().manual_seed(0)
    prompts = [random_ids(gen, 5), random_ids(gen, 9)]
    rows = []
    for n in (3, 7, 1, 5):
        for p in prompts:  # A, B, A, B, ...: row_prompt_B is not sorted
            rows.append(make_traj(p, random_ids(gen, n)))
    return rows


def hand_logprobs(model: Any, traj: Trajectory, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of each completion token from one plain forward over the unpadded sequence."""
    with torch.no_grad():
        logits_T_V = model(input_ids=torch.tensor([traj.token_ids])).logits[0].float()
    logprobs_T_V = torch.log_softmax(logits_T_V / temperature, dim=-1)
    # position t - 1 predicts token t
    return torch.stack(
        [
            logprobs_T_V[t - 1, traj.token_ids[t]]
            for t in range(traj.prompt_length, len(traj.token_ids))
        ]
    )


# --------------------------------------------------------------------------------------- collate
def test_collate_layout() -> None:
    prompt_a, prompt_b = [10, 11, 12], [20, 21, 22, 23, 24]
    trajs = [
        make_traj(prompt_a, [30, 31, 32, 33], logprobs=[-0.1, -0.2, -0.3, -0.4]),
        make_traj(prompt_b, [40, 41], logprobs=[-1.0, -2.0]),
        # policy, policy, observation, observation, policy, policy
        make_traj(
            prompt_a,
            [50, 51, 52, 53, 54, 55],
            policy_mask=[1, 1, 0, 0, 1, 1],
            logprobs=[-0.5, -0.6, 0.0, 0.0, -0.7, -0.8],
        ),
    ]
    batch = collate(trajs, [[2.0] * 4, [-1.0] * 2, [0.5] * 6], PAD)

    # Two distinct prompts, the first one shared by rows 0 and 2; left-padded to 5 columns.
    assert batch.prompt_ids_P_Lp.tolist() == [[PAD, PAD, 10, 11, 12], [20, 21, 22, 23, 24]]
    assert batch.prompt_mask_P_Lp.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch.row_prompt_B.tolist() == [0, 1, 0]
    # Completions right-padded to the longest (6).
    assert batch.completion_width == 6
    assert batch.completion_ids_B_C.tolist() == [
        [30, 31, 32, 33, PAD, PAD],
        [40, 41, PAD, PAD, PAD, PAD],
        [50, 51, 52, 53, 54, 55],
    ]
    assert batch.completion_mask_B_C.tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1],
    ]
    # mask_B_C comes from policy_mask: the observation (52, 53) is 0 in the middle of row 2.
    assert batch.mask_B_C.tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1],
    ]
    torch.testing.assert_close(
        batch.behaviour_logprobs_B_C,
        torch.tensor(
            [
                [-0.1, -0.2, -0.3, -0.4, 0.0, 0.0],
                [-1.0, -2.0, 0.0, 0.0, 0.0, 0.0],
                [-0.5, -0.6, 0.0, 0.0, -0.7, -0.8],
            ]
        ),
    )
    # Advantages are zero outside the mask (padding and the observation).
    assert batch.advantages_B_C.tolist() == [
        [2.0, 2.0, 2.0, 2.0, 0.0, 0.0],
        [-1.0, -1.0, 0.0, 0.0, 0.0, 0.0],
        [0.5, 0.5, 0.0, 0.0, 0.5, 0.5],
    ]
    assert batch.mask_B_C.dtype == torch.float32


def test_collate_single_prompt_no_padding() -> None:
    trajs = [make_traj([5, 6], [7, 8]), make_traj([5, 6], [9, 10])]
    batch = collate_with(trajs, [1.0, -1.0])
    assert batch.prompt_ids_P_Lp.tolist() == [[5, 6]]
    assert batch.row_prompt_B.tolist() == [0, 0]
    assert batch.completion_mask_B_C.tolist() == [[1, 1], [1, 1]]


# --------------------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("head", ["fused", "one_call", "model_runs_it"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_equals_plain_path(
    tiny: tuple[Any, Any],
    two_by_four: list[Trajectory],
    temperature: float,
    head: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three ways to the logits: the fused head (hidden states, no lm_head call); a plain linear head
    that the shared path runs once over all C positions; a head it cannot call itself (soft-capping,
    a LoRA'd head: faked here), left inside the model's own forward, in two calls. Each equals the
    plain path."""
    import rlvr.train.batch as batch_module

    model, _ = tiny
    if head == "model_runs_it":
        monkeypatch.setattr(batch_module, "plain_head", lambda _model: None)
    head_calls: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _module, _args, out: head_calls.append(out.shape[1])
    )
    batch = collate_with(two_by_four, [1.0] * len(two_by_four))
    assert batch.prompt_ids_P_Lp.shape[0] == 2 and batch.row_prompt_B.tolist() == [0, 1] * 4
    valid = batch.completion_mask_B_C.bool()
    weights = torch.randn(
        batch.completion_ids_B_C.shape, generator=torch.Generator().manual_seed(3)
    )

    results = {}
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs(
            model, batch, temperature, with_entropy=True, share_prefix=share, fused=head == "fused"
        )
        assert entropy is not None
        assert logp.shape == entropy.shape == batch.completion_ids_B_C.shape
        (logp * weights * batch.completion_mask_B_C).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results[share] = (logp.detach(), entropy, grads)
    model.zero_grad(set_to_none=True)
    hook.remove()
    width = batch.completion_width
    # Shared, then plain (the plain path's one call covers C + 1 positions and drops the last).
    expected = {
        "fused": [],
        "one_call": [width, width + 1],
        "model_runs_it": [1, width - 1, width + 1],
    }
    assert head_calls == expected[head]

    (lp_s, ent_s, g_s), (lp_p, ent_p, g_p) = results[True], results[False]
    torch.testing.assert_close(lp_s[valid], lp_p[valid], rtol=0.0, atol=1e-5)
    torch.testing.assert_close(ent_s[valid], ent_p[valid], rtol=0.0, atol=1e-5)
    # Gradients agree to a relative error of 1e-4 (norm of the difference over the norm).
    for name, grad in g_p.items():
        rel = (g_s[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"
    # Every shared-prompt parameter got gradient (the prompt pass is differentiable).
    assert g_s["model.embed_tokens.weight"].norm() > 0


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_a_plain_forward_of_each_trajectory(
    tiny: tuple[Any, Any], two_by_four: list[Trajectory], share_prefix: bool, temperature: float
) -> None:
    model, _ = tiny
    batch = collate_with(two_by_four, [1.0] * len(two_by_four))
    with torch.no_grad():
        logp, entropy = token_logprobs(model, batch, temperature, share_prefix=share_prefix)
    assert entropy is None
    for i, traj in enumerate(two_by_four):
        n = completion_len(traj)
        torch.testing.assert_close(
            logp[i, :n], hand_logprobs(model, traj, temperature), rtol=0.0, atol=1e-5
        )


# --------------------------------------------------------------------------------------- masking
@pytest.fixture(scope="module")
def with_observation() -> list[Trajectory]:
    """One multi-turn trajectory (policy, observation, policy) and one plain one, same prompt."""
    gen = torch.Generator().manual_seed(7)
    prompt = random_ids(gen, 6)
    mask = [1, 1, 1, 0, 0, 0, 0, 1, 1]
    return [
        make_traj(prompt, random_ids(gen, len(mask)), policy_mask=mask),
        make_traj(prompt, random_ids(gen, 4)),
    ]


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_tokens_outside_policy_mask_get_zero_gradient(
    tiny: tuple[Any, Any], with_observation: list[Trajectory], mode: str
) -> None:
    model, _ = tiny
    batch = collate_with(with_observation, [1.5, -0.5])
    mask = batch.mask_B_C
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 0]]

    logp, _ = token_logprobs(model, batch)
    logp.retain_grad()
    out = ppo_clip_loss(logp, logp.detach(), batch.advantages_B_C)
    loss = aggregate(out.loss_B_T, mask, mode)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert logp.grad is not None
    assert (logp.grad[mask == 0] == 0.0).all()  # exactly zero: observations and padding
    assert (logp.grad[mask == 1] != 0.0).all()
    if mode == "token-mean":
        # on-policy ratio 1: d loss / d logp = -A / (number of policy tokens = 9)
        expected = -batch.advantages_B_C / 9.0
        torch.testing.assert_close(logp.grad[mask == 1], expected[mask == 1])
    param_grads = [p.grad.clone() for p in model.parameters()]

    # Garbage advantages where the mask is 0 change neither the loss nor any parameter gradient.
    noisy_adv = batch.advantages_B_C + (1 - mask) * 100.0
    logp2, _ = token_logprobs(model, batch)
    out2 = ppo_clip_loss(logp2, logp2.detach(), noisy_adv)
    loss2 = aggregate(out2.loss_B_T, mask, mode)
    assert torch.equal(loss2, loss)
    model.zero_grad(set_to_none=True)
    loss2.backward()
    for before, p in zip(param_grads, model.parameters(), strict=True):
        assert torch.equal(p.grad, before)
    model.zero_grad(set_to_none=True)


def test_gradient_checkpointing_falls_back_to_the_plain_path(tiny_model_dir: Path) -> None:
    """HF drops the KV cache under gradient checkpointing; the shared-prefix path must not be used then."""
    policy = load_policy(str(tiny_model_dir), gradient_checkpointing=True)
    policy.model.train()
    prompt, completion = tuple(range(10, 30)), tuple(range(40, 50))
    traj = Trajectory("a", prompt + completion, (0,) * 20 + (1,) * 10, (0.0,) * 30, 20, "", "stop")
    batch = collate([traj, traj], [[1.0] * 10] * 2, PAD)
    shared, _ = token_logprobs(policy.model, batch, 1.0, share_prefix=True)
    plain, _ = token_logprobs(policy.model, batch, 1.0, share_prefix=False)
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
