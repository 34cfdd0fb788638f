"""How far the sampler's log-probs are from the trainer's, per precision, and what truncated IS does.

Samples `--prompts` x `--n` completions (T=1, up to `--max-new-tokens`) from SmolLM2-135M-Instruct
on the demo's 2-digit addition prompts with rlvr's HFGenerator, once in fp32 and once under bf16
autocast, then scores every sampled token with the trainer's own path (rlvr.train.batch
token_logprobs: shared prompt prefix, fp32 log-softmax) in fp32 and in bf16. For each
(sampler, trainer) pair it prints the gap |log p_trainer - log p_sampler| over sampled tokens (mean,
p99, max; the mean is what `update/behaviour_logprob_abs_diff` logs) and the truncated importance
weights w = min(exp(log p_trainer - log p_sampler), cap) the update would apply (mean, min, max,
fraction capped), next to rlvr.precision's tolerance for that precision.

Usage: python benchmarks/precision_gap.py [--prompts 8] [--n 8] [--max-new-tokens 64] [--tis-cap 2]
Same weights on both sides: any gap here is rounding, not staleness. docs/performance.md quotes it.
"""

from __future__ import annotations

import argparse
import platform
import subprocess

import torch


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = fields.get("Flags", "")
    return f"{name} ({'avx512_bf16' if 'avx512_bf16' in flags else 'no avx512_bf16'})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument(
        "--fp32-head",
        action="store_true",
        help="experiment: lm_head outside autocast (fp32 logits)",
    )
    args = parser.parse_args()

    from rlvr.config import ArithmeticConfig
    from rlvr.models import eos_token_ids, load_policy
    from rlvr.precision import logprob_gap_tolerance
    from rlvr.records import Trajectory
    from rlvr.rollout.chat import render_prompt_ids
    from rlvr.rollout.generator import SamplingParams
    from rlvr.rollout.hf import HFGenerator
    from rlvr.tasks import arithmetic_tasks
    from rlvr.train.batch import collate, token_logprobs

    torch.manual_seed(0)
    policy = load_policy(args.model)
    model, tokenizer = policy.model.eval(), policy.tokenizer
    if args.fp32_head:
        head = model.lm_head
        plain_forward = head.forward

        def fp32_forward(hidden: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", enabled=False):
                return plain_forward(hidden.float())

        head.forward = fp32_forward
    eos = eos_token_ids(model, tokenizer)
    tasks = arithmetic_tasks(ArithmeticConfig()).train[: args.prompts]
    prompts = [render_prompt_ids(tokenizer, [dict(m) for m in t.messages]) for t in tasks]
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    print(f"model {args.model}, CPU {cpu_model()}, torch {torch.__version__}")
    print(f"{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} tokens, T=1\n")
    header = (
        f"{'sampler':>8} {'trainer':>8} | {'gap mean':>9} {'p99':>8} {'max':>8} | "
        f"{'tolerance':>9} | {'w mean':>7} {'w min':>7} {'w max':>7} {'capped':>7}"
    )
    print(header)
    print("-" * len(header))
    for sampler_bf16 in (False, True):
        generator = HFGenerator(model, tokenizer, eos, seed=0, autocast_bf16=sampler_bf16)
        groups = generator.generate(prompts, sampling)
        trajectories = [
            Trajectory(
                task_id=str(p),
                token_ids=(*prompt, *c.token_ids),
                policy_mask=(0,) * len(prompt) + (1,) * len(c.token_ids),
                logprobs=(0.0,) * len(prompt) + tuple(c.logprobs),
                prompt_length=len(prompt),
                completion_text="",
                finish_reason=c.finish_reason,
            )
            for p, (prompt, group) in enumerate(zip(prompts, groups, strict=True))
            for c in group
        ]
        batch = collate(
            trajectories,
            [[0.0] * (len(t.token_ids) - t.prompt_length) for t in trajectories],
            int(tokenizer.pad_token_id),
        )
        mask = batch.mask_B_C.bool()
        for trainer_bf16 in (False, True):
            with torch.no_grad():
                trainer_B_C, _ = token_logprobs(model, batch, 1.0, bf16=trainer_bf16, fused=False)
            log_ratio = (trainer_B_C - batch.behaviour_logprobs_B_C)[mask]
            gap = log_ratio.abs()
            weights = log_ratio.exp().clamp(max=args.tis_cap)
            tolerance = logprob_gap_tolerance(sampler_bf16 or trainer_bf16)
            print(
                f"{'bf16' if sampler_bf16 else 'fp32':>8} {'bf16' if trainer_bf16 else 'fp32':>8} | "
                f"{gap.mean():9.2e} {gap.quantile(0.99):8.2e} {gap.max():8.2e} | "
                f"{tolerance:9.2e} | {weights.mean():7.4f} {weights.min():7.4f} "
                f"{weights.max():7.4f} {(weights >= args.tis_cap).float().mean():7.4f}"
            )
    print(f"\ntokens scored per row pair: {int(mask.sum())}")


if __name__ == "__main__":
    main()
