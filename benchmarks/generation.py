"""rlvr's HFGenerator against transformers' `generate`, same model, prompts and sampling settings.

Both sample `--prompts` x `--n` rows (batch 64 by default) of up to `--max-new-tokens` tokens at
temperature 1 (no top-k, no top-p) from SmolLM2-135M-Instruct. `generate` gets the prompts repeated
n times, left-padded, `num_return_sequences`-style; rlvr gets each prompt once (it prefills a prompt
once for its n samples, drops finished rows, and also returns every token's log-prob, which the
`generate` call here does not compute). Tokens counted: sampled tokens up to and including EOS. The
order alternates (hf, rlvr, hf, rlvr, ...) so both see the same machine load; the last line is

    generation_tokens_per_s_ratio_rlvr_over_hf=X

Usage: python benchmarks/generation.py [--repeats 2] [--prompts 8] [--n 8] [--max-new-tokens 64]
A measuring instrument, not a test: read the ratio, the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    from rlvr.build import native_bf16
    from rlvr.config import ArithmeticConfig
    from rlvr.models import eos_token_ids, load_policy
    from rlvr.rollout.chat import render_prompt_ids
    from rlvr.rollout.generator import SamplingParams
    from rlvr.rollout.hf import HFGenerator
    from rlvr.tasks import arithmetic_tasks

    torch.manual_seed(0)
    policy = load_policy(args.model)
    model, tokenizer = policy.model.eval(), policy.tokenizer
    eos = eos_token_ids(model, tokenizer)
    tasks = arithmetic_tasks(ArithmeticConfig()).train[: args.prompts]
    prompts = [render_prompt_ids(tokenizer, [dict(m) for m in t.messages]) for t in tasks]
    bf16 = native_bf16()  # as `model.bf16: auto` decides for training runs

    def run_rlvr() -> tuple[int, float]:
        generator = HFGenerator(model, tokenizer, eos, seed=0, autocast_bf16=bf16)
        sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
        t0 = time.perf_counter()
        groups = generator.generate(prompts, sampling)
        seconds = time.perf_counter() - t0
        return sum(len(c.token_ids) for g in groups for c in g), seconds

    def run_hf() -> tuple[int, float]:
        rows = [p for p in prompts for _ in range(args.n)]
        width = max(len(r) for r in rows)
        pad = int(tokenizer.pad_token_id)
        input_ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
        attention = (
            torch.arange(width)[None, :] >= (width - torch.tensor([len(r) for r in rows]))[:, None]
        ).long()
        context: Any = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.no_grad()
        t0 = time.perf_counter()
        with torch.no_grad(), context:
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=pad,
                eos_token_id=sorted(eos),
            )
        seconds = time.perf_counter() - t0
        new = out[:, width:]
        tokens = 0
        for row in new.tolist():
            for token in row:
                tokens += 1
                if token in eos:
                    break
        return tokens, seconds

    rates: dict[str, list[float]] = {"hf": [], "rlvr": []}
    for repeat in range(args.repeats):
        for name, fn in (("hf", run_hf), ("rlvr", run_rlvr)):
            tokens, seconds = fn()
            rates[name].append(tokens / seconds)
            print(
                f"repeat {repeat} {name:>4}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s"
            )
    hf, rlvr = statistics.median(rates["hf"]), statistics.median(rates["rlvr"])
    print(
        f"batch {args.prompts * args.n} rows, {args.max_new_tokens} new tokens, bf16={bf16}: "
        f"hf {hf:.1f} tok/s, rlvr {rlvr:.1f} tok/s"
    )
    print(f"generation_tokens_per_s_ratio_rlvr_over_hf={rlvr / hf:.2f}")


if __name__ == "__main__":
    main()
