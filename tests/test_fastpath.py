"""Every numerical shortcut taken for speed or memory agrees with the plain computation (issue 7).

- SkinnyLinear (decode-time W @ x^T layout) vs F.linear, alone and through a model;
- the generator with and without it;
- fused AdamW vs torch's default AdamW;
- the trainer's chunked entropy and per-piece log-probs vs a hand computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rlvr.models import eos_token_ids, load_policy
from rlvr.optim import adamw
from rlvr.records import Trajectory
from rlvr.rollout.fastlinear import SkinnyLinear
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.hf import HFGenerator
from rlvr.train.batch import collate, token_distributions


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    policy = load_policy(str(tiny_model_dir))
    policy.model.eval()
    return policy.model, policy.tokenizer


# ------------------------------------------------------------------------------- SkinnyLinear
@pytest.mark.parametrize("shape", [(16, 64), (2, 3, 64), (1, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_equals_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    expected = F.linear(x, weight, bias)
    with SkinnyLinear() as mode:
        got = F.linear(x, weight, bias)
    assert mode.calls == 1
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_skinny_linear_leaves_many_rows_alone() -> None:
    x, weight = torch.randn(300, 8), torch.randn(4, 8)
    with SkinnyLinear(max_rows=256) as mode:
        got = F.linear(x, weight)
    assert mode.calls == 0
    assert torch.equal(got, F.linear(x, weight))


def test_skinny_linear_model_logits_and_gradients_match(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    ids = torch.randint(4, 100, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with SkinnyLinear() as mode:
            skinny = model(input_ids=ids).logits
    assert mode.calls > 0
    torch.testing.assert_close(skinny, plain, rtol=1e-5, atol=1e-5)


def test_generator_samples_the_same_with_and_without_skinny_linear(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    eos = eos_token_ids(model, tok)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12)
    out = {}
    for skinny in (True, False):
        gen = HFGenerator(model, tok, eos, seed=3, autocast_bf16=False, skinny_linear=skinny)
        out[skinny] = gen.generate(prompts, sampling)
    for group_a, group_b in zip(out[True], out[False], strict=True):
        for a, b in zip(group_a, group_b, strict=True):
            assert a.token_ids == b.token_ids  # the same draws: log-probs differ by rounding only
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0.0, atol=1e-5
            )


# ---------------------------------------------------------------------------------- fused AdamW
def test_fused_adamw_matches_default_adamw() -> None:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    results = []
    for make in (
        lambda ps: adamw(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
        lambda ps: torch.optim.AdamW(
            ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False
        ),
    ):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = make(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    assert opt.defaults.get("fused") in (None, False)  # the second one is the plain loop
    for fused, plain in zip(*results, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)


def test_adamw_is_fused_on_cpu() -> None:
    opt = adamw([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    assert opt.defaults["fused"] is True


# ------------------------------------------------------------------- trainer log-probs, entropy
def _trajectory(prompt: list[int], completion: list[int]) -> Trajectory:
    n_p, n_c = len(prompt), len(completion)
    return Trajectory(
        task_id="t",
        token_ids=tuple(prompt + completion),
        policy_mask=(0,) * n_p + (1,) * n_c,
        logprobs=(0.0,) * (n_p + n_c),
        prompt_length=n_p,
        completion_text="",
        finish_reason="length",
    )


@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_trainer_logprobs_entropy_and_full_distribution_by_hand(
    tiny: tuple[Any, Any], share_prefix: bool, temperature: float
) -> None:
    model, tok = tiny
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, 100, (6,), generator=gen).tolist()
    rows = [
        _trajectory(prompt, torch.randint(4, 100, (n,), generator=gen).tolist()) for n in (1, 4, 7)
    ]
    batch = collate(rows, [[0.0] * (len(r.token_ids) - 6) for r in rows], int(tok.pad_token_id))
    with torch.no_grad():
        logp_B_C, entropy_B_C, full_B_C_V = token_distributions(
            model, batch, temperature, with_entropy=True, share_prefix=share_prefix
        )
        assert entropy_B_C is not None and full_B_C_V is not None
        for i, row in enumerate(rows):
            logits = model(input_ids=torch.tensor([row.token_ids])).logits[0].float()
            dist = torch.log_softmax(logits / temperature, dim=-1)[5:-1]  # positions predicting C
            n = len(row.token_ids) - 6
            targets = torch.tensor(row.token_ids[6:])
            torch.testing.assert_close(
                logp_B_C[i, :n], dist.gather(1, targets[:, None]).squeeze(1), atol=1e-5, rtol=0
            )
            hand_entropy = -(dist.exp() * dist).sum(-1)
            torch.testing.assert_close(entropy_B_C[i, :n], hand_entropy, atol=1e-5, rtol=0)
            torch.testing.assert_close(full_B_C_V[i, :n], dist, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ FLOP count
class _TwoLayer(torch.nn.Module):
    """embedding (not a matmul) -> body (8x4, frozen) -> head (10x8, trainable)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 8, bias=False)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.body.requires_grad_(False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_flop_count_by_hand() -> None:
    from rlvr.observe.flops import backward_flops, forward_flops, linear_weights

    weights = linear_weights(_TwoLayer())
    assert (weights.body_frozen, weights.body_trainable) == (32, 0)
    assert (weights.head_trainable, weights.head_frozen) == (80, 0)
    # 5 positions through the body, logits at 3: 2 * (32 * 5 + 80 * 3) = 800
    assert forward_flops(weights, 5, 3) == 800.0
    # backward: activations' gradient (= forward, 800) + the head's weight gradient (2 * 80 * 3)
    assert backward_flops(weights, 5, 3) == 800.0 + 480.0


@pytest.mark.precision  # the loop at model.bf16: auto
def test_update_reports_its_flops(tiny: tuple[Any, Any], tiny_model_dir: Path) -> None:
    from rlvr.config import load_config
    from rlvr.models import load_policy
    from rlvr.observe.flops import forward_flops, linear_weights
    from rlvr.train.update import policy_update

    cfg = load_config(None, [f"model.name={tiny_model_dir}", "objective.beta=0.0"])
    policy = load_policy(str(tiny_model_dir))
    rows = [_trajectory([5, 6, 7], [8, 9]), _trajectory([5, 6, 7], [10, 11, 12])]
    opt = adamw(policy.trainable_parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
    metrics = policy_update(policy, opt, rows, [[1.0, 1.0], [-1.0, -1.0, -1.0]], cfg)
    weights = linear_weights(policy.model)
    # one shared 3-token prompt + 5 completion tokens, every weight trainable: fwd + 2 x fwd
    expected = 3 * forward_flops(weights, 3 + 5, 5)
    assert metrics["perf/update_gflops"] == pytest.approx(expected / 1e9)
    assert metrics["perf/update_gflops_per_s"] > 0


# ------------------------------------------------------------------ sparse tied-embedding grad
def test_sparse_tied_embedding_gradient_equals_the_dense_one(tiny_model_dir: Path) -> None:
    from rlvr.models import sparse_tied_embedding_grad

    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    grads = {}
    for sparse in (False, True):
        policy = load_policy(str(tiny_model_dir))  # load_policy turns it on for a tied model
        embedding = policy.model.get_input_embeddings()
        assert embedding.weight is policy.model.get_output_embeddings().weight
        embedding.sparse = sparse
        for _ in range(2):  # two backward passes accumulate, as micro-batches do
            policy.model(input_ids=ids).logits.square().mean().backward()
        assert not embedding.weight.grad.is_sparse
        grads[sparse] = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
        assert sparse_tied_embedding_grad(policy.model)
    for name, dense in grads[False].items():
        torch.testing.assert_close(grads[True][name], dense, rtol=1e-6, atol=1e-7)


def test_untied_or_frozen_embeddings_stay_dense() -> None:
    from rlvr.models import sparse_tied_embedding_grad

    class Untied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.embed

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.head

    model = Untied()
    assert not sparse_tied_embedding_grad(model) and not model.embed.sparse
    model.head.weight = model.embed.weight  # tied, but frozen
    model.embed.weight.requires_grad_(False)
    assert not sparse_tied_embedding_grad(model) and not model.embed.sparse


# --------------------------------------------------------------------------------- merged LoRA
# (the `lora_policy` fixture: tests/conftest.py)
def test_merged_lora_gives_the_adapted_outputs_and_writes_nothing(lora_policy: Any) -> None:
    from rlvr.rollout.fastlinear import merged_lora

    model = lora_policy.model
    ids = torch.randint(4, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with merged_lora(model) as merged:
            fast = model(input_ids=ids).logits
        with model.disable_adapter(), merged_lora(model) as merged_ref:
            fast_base = model(input_ids=ids).logits
    assert merged > 0 and merged_ref == 0  # the reference (adapters off) is left alone
    assert (adapted - base).abs().max() > 1e-3  # the adapters matter here
    torch.testing.assert_close(fast, adapted, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_base, base, rtol=0.0, atol=0.0)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    with torch.no_grad():  # the layers' own forward is back
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=0.0, atol=0.0)
    assert all("forward" not in vars(m) for m in model.modules())


def test_lora_generator_samples_the_same_merged_or_not(lora_policy: Any) -> None:
    model, tok = lora_policy.model, lora_policy.tokenizer
    eos = eos_token_ids(model, tok)
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=10)
    out = {}
    for merge in (True, False):
        gen = HFGenerator(model, tok, eos, seed=1, autocast_bf16=False, merge_lora=merge)
        out[merge] = gen.generate([[5, 6, 7, 8]], sampling)[0]
    for a, b in zip(out[True], out[False], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0.0, atol=1e-5
        )


# ------------------------------------------------------------------- fused head: hidden -> logp
def test_fused_linear_logprobs_and_gradients_by_hand() -> None:
    from rlvr.train.fused_logprobs import LinearTokenLogprobs, fused_logprobs_chunk_rows

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=gen, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(11, 5, generator=gen).requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=gen)
    g_logp, g_ent = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    for temperature in (1.0, 0.7):
        with fused_logprobs_chunk_rows(3):  # several chunks, the last one short
            logp, ent = LinearTokenLogprobs.apply(
                hidden, weight, targets, temperature, torch.float32
            )
            grads = torch.autograd.grad((logp * g_logp + ent * g_ent).sum(), (hidden, weight))
        dist = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
        hand_logp = dist.gather(1, targets[:, None]).squeeze(1)
        hand_ent = -(dist.exp() * dist).sum(-1)
        hand = torch.autograd.grad((hand_logp * g_logp + hand_ent * g_ent).sum(), (hidden, weight))
        torch.testing.assert_close(logp, hand_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, hand_ent, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, hand, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_fused_linear_logprobs_in_bf16_by_hand() -> None:
    """bf16 compute: the head's matmuls see bf16-rounded hidden states and weights and give bf16
    logits, the softmax is fp32; the weight gradient is one bf16 matmul over all positions (rounded
    once, as autocast's), returned in the weight's fp32. Small-integer inputs make the logits exact in
    bf16 on any CPU; the hand version rounds the logit gradients and the two head gradients to bf16
    (float64 elsewhere), so they agree to a bf16 ulp whatever order a CPU's kernel sums in."""
    from rlvr.train.fused_logprobs import LinearTokenLogprobs, fused_logprobs_chunk_rows

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randint(-2, 3, (7, 5), generator=gen).float().requires_grad_()
    weight = torch.randint(-2, 3, (11, 5), generator=gen).float().requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=gen)
    g_logp, g_ent = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    temperature = 4.0  # a power of two: the tempered logits stay exact
    with fused_logprobs_chunk_rows(3):
        logp, ent = LinearTokenLogprobs.apply(hidden, weight, targets, temperature, torch.bfloat16)
        g_hidden, g_weight = torch.autograd.grad(
            (logp * g_logp + ent * g_ent).sum(), (hidden, weight)
        )
    assert logp.dtype == ent.dtype == g_weight.dtype == g_hidden.dtype == torch.float32
    # The head gradients come out of bf16 matmuls: every value is a bf16 number (an fp32 matmul's
    # would not be), on any CPU.
    for grad in (g_hidden, g_weight):
        assert torch.equal(grad, grad.bfloat16().float())

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.detach().bfloat16().double()

    h64, w64 = bf16(hidden), bf16(weight)
    z = (h64 @ w64.t()) / temperature
    dist = torch.log_softmax(z, dim=-1)
    torch.testing.assert_close(
        logp.double(), dist.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(ent.double(), -(dist.exp() * dist).sum(-1), rtol=0, atol=1e-5)
    z_leaf = z.clone().requires_grad_()
    dist = torch.log_softmax(z_leaf, dim=-1)
    loss = (dist.gather(1, targets[:, None]).squeeze(1) * g_logp.double()).sum() + (
        -(dist.exp() * dist).sum(-1) * g_ent.double()
    ).sum()
    (grad_z,) = torch.autograd.grad(loss, (z_leaf,))
    grad_z = bf16(grad_z / temperature)
    ulp = 2.0**-8
    torch.testing.assert_close(g_hidden.double(), bf16(grad_z @ w64), rtol=ulp, atol=1e-6)
    torch.testing.assert_close(g_weight.double(), bf16(grad_z.t() @ h64), rtol=ulp, atol=1e-6)


def test_fused_bf16_backward_in_blocks_never_holds_every_position() -> None:
    """Past one backward block (issue 34: never an (N, V) buffer) the bf16 head's weight gradient is
    each block's bf16 product summed in fp32, and the hidden gradient is unchanged: checked by hand
    against float64 with each block's rounding, and against the one-block result within bf16 ulps
    of the largest value."""
    from rlvr.train import fused_logprobs as fl

    gen = torch.Generator().manual_seed(2)
    hidden = torch.randint(-2, 3, (7, 5), generator=gen).float().requires_grad_()
    weight = torch.randint(-2, 3, (11, 5), generator=gen).float().requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=gen)
    g_logp, g_ent = torch.randn(7, generator=gen), torch.randn(7, generator=gen)

    def grads(block: int) -> tuple[torch.Tensor, torch.Tensor]:
        with fl.fused_logprobs_chunk_rows(3), fl.fused_backward_block_rows(block):
            logp, ent = fl.LinearTokenLogprobs.apply(hidden, weight, targets, 4.0, torch.bfloat16)
            g_h, g_w = torch.autograd.grad((logp * g_logp + ent * g_ent).sum(), (hidden, weight))
        return g_h, g_w

    one_h, one_w = grads(1024)
    blocked_h, blocked_w = grads(3)  # blocks of 3, 3 and 1 positions
    assert torch.equal(blocked_h, one_h)
    assert blocked_w.dtype == torch.float32
    # Rounding each block's part instead of the sum: off by bf16 ulps of the parts, which can be
    # larger than the sum (cancellation), so the bound is relative to the largest value.
    torch.testing.assert_close(blocked_w, one_w, rtol=0, atol=2.0**-6 * float(one_w.abs().max()))

    h64, w64 = hidden.detach().bfloat16().double(), weight.detach().bfloat16().double()
    z_leaf = ((h64 @ w64.t()) / 4.0).requires_grad_()
    dist = torch.log_softmax(z_leaf, dim=-1)
    loss = (dist.gather(1, targets[:, None]).squeeze(1) * g_logp.double()).sum() + (
        -(dist.exp() * dist).sum(-1) * g_ent.double()
    ).sum()
    (grad_z,) = torch.autograd.grad(loss, (z_leaf,))
    grad_z = (grad_z / 4.0).bfloat16().double()
    by_hand = sum(
        (grad_z[s : s + 3].t() @ h64[s : s + 3]).bfloat16().double() for s in range(0, 7, 3)
    )
    torch.testing.assert_close(blocked_w.double(), by_hand, rtol=2.0**-8, atol=1e-6)


# Tolerances per precision, (value atol, gradient relative). fp32: float rounding. bf16 (the
# trainer's autocast update): both heads round the same products to bf16 (5e-7 apart on the Xeon
# where this was written); the bound leaves room for a CPU kind whose bf16 kernels sum in another
# order (a logit ulp moves a log-prob by ~1e-3 here). That the fused head really computes in bf16
# is checked exactly by the by-hand test above.
_FUSED_TOLERANCE = {False: (1e-5, 1e-4), True: (5e-3, 2e-2)}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("share_prefix", [True, False])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_path_equals_the_logits_path_in_values_and_gradients(
    tiny_model_dir: Path, share_prefix: bool, entropy_grad: bool, bf16: bool
) -> None:
    policy = load_policy(str(tiny_model_dir))
    model = policy.model
    model.train()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 100, (n,), generator=gen).tolist() for n in (5, 8)]
    rows = [
        _trajectory(prompts[i % 2], torch.randint(4, 100, (n,), generator=gen).tolist())
        for i, n in enumerate((3, 6, 1, 4))
    ]
    batch = collate(rows, [[0.0] * (len(r.token_ids) - r.prompt_length) for r in rows], 0)
    weights = torch.randn(batch.completion_ids_B_C.shape, generator=gen) * batch.completion_mask_B_C
    results = {}
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        logp, entropy, _ = token_distributions(
            model,
            batch,
            0.8,
            with_entropy=True,
            entropy_grad=entropy_grad,
            bf16=bf16,
            share_prefix=share_prefix,
            with_full=False,
            fused=fused,
        )
        assert entropy is not None and entropy.requires_grad == entropy_grad
        assert logp.dtype == entropy.dtype == torch.float32
        loss = (logp * weights).sum() + (0.1 * (entropy * weights).sum() if entropy_grad else 0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert all(g.dtype == torch.float32 for g in grads.values())
        results[fused] = (logp.detach(), entropy.detach(), grads)
    valid = batch.completion_mask_B_C.bool()
    (lp_f, ent_f, g_f), (lp_p, ent_p, g_p) = results[True], results[False]
    value_atol, grad_rel = _FUSED_TOLERANCE[bf16]
    torch.testing.assert_close(lp_f[valid], lp_p[valid], rtol=0.0, atol=value_atol)
    torch.testing.assert_close(ent_f[valid], ent_p[valid], rtol=0.0, atol=value_atol)
    assert g_f.keys() == g_p.keys()
    for name, grad in g_p.items():
        rel = (g_f[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert rel < grad_rel, f"{name}: relative gradient difference {rel:.2e}"


def test_fused_head_is_refused_where_logits_are_not_a_plain_matmul(tiny_model_dir: Path) -> None:
    from rlvr.train.fused_logprobs import fusable_head

    model = load_policy(str(tiny_model_dir)).model
    assert fusable_head(model) is model.get_output_embeddings().weight
    model.get_output_embeddings().half()  # fp16: neither the fp32 nor the bf16 arithmetic
    assert fusable_head(model) is None
    model.get_output_embeddings().bfloat16()  # a bf16 reference copy: fused in bf16
    assert fusable_head(model) is model.get_output_embeddings().weight
    model.config.final_logit_softcapping = 30.0
    assert fusable_head(model) is None


def test_fused_logprobs_auto_means_lora_runs() -> None:
    from rlvr.config import load_config
    from rlvr.train.micro_batching import use_fused_logprobs

    assert not use_fused_logprobs(load_config(None, []))  # full FT: see config.py
    for bf16 in ("on", "off"):  # auto and an explicit setting, in either precision
        assert use_fused_logprobs(
            load_config(None, ["model.lora.enabled=true", f"model.bf16={bf16}"])
        )
        assert use_fused_logprobs(
            load_config(None, ["train.fused_logprobs=true", f"model.bf16={bf16}"])
        )
        off = ["model.lora.enabled=true", "train.fused_logprobs=false", f"model.bf16={bf16}"]
        assert not use_fused_logprobs(load_config(None, off))


def test_fused_logprobs_auto_is_on_for_every_run_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the unfused head's fp32 (rows, length, vocab) logits are what runs out of memory
    (issue 34): auto takes the fused head there for full fine-tuning too; false still wins."""
    from rlvr.config import load_config
    from rlvr.train import micro_batching

    monkeypatch.setattr(micro_batching, "device_or_cpu", lambda setting: torch.device("cuda", 0))
    assert micro_batching.use_fused_logprobs(load_config(None, []))
    off = load_config(None, ["train.fused_logprobs=false"])
    assert not micro_batching.use_fused_logprobs(off)
