"""The PPO critic on the tiny random model (rlvr.train.critic): alignment of values with tokens,
padding invariance, micro-batch accumulation, fitting fixed returns, checkpoints and LoRA."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.algorithms.gae import gae_advantages, token_level_rewards
from rlvr.models import LoraSettings
from rlvr.records import Trajectory
from rlvr.train.batch import TrainBatch, collate
from rlvr.train.critic import ValueModel, build_critic, critic_update, load_critic

PAD = 0  # tiny_tokenizer's <pad>


def make_traj(
    prompt: Sequence[int], completion: Sequence[int], policy_mask: Sequence[int] | None = None
) -> Trajectory:
    mask = tuple(policy_mask) if policy_mask is not None else (1,) * len(completion)
    return Trajectory(
        task_id="t",
        token_ids=tuple(prompt) + tuple(completion),
        policy_mask=(0,) * len(prompt) + mask,
        logprobs=(0.0,) * (len(prompt) + len(mask)),
        prompt_length=len(prompt),
        completion_text="",
        finish_reason="stop",
    )


def batch_of(trajs: Sequence[Trajectory]) -> TrainBatch:
    return collate(trajs, [[0.0] * (len(t.token_ids) - t.prompt_length) for t in trajs], PAD)


def random_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, 128, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def rows() -> list[Trajectory]:
    """2 prompts (5 and 9 tokens) x completions of 3, 7, 1, 6 tokens; the last has an observation."""
    gen = torch.Generator().manual_seed(0)
    prompts = [random_ids(gen, 5), random_ids(gen, 9)]
    out = []
    for i, n in enumerate((3, 7, 1, 6)):
        p = prompts[i % 2]
        mask = [1, 1, 0, 0, 1, 1] if n == 6 else None
        out.append(make_traj(p, random_ids(gen, n), mask))
    return out


def randomise_head(critic: ValueModel, seed: int = 0) -> None:
    # The head starts at zero (V = 0 everywhere), which would make alignment tests vacuous.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = torch.randn(critic.head.weight.shape, generator=gen) / critic.head.in_features**0.5
        critic.head.weight.copy_(weight)
        critic.head.bias.fill_(0.3)


def fixed_returns(batch: TrainBatch) -> torch.Tensor:
    """Monte-Carlo returns (gamma 0.9) of an outcome 1 / 0 / 1 / 0 ... on the last policy token."""
    outcome_B = torch.tensor([float(i % 2 == 0) for i in range(batch.mask_B_C.shape[0])])
    rewards_B_C = token_level_rewards(batch.mask_B_C, outcome_B)
    _, returns_B_C = gae_advantages(
        rewards_B_C, torch.zeros_like(rewards_B_C), batch.mask_B_C, 0.9, 1.0
    )
    return returns_B_C


def test_head_starts_at_zero_and_backbone_is_the_causal_lm_body(tiny_model_dir: Path) -> None:
    critic = build_critic(str(tiny_model_dir))
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    body = lm.model.state_dict()
    mine = critic.backbone.state_dict()
    assert set(mine) == set(body) and all(torch.equal(mine[k], body[k]) for k in body)
    assert not critic.head.weight.any() and not critic.head.bias.any()
    assert all(p.requires_grad for p in critic.parameters())


def test_values_shape_and_alignment(tiny_model_dir: Path, rows: list[Trajectory]) -> None:
    critic = build_critic(str(tiny_model_dir))
    randomise_head(critic)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    critic.eval()
    batch = batch_of(rows)
    with torch.no_grad():
        values = critic.values(batch)
    assert values.shape == batch.completion_ids_B_C.shape and values.dtype == torch.float32
    for i, traj in enumerate(rows):
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            hidden_T_H = lm.model(input_ids=ids).last_hidden_state[0]
            # the hidden state we read is the one the lm_head turns into next-token logits
            torch.testing.assert_close(lm.lm_head(hidden_T_H), lm(input_ids=ids).logits[0])
            # V(t) = head(hidden at position prompt_length - 1 + t): the state before token t
            p, n = traj.prompt_length, len(traj.token_ids) - traj.prompt_length
            expected = critic.head(hidden_T_H[p - 1 : p - 1 + n]).squeeze(-1)
        torch.testing.assert_close(values[i, :n], expected, rtol=0.0, atol=1e-5)


def test_values_do_not_depend_on_padding(tiny_model_dir: Path, rows: list[Trajectory]) -> None:
    critic = build_critic(str(tiny_model_dir))
    randomise_head(critic)
    critic.eval()
    with torch.no_grad():
        together = critic.values(batch_of(rows))
        for i, traj in enumerate(rows):
            alone = critic.values(batch_of([traj]))
            n = alone.shape[1]
            torch.testing.assert_close(together[i, :n], alone[0], rtol=0.0, atol=1e-5)


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batches_accumulate_to_the_full_batch(
    tiny_model_dir: Path, rows: list[Trajectory], aggregation: str
) -> None:
    critic = build_critic(str(tiny_model_dir))
    randomise_head(critic)
    gen = torch.Generator().manual_seed(2)

    def targets(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            values = critic.values(batch)
        # old values within +-0.3 of the current ones, clip 0.1: some tokens clip, some do not
        old = values + 0.3 * (2 * torch.rand(values.shape, generator=gen) - 1)
        return fixed_returns(batch), old

    full = batch_of(rows)
    r_full, old_full = targets(full)
    halves = [batch_of(rows[:2]), batch_of(rows[2:])]
    # the same targets, cut to each micro-batch's width
    r_half = [r_full[:2, : halves[0].completion_width], r_full[2:, : halves[1].completion_width]]
    o_half = [
        old_full[:2, : halves[0].completion_width],
        old_full[2:, : halves[1].completion_width],
    ]
    total = float(full.mask_B_C.sum())
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.0)  # grads stay, weights do not move

    def run(batches: list[TrainBatch], r: list[torch.Tensor], o: list[torch.Tensor]) -> dict:
        metrics = critic_update(
            critic,
            optimizer,
            batches,
            r,
            o,
            clip_range=0.1,
            aggregation=aggregation,
            total_tokens=total,
            max_grad_norm=1e9,
        )
        grads = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
        return {"metrics": metrics, "grads": grads}

    one = run([full], [r_full], [old_full])
    two = run(halves, r_half, o_half)
    assert one["metrics"]["critic/vf_clipfrac"] > 0
    for key, value in one["metrics"].items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert one["grads"]["backbone.embed_tokens.weight"].norm() > 0
    for name, grad in one["grads"].items():
        # float32 sums in another order: relative error of the gradient, as in test_batch
        rel = (two["grads"][name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert rel < 1e-5, f"{name}: relative gradient difference {rel:.2e}"


@pytest.mark.slow
def test_critic_fits_fixed_returns(tiny_model_dir: Path, rows: list[Trajectory]) -> None:
    torch.manual_seed(0)
    critic = build_critic(str(tiny_model_dir))
    optimizer = torch.optim.AdamW(critic.trainable_parameters(), lr=3e-3, weight_decay=0.0)
    batch = batch_of(rows)
    returns = fixed_returns(batch)
    total = float(batch.mask_B_C.sum())
    history = []
    for _ in range(50):
        with torch.no_grad():
            old = critic.values(batch)
        history.append(
            critic_update(
                critic,
                optimizer,
                [batch],
                [returns],
                [old],
                clip_range=None,
                aggregation="token-mean",
                total_tokens=total,
                max_grad_norm=1.0,
            )
        )
    first, last = history[0], history[-1]
    assert first["critic/values_mean"] == 0.0  # zero head
    assert last["critic/value_loss"] < 0.1 * first["critic/value_loss"]
    assert last["critic/explained_variance"] > 0.9
    assert set(first) >= {
        "critic/value_loss",
        "critic/vf_clipfrac",
        "critic/values_mean",
        "critic/returns_mean",
        "critic/grad_norm",
        "critic/explained_variance",
    }


def train_steps(
    critic: ValueModel, optimizer: torch.optim.Optimizer, batch: TrainBatch, n: int
) -> None:
    returns = fixed_returns(batch)
    for _ in range(n):
        with torch.no_grad():
            old = critic.values(batch)
        critic_update(
            critic,
            optimizer,
            [batch],
            [returns],
            [old],
            clip_range=0.2,
            aggregation="token-mean",
            total_tokens=float(batch.mask_B_C.sum()),
            max_grad_norm=1.0,
        )


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)])
def test_save_load_round_trip_and_exact_resume(
    tiny_model_dir: Path, rows: list[Trajectory], tmp_path: Path, lora: LoraSettings | None
) -> None:
    batch = batch_of(rows)
    critic = build_critic(str(tiny_model_dir), lora)
    optimizer = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    train_steps(critic, optimizer, batch, 3)
    critic.save(tmp_path / "critic")
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    meta = json.loads((tmp_path / "critic" / "critic.json").read_text())
    assert meta["base"] == str(tiny_model_dir) and meta["dtype"] == "float32"
    assert (meta["lora"] is None) == (lora is None)

    restored = load_critic(tmp_path / "critic")
    fresh = build_critic(str(tiny_model_dir), lora)
    fresh.load_into(tmp_path / "critic")
    saved = critic.state_dict()
    for other in (restored, fresh):
        state = other.state_dict()
        assert set(state) == set(saved)
        assert all(torch.equal(state[k], saved[k]) for k in saved)

    # one more step from the checkpoint equals one more step of the original run, bit for bit
    resumed_opt = torch.optim.AdamW(fresh.trainable_parameters(), lr=1e-2)
    resumed_opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
    train_steps(critic, optimizer, batch, 1)
    train_steps(fresh, resumed_opt, batch, 1)
    with torch.no_grad():
        assert torch.equal(critic.values(batch), fresh.values(batch))


def test_lora_critic_trains_adapters_and_head_only(
    tiny_model_dir: Path, rows: list[Trajectory]
) -> None:
    critic = build_critic(str(tiny_model_dir), LoraSettings(r=4, alpha=8))
    trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert {"head.weight", "head.bias"} <= set(trainable)
    assert all("lora_" in n for n in trainable if not n.startswith("head."))
    assert any("lora_" in n for n in trainable)
    frozen_before = {
        n: p.detach().clone() for n, p in critic.named_parameters() if not p.requires_grad
    }
    # adapters start as the identity (lora_B = 0): same values as the plain critic, same head
    plain = build_critic(str(tiny_model_dir))
    randomise_head(plain)
    randomise_head(critic)
    batch = batch_of(rows)
    with torch.no_grad():
        torch.testing.assert_close(critic.values(batch), plain.values(batch), rtol=0.0, atol=1e-6)
        before = critic.values(batch)
    adapters_before = {n: critic.get_parameter(n).detach().clone() for n in trainable}
    optimizer = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    train_steps(critic, optimizer, batch, 3)
    with torch.no_grad():
        assert not torch.equal(critic.values(batch), before)
    # every trainable parameter moved (lora_B from zero after the first step), nothing frozen did
    for name in trainable:
        assert not torch.equal(critic.get_parameter(name), adapters_before[name]), name
    for name, value in frozen_before.items():
        assert torch.equal(critic.get_parameter(name), value), name


def test_gradient_checkpointing_gives_the_same_values_and_gradients(
    tiny_model_dir: Path, rows: list[Trajectory]
) -> None:
    lora = LoraSettings(r=4, alpha=8)
    batch = batch_of(rows)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same random lora_A both times
        critic = build_critic(str(tiny_model_dir), lora, gradient_checkpointing=checkpointing)
        randomise_head(critic)
        critic.train()
        values = critic.values(batch)
        (values * batch.mask_B_C).sum().backward()
        grads = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
        results.append((values.detach(), grads))
    (v0, g0), (v1, g1) = results
    torch.testing.assert_close(v1, v0, rtol=0.0, atol=1e-6)
    assert set(g1) == set(g0) and any("lora_A" in n for n in g0)
    for name, grad in g0.items():
        rel = (g1[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert rel < 1e-5, f"{name}: relative gradient difference {rel:.2e}"
