"""rlvr's HFGenerator (HF's forward, and rlvr's own fast decode path) against transformers'
`generate`, same model, prompts and sampling settings.

Both sample `--prompts` x `--n` rows (batch 64 by default) of up to `--max-new-tokens` tokens at
temperature 1 (no top-k, no top-p) from SmolLM2-135M-Instruct. `generate` gets the prompts repeated
n times, left-padded, `num_return_sequences`-style; rlvr gets each prompt once (it prefills a prompt
once for its n samples, drops finished rows, and also returns every token's log-prob, which the
`generate` call here does not compute). Tokens counted: sampled tokens up to and including EOS. The
order alternates (hf, rlvr, fast, fast-bf16, hf, rlvr, ...) so all see the same machine load:

    hf          model.generate, float32
    rlvr        HFGenerator, HF's forward (decode "hf": the default sampler on CPUs without native
                bf16), float32 (the RL sampler never autocasts)
    fast        HFGenerator(decode="fast"): rlvr's decode path, the policy's float32 matrices
    fast-bf16   the same from a bfloat16 weight copy (where the CPU has native bf16,
                `cpu_has_bf16()`, and the default sampler there; or with --bf16-copy: elsewhere
                bf16 matmuls are ~8x slower)
    hf-bf16     model.generate under bf16 autocast (native-bf16 CPUs: TRL's bf16=True samples so);
                the ratios against HF use the faster of hf and hf-bf16

Each row also prints the weights' GB/s: bytes of weight matrices one decode step reads (the fast
path's copy, or the model's linear layers for the HF paths, whose autocast reads them as fp32) x
decode steps (the longest completion) / the whole call's seconds, prefill included, so a lower
bound on the decode steps' own rate. The last lines are

    generation_tokens_per_s_ratio_rlvr_over_hf=X
    generation_tokens_per_s_ratio_fast_over_rlvr=Y
    generation_tokens_per_s_ratio_fast_bf16_over_rlvr=Z       (native bf16 or --bf16-copy)
    generation_tokens_per_s_ratio_fast_bf16_over_hf=W

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
    parser.add_argument(
        "--bf16-copy", action="store_true", help="run fast-bf16 even without native bf16"
    )
    args = parser.parse_args()

    from rlvr.config import ArithmeticConfig
    from rlvr.devices import cpu_has_bf16
    from rlvr.models import eos_token_ids, load_policy
    from rlvr.rollout.chat import render_prompt_ids
    from rlvr.rollout.fast_decode import DecodeWeights
    from rlvr.rollout.generator import SamplingParams
    from rlvr.rollout.hf import HFGenerator
    from rlvr.tasks import arithmetic_tasks

    torch.manual_seed(0)
    policy = load_policy(args.model)
    model, tokenizer = policy.model.eval(), policy.tokenizer
    eos = eos_token_ids(model, tokenizer)
    tasks = arithmetic_tasks(ArithmeticConfig()).train[: args.prompts]
    prompts = [render_prompt_ids(tokenizer, [dict(m) for m in t.messages]) for t in tasks]

    # Weight bytes a decode step reads: the linear layers (the head once, tied or not) as stored.
    linear_bytes = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    step_bytes = {
        "hf": linear_bytes,
        "rlvr": linear_bytes,
        "fast": DecodeWeights.build(model, torch.float32).bytes_per_step,
        "fast-bf16": DecodeWeights.build(model, torch.bfloat16).bytes_per_step,
    }

    def rlvr_runner(decode: str, dtype: torch.dtype | None) -> Any:
        def run() -> tuple[int, int, float]:
            generator = HFGenerator(
                model,
                tokenizer,
                eos,
                seed=0,
                autocast_bf16=False,
                decode=decode,
                decode_dtype=dtype,
            )
            sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
            t0 = time.perf_counter()
            groups = generator.generate(prompts, sampling)
            seconds = time.perf_counter() - t0
            lengths = [len(c.token_ids) for g in groups for c in g]
            return sum(lengths), max(lengths) - 1, seconds

        return run

    def hf_runner(autocast: bool) -> Any:
        return lambda: run_hf(autocast)

    def run_hf(autocast: bool) -> tuple[int, int, float]:
        rows = [p for p in prompts for _ in range(args.n)]
        width = max(len(r) for r in rows)
        pad = int(tokenizer.pad_token_id)
        input_ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
        attention = (
            torch.arange(width)[None, :] >= (width - torch.tensor([len(r) for r in rows]))[:, None]
        ).long()
        context: Any = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
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
        return tokens, new.shape[1] - 1, seconds

    runners = {
        "hf": hf_runner(False),
        "rlvr": rlvr_runner("hf", None),
        "fast": rlvr_runner("fast", torch.float32),
    }
    if cpu_has_bf16() or args.bf16_copy:
        runners["fast-bf16"] = rlvr_runner("fast", torch.bfloat16)
    if cpu_has_bf16():
        # HF's generate at its other precision too (as TRL's bf16=True samples): the ratios below
        # use whichever of the two was faster.
        runners["hf-bf16"] = hf_runner(True)
        step_bytes["hf-bf16"] = linear_bytes
    rates: dict[str, list[float]] = {name: [] for name in runners}
    bandwidth: dict[str, list[float]] = {name: [] for name in runners}
    for repeat in range(args.repeats):
        for name, fn in runners.items():
            tokens, steps, seconds = fn()
            rates[name].append(tokens / seconds)
            bandwidth[name].append(step_bytes[name] * steps / seconds / 1e9)
            print(
                f"repeat {repeat} {name:>9}: {tokens} tokens in {seconds:.1f} s = "
                f"{tokens / seconds:.1f} tok/s, weights >= {bandwidth[name][-1]:.2f} GB/s "
                f"({step_bytes[name] / 1e6:.0f} MB a step)"
            )
    median = {name: statistics.median(r) for name, r in rates.items()}
    print(
        f"batch {args.prompts * args.n} rows, {args.max_new_tokens} new tokens: "
        + ", ".join(
            f"{name} {median[name]:.1f} tok/s ({statistics.median(bandwidth[name]):.2f} GB/s)"
            for name in runners
        )
    )
    hf_best = max(median[name] for name in ("hf", "hf-bf16") if name in median)
    if "hf-bf16" in median:
        print(f"HF generate's faster precision: {'bf16' if hf_best > median['hf'] else 'fp32'}")
    print(f"generation_tokens_per_s_ratio_rlvr_over_hf={median['rlvr'] / hf_best:.2f}")
    print(f"generation_tokens_per_s_ratio_fast_over_rlvr={median['fast'] / median['rlvr']:.2f}")
    if "fast-bf16" in median:
        print(
            "generation_tokens_per_s_ratio_fast_bf16_over_rlvr="
            f"{median['fast-bf16'] / median['rlvr']:.2f}"
        )
        print(
            f"generation_tokens_per_s_ratio_fast_bf16_over_hf={median['fast-bf16'] / hf_best:.2f}"
        )


if __name__ == "__main__":
    main()
