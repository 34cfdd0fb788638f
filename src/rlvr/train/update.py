"""The policy update: micro-batched forward/backward of the clipped surrogate and its guard rails.

Which rows each micro-batch holds (and, under torchrun, each rank) is rlvr.train.micro_batching.

    loss_t = w_t * L_pg(r_t, A_t) + beta * KL_est(pi || pi_ref)_t - c_H * H_t  [+ KL(pi || teacher)_t]

L_pg is the algorithm's policy loss (PPO-clip, GSPO, CISPO; rlvr.algorithms.losses), w_t the
off-policy correction's weight (`objective.off_policy_correction`, rlvr.algorithms.off_policy;
truncated IS per token when `objective.tis_cap` is set and no correction is named), the KL term is
here only when it is not in the reward (`objective.kl_in_reward`), and the teacher term only for
`algorithm: distill`.

Over the 500-line guide (~510): the update's stages (prepare, fixed log-probs, micro-batch backward,
optimizer step, metrics) and the reference scoring read together; each function is under the
80-line stage limit (tests/test_loop_shape.py). Next split: reference_logprobs into its own module.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlvr.algorithms import (
    KL_ESTIMATORS,
    aggregate,
    full_reverse_kl,
    zero_outside,
)
from rlvr.algorithms.off_policy import (
    Correction,
    build_correction,
    resolve_correction,
    sequence_ratio_loss,
)
from rlvr.build import use_bf16
from rlvr.config import RunConfig
from rlvr.devices import device_of
from rlvr.models import Policy
from rlvr.observe.flops import backward_flops, forward_flops, linear_weights
from rlvr.optim import adam_step_norms
from rlvr.records import Trajectory
from rlvr.registry import ALGORITHMS
from rlvr.scale.torch_dist import DistContext, norm_value, reshard
from rlvr.train.batch import (
    TrainBatch,
    disable_dropout,
    token_distributions,
    token_logprobs,
)
from rlvr.train.micro_batching import (
    RankPlan,
    packs_rows,
    per_token_scores,
    trains_on,
    use_fused_logprobs,
)


@dataclass
class UpdateTerms:
    """What every micro-batch's loss is made of in one update: the algorithm's policy loss, the
    off-policy correction, the KL, entropy and teacher terms, the aggregation's whole-batch
    normalisers, and the forward path (shared prompt, fused head) the plan chose."""

    cfg: RunConfig
    loss_fn: Callable[..., Any]
    correction: Correction | None
    pg_weight: float  # 1, or distill.reward_weight beside the teacher term
    kl_in_loss: bool
    teacher: Any
    norms: dict[str, float]
    bf16: bool
    share: bool
    fused: bool

    def forward(
        self, m: Any, b: TrainBatch, *, full: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(B, C) log-probs, and with `full` (the gradient pass) (B, C) entropies and, beside a
        teacher, the (B, C, V) log-distribution."""
        obj = self.cfg.objective
        return token_distributions(
            m,
            b,
            self.cfg.sampling.temperature,
            with_entropy=full,
            entropy_grad=full and obj.entropy_coef > 0,
            bf16=self.bf16,
            share_prefix=self.share,
            with_full=full and self.teacher is not None,
            fused=self.fused,
        )

    def padding_backward(self, model: Any, b: TrainBatch) -> None:
        """An fsdp padding micro-batch: the forward and backward keep this rank in step with the
        others (each is a collective, the teacher's forward too, in the order of a real
        micro-batch's); the zero loss adds nothing to the gradient."""
        padding_loss = self.forward(model, b, full=True)[0].sum() * 0.0
        if self.teacher is not None:
            self.teacher_distribution(b)
        padding_loss.backward()

    @torch.no_grad()
    def teacher_distribution(self, b: TrainBatch) -> torch.Tensor:
        """The teacher's (B, C, V) next-token log-distribution on `b` (no gradient)."""
        teacher_B_C_V = token_distributions(
            self.teacher,
            b,
            self.cfg.sampling.temperature,
            bf16=self.bf16,
            share_prefix=self.share,
        )[2]
        assert teacher_B_C_V is not None
        reshard(self.teacher)  # fsdp: no backward follows to free the root's gathered weights
        return teacher_B_C_V


def policy_update(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    trajectories: Sequence[Trajectory],
    token_advantages: Sequence[Sequence[float]],
    cfg: RunConfig,
    *,
    teacher: Any = None,
    dist: DistContext | None = None,
) -> dict[str, float]:
    """num_iterations optimizer steps on one batch; returns the update's metrics.

    `token_advantages[i]` has one advantage per completion token of trajectory i (0 where the policy
    did not sample: observations, glue); see rlvr.algorithms.credit. `teacher` (algorithm: distill)
    is the model whose full next-token distribution the student's is pulled towards.

    Micro-batches accumulate gradients; the aggregation's normalisers count the whole batch, so the
    accumulated gradient equals the full-batch gradient. `dist` (torchrun): every rank passes the
    whole batch and forwards its shard of the rows; gradients are summed over ranks before clipping,
    so every rank takes the step one process would take; the metrics are whole-batch ones.
    """
    started = time.perf_counter()
    obj = cfg.objective
    if not cfg.train.step_without_signal and no_signal(
        trajectories, token_advantages, cfg, teacher
    ):
        # Every advantage is 0 and nothing else has a gradient: AdamW would still move the weights
        # by its momentum (~lr each), a step of earlier batches' directions on no new evidence.
        return {"update/no_signal": 1.0, "update/rows_trained": 0.0}
    prepared = prepare_update(policy, trajectories, token_advantages, cfg, teacher, dist)
    if prepared is None:
        return {"update/skipped": 1.0, "update/no_signal": 0.0}
    terms, batches, real = prepared.terms, prepared.batches, prepared.real
    sums: dict[str, float] = {}
    grad_norms, skipped = optimizer_steps(policy, optimizer, prepared, cfg, dist, sums)
    real_batches = [b for b, r in zip(batches, real, strict=True) if r]
    sums["_forwarded_tokens"] = float(sum(b.mask_B_C.sum() for b in real_batches))
    sums["_flops"] = _update_flops(policy, real_batches, cfg, terms.kl_in_loss, terms.share)
    if dist is not None:  # whole-batch metrics on every rank: the sums of all ranks
        sums = dist.all_reduce_sums(sums)
    forwarded_tokens, flops = sums.pop("_forwarded_tokens"), sums.pop("_flops")
    update_sq, weight_sq = sums.pop("_update_sq", 0.0), sums.pop("_weight_sq", 0.0)
    metrics = update_metrics(
        sums,
        obj.num_iterations,
        total_tokens=prepared.total_tokens,
        forwarded_tokens=forwarded_tokens,
        correction_name=prepared.correction_name,
    )
    metrics.update(
        {
            "grad_norm": statistics.fmean(grad_norms) if grad_norms else float("nan"),
            "update/skipped_nonfinite": float(skipped),
            "update/no_signal": 0.0,
            "update/rows_forwarded_frac": prepared.rows_forwarded / prepared.rows_trained,
            "update/rows_trained": float(prepared.rows_trained),
            "update/micro_batches": float(sum(real)),  # this rank's forwards (train.max_tokens_...)
        }
    )
    if weight_sq and math.isfinite(weight_sq):  # an Adam stepped (not a test's SGD)
        # ||delta theta|| / ||theta|| over the step(s): how far the weights moved, whatever the
        # gradient's scale (Adam moves each weight by ~lr); AdamW's own step, not a diff.
        metrics["update/relative_norm"] = math.sqrt(update_sq / weight_sq)
    seconds = time.perf_counter() - started
    metrics["perf/update_gflops"] = flops / 1e9
    metrics["perf/update_gflops_per_s"] = flops / 1e9 / seconds if seconds > 0 else float("nan")
    return metrics


def optimizer_steps(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    prepared: PreparedUpdate,
    cfg: RunConfig,
    dist: DistContext | None,
    sums: dict[str, float],
) -> tuple[list[float], int]:
    """The num_iterations passes over the micro-batches, an optimizer step after each; the loss
    terms' sums (and the steps' squared update and weight norms) accumulate in `sums`. Returns the
    taken steps' gradient norms and how many steps were skipped for a non-finite loss or gradient."""
    terms, batches, real, model = prepared.terms, prepared.batches, prepared.real, policy.model
    old_logprobs, ref_logprobs = fixed_logprobs(terms, policy, batches)
    skipped = 0
    grad_norms: list[float] = []
    for iteration in range(cfg.objective.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        finite_loss = True
        for i, b in enumerate(batches):
            if not real[i]:  # fsdp padding: keeps this rank's collectives in step, adds nothing
                terms.padding_backward(model, b)
                continue
            old_B_C = None if old_logprobs is None else old_logprobs[i]
            ref_B_C = None if ref_logprobs is None else ref_logprobs[i]
            loss = micro_batch_backward(
                terms, model, b, old_B_C, ref_B_C, sums, first=iteration == 0
            )
            finite_loss = finite_loss and math.isfinite(loss)
        grad_norm = optimizer_step(policy, optimizer, cfg.train.max_grad_norm, dist, finite_loss)
        if grad_norm is None:
            skipped += 1  # a non-finite loss or gradient would poison the weights: skip, count it
        else:
            grad_norms.append(grad_norm)
            update_sq, weight_sq = adam_step_norms(optimizer)
            sums["_update_sq"] = sums.get("_update_sq", 0.0) + update_sq
            sums["_weight_sq"] = weight_sq  # the weights after the last step

    return grad_norms, skipped


@dataclass
class PreparedUpdate:
    """One update's micro-batches on the device (`real[i]` False for fsdp's padding ones), the
    terms of their loss, and the counts its metrics are divided by."""

    terms: UpdateTerms
    batches: list[TrainBatch]
    real: list[bool]
    total_tokens: float  # policy tokens of every row that trains (the normaliser)
    rows_trained: int
    rows_forwarded: int  # rows_trained less the zero-advantage rows skipped
    correction_name: str


def gradient_only_from_advantages(cfg: RunConfig, teacher: Any) -> bool:
    """Whether a row with advantage 0 adds exactly 0 to the gradient: no KL in the loss, no
    entropy bonus, no teacher term (then such rows can be skipped, and a batch of them is no step)."""
    obj = cfg.objective
    kl_in_loss = obj.beta > 0 and not obj.kl_in_reward
    return not kl_in_loss and obj.entropy_coef == 0 and teacher is None


def no_signal(
    trajectories: Sequence[Trajectory],
    token_advantages: Sequence[Sequence[float]],
    cfg: RunConfig,
    teacher: Any,
) -> bool:
    """True when the update would have a zero gradient: every advantage of every training row is 0
    and no other term has one (`gradient_only_from_advantages`). The same on every rank (each
    passes the whole batch)."""
    if not gradient_only_from_advantages(cfg, teacher):
        return False
    return not any(
        any(adv) for t, adv in zip(trajectories, token_advantages, strict=True) if trains_on(t, cfg)
    )


def prepare_update(
    policy: Policy,
    trajectories: Sequence[Trajectory],
    token_advantages: Sequence[Sequence[float]],
    cfg: RunConfig,
    teacher: Any,
    dist: DistContext | None,
) -> PreparedUpdate | None:
    """Which rows train and which are forwarded, the micro-batches (this rank's, on its device),
    and the loss's terms; None when no row trains."""
    obj, model = cfg.objective, policy.model
    usable = [i for i, t in enumerate(trajectories) if trains_on(t, cfg)]
    if not usable:
        return None
    kl_in_loss = obj.beta > 0 and not obj.kl_in_reward
    # With no KL, entropy or teacher term, a row whose advantage is 0 adds exactly 0 to the gradient:
    # skip its forward and backward. The normalisers below still count it, so the update is
    # unchanged (tested). Late in a run most groups are all-right or all-wrong: this saves most of it.
    skip_zero = cfg.train.skip_zero_advantage_rows and gradient_only_from_advantages(cfg, teacher)
    forwarded = [i for i in usable if not (skip_zero and not any(token_advantages[i]))]
    plan = RankPlan.make(
        trajectories,
        forwarded,
        cfg.train.micro_batch_size,
        dist,
        cfg.train.share_prompt_prefix,
        use_fused_logprobs(cfg),
        max_tokens=cfg.train.max_tokens_per_micro_batch,
        packed=packs_rows(cfg, model, training=True),
    )
    # Collated on the host, one copy per tensor to the model's device (the rank's under torchrun).
    device = dist.device if dist is not None else device_of(model)
    pad_id = int(policy.tokenizer.pad_token_id)
    batches = [
        plan.collate(trajectories, token_advantages, pad_id, chunk, device) for chunk in plan.chunks
    ]
    total_tokens = float(sum(trajectories[i].num_policy_tokens for i in usable))
    loss_fn = ALGORITHMS.resolve(cfg.algorithm).loss
    correction_name = resolve_correction(obj.off_policy_correction, obj.tis_cap)
    terms = UpdateTerms(
        cfg,
        loss_fn,
        build_correction(
            correction_name,
            cap=obj.tis_cap,
            bounds=obj.off_policy_bounds,
            sequence_ratio=sequence_ratio_loss(loss_fn),
        ),
        pg_weight=1.0 if teacher is None else cfg.distill.reward_weight,
        kl_in_loss=kl_in_loss,
        teacher=teacher,
        norms={
            "total_tokens": total_tokens,
            "total_sequences": float(len(usable)),
            "norm_length": float(cfg.sampling.max_new_tokens),
        },
        bf16=use_bf16(cfg.model),
        # The distillation term needs the full distribution, which the fused head never builds:
        # with a teacher every pass takes the unfused head, so pi_old, pi_ref and pi_theta share
        # one path.
        share=plan.share_prefix,
        fused=plan.fused and teacher is None,
    )
    real = [chunk is not plan.padding for chunk in plan.chunks]
    return PreparedUpdate(
        terms, batches, real, total_tokens, len(usable), len(forwarded), correction_name
    )


def fixed_logprobs(
    terms: UpdateTerms, policy: Policy, batches: Sequence[TrainBatch]
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """pi_old's log-probs (only with num_iterations > 1) and pi_ref's (only with the KL in the
    loss), per micro-batch, without gradient; and the model put in the update's mode.

    pi_old, pi_ref and the gradient pass: one mode (train, so gradient checkpointing applies
    alike), no dropout (the generator sampled without it: a gradient pass with dropout would score
    another, random policy), one forward path. The first ratio pi_theta / pi_old is then exactly 1,
    as it must be before any step."""
    model = policy.model
    disable_dropout(model)
    model.train()
    with torch.no_grad():
        # On-policy (one update per batch) pi_old is the current policy: its log-probs come free from
        # the gradient pass (detached), for the ratio and for truncated IS alike; no extra forward.
        needs_old = terms.cfg.objective.num_iterations > 1
        old_logprobs = [terms.forward(model, b)[0] for b in batches] if needs_old else None
        ref_logprobs = None
        if terms.kl_in_loss:
            with policy.reference(bf16_matmuls=terms.bf16) as ref:
                ref_logprobs = [terms.forward(ref, b)[0] for b in batches]
                reshard(ref)  # fsdp: a frozen model gets no backward to free what it gathered
    return old_logprobs, ref_logprobs


def micro_batch_backward(
    terms: UpdateTerms,
    model: Any,
    b: TrainBatch,
    old_logprobs_B_C: torch.Tensor | None,
    ref_logprobs_B_C: torch.Tensor | None,
    sums: dict[str, float],
    *,
    first: bool,
) -> float:
    """One micro-batch's loss, backpropagated (gradients accumulate); its per-token sums are added
    to `sums`. `old_logprobs_B_C` None: on-policy, pi_old is this pass detached. `first`: the first
    iteration over the batch, whose log-probs are compared with the sampler's. Returns the loss."""
    obj, mask = terms.cfg.objective, b.mask_B_C

    # Each per-token sum stays on the device until one host read after the backward (a read per
    # value would be ~8 host syncs per micro-batch on a GPU).
    pending: dict[str, torch.Tensor] = {}

    def add(name: str, value: torch.Tensor) -> None:
        pending[name] = pending[name] + value if name in pending else value

    logp_B_C, entropy_B_C, full_B_C_V = terms.forward(model, b, full=True)
    assert entropy_B_C is not None
    # Per-token inputs are read at policy positions only. Elsewhere (observations, padding)
    # they may hold anything, even inf or nan (an unscored reference, a padding token), and
    # a mask applied afterwards cannot stop 0 * inf = nan in the backward of exp or a product.
    on_B_C = mask != 0
    logp_B_C = torch.where(on_B_C, logp_B_C, 0.0)
    old_B_C = logp_B_C.detach() if old_logprobs_B_C is None else old_logprobs_B_C
    old_B_C = torch.where(on_B_C, old_B_C, 0.0)
    out = terms.loss_fn(
        logp_B_C,
        old_B_C,
        torch.where(on_B_C, b.advantages_B_C, 0.0),
        mask,
        epsilon=obj.epsilon,
        epsilon_high=obj.epsilon_high,
    )
    per_token_B_C = out.loss_B_T * terms.pg_weight
    if terms.correction is not None:
        behaviour_B_C = torch.where(on_B_C, b.behaviour_logprobs_B_C, 0.0)
        corrected = terms.correction(old_B_C, behaviour_B_C, mask)
        per_token_B_C = per_token_B_C * corrected.weights_B_T
        add("tis_weight", zero_outside(corrected.weights_B_T, mask).sum())
        add("tis_capped", corrected.clipped_B_T.sum())
        add("off_policy_masked", corrected.masked_B_T.sum())
    if ref_logprobs_B_C is not None:
        ref_B_C = torch.where(on_B_C, ref_logprobs_B_C, 0.0)
        kl_B_C = KL_ESTIMATORS[obj.kl_estimator](logp_B_C, ref_B_C)
        per_token_B_C = per_token_B_C + obj.beta * kl_B_C
        add("kl", zero_outside(kl_B_C.detach(), mask).sum())
    if obj.entropy_coef > 0:
        per_token_B_C = per_token_B_C - obj.entropy_coef * entropy_B_C
    if terms.teacher is not None:
        assert full_B_C_V is not None
        teacher_B_C_V = terms.teacher_distribution(b)
        distill_B_C = full_reverse_kl(full_B_C_V, teacher_B_C_V)
        per_token_B_C = per_token_B_C + distill_B_C
        add("distill", zero_outside(distill_B_C.detach(), mask).sum())
    loss = aggregate(per_token_B_C, mask, obj.loss_aggregation, **terms.norms)
    loss.backward()
    add("loss", loss.detach())
    add("entropy", zero_outside(entropy_B_C.detach(), mask).sum())
    add("clip_ratio/low_mean", zero_outside(out.clipped_low_B_T, mask).sum())
    add("clip_ratio/high_mean", zero_outside(out.clipped_high_B_T, mask).sum())
    if first:  # later iterations score weights this update already moved
        gap_B_C = (logp_B_C.detach() - b.behaviour_logprobs_B_C).abs()
        add("behaviour_logprob_diff", zero_outside(gap_B_C, mask).sum())
    names = list(pending)
    values = torch.stack([pending[n].detach().double().reshape(()) for n in names]).tolist()
    for name, value in zip(names, values, strict=True):
        sums[name] = sums.get(name, 0.0) + value
    return values[names.index("loss")]


def optimizer_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    dist: DistContext | None,
    finite_loss: bool,
) -> float | None:
    """Clip the accumulated gradient and step; returns its norm, or None where the loss or the
    gradient was not finite (the step is skipped: it would poison the weights)."""
    for p in policy.trainable_parameters():
        if p.grad is None:  # every row skipped: a zero gradient, so AdamW still steps as usual
            p.grad = torch.zeros_like(p)
    if dist is not None:
        # Sum over ranks before clipping, so the clipped norm is the whole batch's; the flag makes
        # every rank skip (or take) the step together.
        flag = dist.sum_gradients(policy.trainable_parameters(), [float(not finite_loss)])
        finite_loss = flag[0] == 0
    grad_norm = norm_value(
        torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), max_grad_norm)
    )
    if not (math.isfinite(grad_norm) and finite_loss):
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    # Gradients go as soon as the step has used them: they would otherwise be held through the
    # rollout and eval that follow (4 bytes per trained parameter: 28 GiB at 7B); the next
    # update's first backward makes them anew.
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def update_metrics(
    sums: dict[str, float],
    num_iterations: int,
    *,
    total_tokens: float,
    forwarded_tokens: float,
    correction_name: str,
) -> dict[str, float]:
    """The update's per-token metrics from its whole-batch sums (TRL's names where TRL has one)."""
    n_tok = total_tokens * num_iterations
    n_fwd = forwarded_tokens * num_iterations

    def per_token(name: str, denominator: float) -> float:
        return sums.get(name, 0.0) / denominator if denominator else float("nan")

    metrics = {
        "loss": sums.get("loss", 0.0) / num_iterations,
        # Entropy over the rows that were forwarded (all of them unless zero-advantage rows were skipped).
        "entropy": per_token("entropy", n_fwd),
        # Skipped rows have A = 0 and so cannot be clipped: the whole batch is the denominator.
        "clip_ratio/low_mean": per_token("clip_ratio/low_mean", n_tok),
        "clip_ratio/high_mean": per_token("clip_ratio/high_mean", n_tok),
        "clip_ratio/region_mean": per_token("clip_ratio/low_mean", n_tok)
        + per_token("clip_ratio/high_mean", n_tok),
        # Generator vs trainer log-prob gap on the same tokens (numerics, or a stale/other engine).
        "update/behaviour_logprob_abs_diff": per_token("behaviour_logprob_diff", forwarded_tokens),
    }
    if "kl" in sums:
        metrics["kl"] = per_token("kl", n_tok)
    if "tis_weight" in sums:
        metrics["update/tis_weight_mean"] = per_token("tis_weight", n_fwd)
        metrics["update/tis_capped_frac"] = per_token("tis_capped", n_fwd)
        if correction_name in ("mis_token", "mis_sequence", "icepop", "geo_mask"):
            # verl's name: the share of policy tokens the correction gave weight 0.
            masked = per_token("off_policy_masked", n_fwd)
            metrics["rollout_corr/rollout_is_masked_fraction"] = masked
    if "distill" in sums:
        metrics["distill/reverse_kl"] = per_token("distill", n_fwd)
    return metrics


def _update_flops(
    policy: Policy, batches: Sequence[TrainBatch], cfg: RunConfig, kl_in_loss: bool, share: bool
) -> float:
    """Model FLOPs of this update (rlvr.observe.flops): the pi_ref and pi_old forwards when they ran,
    then forward + backward per iteration. A teacher's forward (distill) is not counted."""
    weights = linear_weights(policy.model)
    forward = backward = 0.0
    for b in batches:
        completion = float(b.completion_mask_B_C.sum())
        if share:
            prompt = float(b.prompt_mask_P_Lp.sum())
        else:
            prompt = float(b.prompt_mask_P_Lp.index_select(0, b.row_prompt_B).sum())
        forward += forward_flops(weights, prompt + completion, completion)
        backward += backward_flops(weights, prompt + completion, completion)
    obj = cfg.objective
    extra_forwards = int(kl_in_loss) + int(obj.num_iterations > 1)
    return forward * (extra_forwards + obj.num_iterations) + backward * obj.num_iterations


def reference_logprobs(
    policy: Policy,
    trajectories: Sequence[Trajectory],
    cfg: RunConfig,
    dist: DistContext | None = None,
) -> list[list[float]] | None:
    """Reference log-probs per completion token when the KL penalty is in the reward; else None.
    With `dist` each rank scores its shard and every rank gets all of them (`per_token_scores`)."""
    obj = cfg.objective
    if not (obj.kl_in_reward and obj.beta > 0):
        return None
    bf16 = use_bf16(cfg.model)
    usable = [i for i, t in enumerate(trajectories) if t.usable]
    # The same plan per_token_scores makes, for its share-prefix / fused choice (fsdp restricts both).
    plan = RankPlan.make(
        trajectories,
        usable,
        cfg.train.micro_batch_size,
        dist,
        cfg.train.share_prompt_prefix,
        use_fused_logprobs(cfg),
        max_tokens=cfg.train.max_tokens_per_micro_batch,
        packed=packs_rows(cfg, policy.model, training=False),
    )
    policy.model.eval()
    with policy.reference(bf16_matmuls=bf16) as ref:
        scores = per_token_scores(
            lambda b: token_logprobs(
                ref,
                b,
                cfg.sampling.temperature,
                bf16=bf16,
                share_prefix=plan.share_prefix,
                fused=plan.fused,
            )[0],
            trajectories,
            cfg,
            int(policy.tokenizer.pad_token_id),
            dist,
            device_of(policy.model),
        )
        reshard(ref)  # fsdp: a frozen model gets no backward to free what it gathered
    return scores
