"""Padded vs packed (padding-free) rows in the update's forward + backward, on the path where rows run
whole (gradient checkpointing on, or train.share_prompt_prefix off): what `train.padding_free`
saves or costs on this machine with this attention implementation.

    python benchmarks/packing.py                      # SmolLM2-135M, sdpa, checkpointing on
    python benchmarks/packing.py --no-checkpointing --attn eager

Rows: G samples of a few prompts, completion lengths spread over [min, max] as RL batches are.
Prints tokens forwarded, the median seconds of a forward + backward (token log-probs through
rlvr.train.batch.token_logprobs, the update's own function), and the ratio packed / padded, under the
machine header (benchmarks/_machine.py). On sdpa and eager the packed rows get an (N, N) block mask:
attention then costs N^2, which is what `padding_free: auto` avoids (it packs with flash_attention_2/3
only, whose varlen kernel runs each row's own square).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlvr.models import load_policy
from rlvr.records import Trajectory
from rlvr.train.batch import collate, disable_dropout, token_logprobs


def rows(
    prompts: int, group: int, prompt_len: int, low: int, high: int, vocab: int
) -> list[Trajectory]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for p in range(prompts):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(group):
            n = int(torch.randint(low, high + 1, (1,), generator=gen))
            completion = torch.randint(10, vocab, (n,), generator=gen).tolist()
            out.append(
                Trajectory(
                    task_id=f"p{p}",
                    token_ids=tuple(prompt + completion),
                    policy_mask=(0,) * prompt_len + (1,) * n,
                    logprobs=(0.0,) * (prompt_len + n),
                    prompt_length=prompt_len,
                    completion_text="",
                    finish_reason="stop",
                )
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=60)
    parser.add_argument("--min-completion", type=int, default=16)
    parser.add_argument("--max-completion", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import _machine

    print("\n".join(_machine.machine().header()))
    checkpointing = not args.no_checkpointing
    policy = load_policy(
        args.model, gradient_checkpointing=checkpointing, attn_implementation=args.attn
    )
    model = policy.model
    disable_dropout(model)
    model.train()
    batch_rows = rows(
        args.prompts,
        args.group,
        args.prompt_len,
        args.min_completion,
        args.max_completion,
        int(model.config.vocab_size),
    )
    advantages = [[1.0] * (len(t.token_ids) - t.prompt_length) for t in batch_rows]
    pad = int(policy.tokenizer.pad_token_id)
    padded = collate(batch_rows, advantages, pad)
    packed = collate(batch_rows, advantages, pad, pack=True)
    assert packed.packed is not None
    padded_tokens = len(batch_rows) * (padded.prompt_ids_P_Lp.shape[1] + padded.completion_width)

    def step(batch: object) -> float:
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        logp, _ = token_logprobs(model, batch, share_prefix=False, fused=True)  # type: ignore[arg-type]
        (logp * batch.completion_mask_B_C).sum().backward()  # type: ignore[attr-defined]
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"padded": [], "packed": []}
    step(padded)  # warm-up (allocator, kernels)
    for _ in range(args.repeats):
        times["padded"].append(step(padded))
        times["packed"].append(step(packed))
    padded_s, packed_s = (statistics.median(times[k]) for k in ("padded", "packed"))
    lengths = [len(t.token_ids) - t.prompt_length for t in batch_rows]
    print(
        f"{args.model}, attn={args.attn}, checkpointing={checkpointing}, {len(batch_rows)} rows, "
        f"prompt {args.prompt_len}, completions {min(lengths)}-{max(lengths)} "
        f"(mean {statistics.mean(lengths):.0f}), {args.repeats} repeats, torch threads "
        f"{torch.get_num_threads()}"
    )
    print("| rows | tokens forwarded | forward+backward s (median) |")
    print("|---|---|---|")
    print(f"| padded | {padded_tokens} | {padded_s:.3f} |")
    print(f"| packed | {packed.packed.tokens} | {packed_s:.3f} |")
    print(f"packed / padded time: {packed_s / padded_s:.2f}")


if __name__ == "__main__":
    main()
