"""The padding-free forward (rlvr.train.packing): rows end to end equal the padded rows, exactly where
the model keeps rows apart, and a model that does not is caught before it trains on wrong log-probs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.models import load_policy
from rlvr.records import Trajectory
from rlvr.train.batch import collate, token_logprobs
from rlvr.train.micro_batching import micro_batches
from rlvr.train.packing import pack_rows, packing_is_exact, packing_wanted

PAD = 0


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Any:
    return load_policy(str(tiny_model_dir)).model


def traj(prompt: list[int], completion: list[int], task: str = "t") -> Trajectory:
    n = len(prompt)
    return Trajectory(
        task_id=task,
        token_ids=tuple(prompt + completion),
        policy_mask=(0,) * n + (1,) * len(completion),
        logprobs=(0.0,) * (n + len(completion)),
        prompt_length=n,
        completion_text="",
        finish_reason="stop",
    )


@pytest.fixture(scope="module")
def ragged() -> list[Trajectory]:
    """3 prompts (4, 9, 2 tokens) and completions of 1 to 11 tokens: lots of padding either way."""
    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(4, 128, (n,), generator=gen).tolist()

    prompts = [ids(4), ids(9), ids(2)]
    return [
        traj(prompts[k % 3], ids(n), task=f"t{k % 3}") for k, n in enumerate((1, 11, 3, 6, 2, 9))
    ]


def test_pack_rows_layout_by_hand() -> None:
    """Rows [p0 p1 | c0 c1 c2] and [q0 | d0]: the last completion token is not fed (it predicts
    nothing scored); positions restart per row; completion token j of a row is predicted by the
    position before it; padding points at the row's first predicting position."""
    packed = pack_rows([[10, 11], [20]], [[30, 31, 32], [40]], 3, torch.device("cpu"))
    assert packed.input_ids_1_N.tolist() == [[10, 11, 30, 31, 20]]
    assert packed.position_ids_1_N.tolist() == [[0, 1, 2, 3, 0]]
    # Row 0: positions 1 (p1 -> c0), 2 (c0 -> c1), 3 (c1 -> c2). Row 1: position 4 (q0 -> d0), then pads.
    assert packed.predicting_B_C.tolist() == [[1, 2, 3], [4, 4, 4]]
    assert packed.tokens == 5


@pytest.mark.parametrize("fused", [True, False], ids=["fused_head", "logits"])
def test_packed_rows_equal_padded_rows(tiny: Any, ragged: list[Trajectory], fused: bool) -> None:
    """Log-probs, entropies and every parameter's gradient of the packed forward equal the padded
    one (fp32: to rounding), for the fused head (hidden states) and the model's own logits."""
    model = tiny
    advantages = [[1.0] * (len(t.token_ids) - t.prompt_length) for t in ragged]
    padded = collate(ragged, advantages, PAD)
    packed = collate(ragged, advantages, PAD, pack=True)
    assert packed.packed is not None and padded.packed is None
    # Fewer tokens through the model: sum of lengths minus one per row, vs rows x (Lp + C).
    rows = len(ragged)
    padded_tokens = rows * (padded.prompt_ids_P_Lp.shape[1] + padded.completion_width)
    assert packed.packed.tokens == sum(len(t.token_ids) for t in ragged) - rows < padded_tokens

    weights = torch.randn(
        padded.completion_ids_B_C.shape, generator=torch.Generator().manual_seed(1)
    )
    valid = padded.completion_mask_B_C.bool()
    results = []
    for batch in (padded, packed):
        model.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs(
            model, batch, 0.7, with_entropy=True, share_prefix=False, fused=fused
        )
        assert entropy is not None
        (logp * weights * batch.completion_mask_B_C).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        results.append((logp.detach(), entropy.detach(), grads))
    model.zero_grad(set_to_none=True)
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    torch.testing.assert_close(lp_b[valid], lp_a[valid], rtol=0.0, atol=1e-5)
    torch.testing.assert_close(ent_b[valid], ent_a[valid], rtol=0.0, atol=1e-5)
    for name, grad in g_a.items():
        rel = (g_b[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"


def test_shared_prefix_path_wins_over_packing(tiny: Any, ragged: list[Trajectory]) -> None:
    """A batch collated packed still takes the shared-prompt path when that path runs: it forwards
    each prompt once, which packing cannot."""
    calls: list[tuple[int, ...]] = []
    hook = tiny.get_decoder().register_forward_hook(
        lambda _m, _a, kwargs, _o: calls.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    batch = collate(
        ragged, [[0.0] * (len(t.token_ids) - t.prompt_length) for t in ragged], PAD, pack=True
    )
    try:
        with torch.no_grad():
            token_logprobs(tiny, batch, share_prefix=True)
            shared_calls = list(calls)
            calls.clear()
            token_logprobs(tiny, batch, share_prefix=False)
    finally:
        hook.remove()
    assert shared_calls[0][0] == 3  # the 3 distinct prompts, once each
    assert calls == [(1, batch.packed.tokens)]  # type: ignore[union-attr]


class _IgnoresPositions(torch.nn.Module):
    """A model whose attention does not see the position restarts (it drops position_ids): packed
    rows would attend to each other."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **kwargs: Any) -> Any:
        kwargs.pop("position_ids", None)
        return self.inner(**kwargs)


def test_probe_catches_a_model_that_lets_rows_see_each_other(tiny_model_dir: Path) -> None:
    good = load_policy(str(tiny_model_dir)).model
    assert packing_is_exact(good)
    bad = _IgnoresPositions(load_policy(str(tiny_model_dir)).model)
    with pytest.warns(UserWarning, match="packed rows attend to each other"):
        assert not packing_is_exact(bad)
    assert not packing_is_exact(bad)  # probed once: the answer is kept, no second warning


def test_auto_packs_with_a_varlen_kernel_only(tiny: Any) -> None:
    assert packing_wanted(True, tiny) and not packing_wanted(False, tiny)
    assert tiny.config._attn_implementation == "sdpa"
    assert not packing_wanted("auto", tiny)

    class FlashConfig:
        _attn_implementation = "flash_attention_2"

    class FlashModel:
        config = FlashConfig()

    assert packing_wanted("auto", FlashModel())


def test_packed_token_cap_counts_real_tokens(ragged: list[Trajectory]) -> None:
    """Total lengths (prompt + completion) 5, 20, 5, 10, 11, 11 in prompt order t0: 5, 10; t1: 20, 11;
    t2: 5, 11. Padded, a micro-batch costs rows x longest; packed, the sum of its rows."""
    lengths = [len(t.token_ids) for t in ragged]
    assert lengths == [5, 20, 5, 10, 11, 11]
    order = list(range(len(ragged)))
    padded = micro_batches(ragged, order, 8, max_tokens=30)
    packed = micro_batches(ragged, order, 8, max_tokens=30, packed=True)
    for chunk in padded:
        assert len(chunk) * max(lengths[i] for i in chunk) <= 30 or len(chunk) == 1
    for chunk in packed:
        assert sum(lengths[i] for i in chunk) <= 30 or len(chunk) == 1
    assert len(packed) < len(padded)  # the same rows in fewer forwards


@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["no_kl", "kl_in_loss"])
def test_a_checkpointed_update_packed_equals_padded(
    tiny_model_dir: Path, ragged: list[Trajectory], beta: float
) -> None:
    """The whole `policy_update` under gradient checkpointing (rows run whole), padding_free on and
    off from the same weights: the same loss, metrics and new weights (to fp32 rounding), with fewer
    tokens forwarded."""
    from rlvr.config import load_config
    from rlvr.train.update import policy_update

    advantages = [
        [(-1.0) ** k] * (len(t.token_ids) - t.prompt_length) for k, t in enumerate(ragged)
    ]
    outcomes = {}
    for padding_free in ("true", "false"):
        cfg = load_config(
            None,
            [
                f"model.name={tiny_model_dir}",
                "model.bf16='off'",
                "model.gradient_checkpointing=true",
                f"objective.beta={beta}",
                f"train.padding_free={padding_free}",
                "train.micro_batch_size=4",
            ],
        )
        torch.manual_seed(0)
        policy = load_policy(
            str(tiny_model_dir), gradient_checkpointing=True, need_reference=beta > 0
        )
        # Plain SGD: the new weights carry the gradient itself (Adam's first step is lr x its sign,
        # which flips for a gradient element within rounding of 0).
        opt = torch.optim.SGD(policy.trainable_parameters(), lr=1.0)
        metrics = policy_update(policy, opt, ragged, advantages, cfg)
        outcomes[padding_free] = (
            metrics,
            [p.detach().clone() for p in policy.trainable_parameters()],
        )
    (m_packed, w_packed), (m_padded, w_padded) = outcomes["true"], outcomes["false"]
    assert m_packed["update/skipped_nonfinite"] == 0.0
    for name in ("loss", "kl", "entropy", "grad_norm"):
        if name in m_padded:
            assert m_packed[name] == pytest.approx(m_padded[name], rel=1e-4, abs=1e-6), name
    for a, b in zip(w_packed, w_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-5)


def test_a_packed_batch_moves_whole(ragged: list[Trajectory]) -> None:
    """`TrainBatch.to` carries the packed layout along (here to the meta device: a GPU's stand-in)."""
    batch = collate(
        ragged, [[0.0] * (len(t.token_ids) - t.prompt_length) for t in ragged], PAD, pack=True
    )
    moved = batch.to(torch.device("meta"))
    assert moved.packed is not None and moved.completion_ids_B_C.device.type == "meta"
    assert {t.device.type for t in vars(moved.packed).values()} == {"meta"}


def test_the_run_says_when_its_update_is_padding_free(tiny_model_dir: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.placement import startup_lines

    policy = load_policy(str(tiny_model_dir), gradient_checkpointing=True)
    said = {}
    for setting in ("true", "false", "auto"):
        cfg = load_config(
            None,
            [
                f"model.name={tiny_model_dir}",
                "model.gradient_checkpointing=true",
                f"train.padding_free={setting}",
            ],
        )
        lines = startup_lines(cfg, policy, torch.device("cpu"), None)
        said[setting] = any("padding-free update" in line for line in lines)
    assert said == {"true": True, "false": False, "auto": False}  # auto: sdpa here
