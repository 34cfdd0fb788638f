"""Sampling one token per row from logits, and grouping prompts that share a prefix (HFGenerator's
helpers, also imported from `rlvr.rollout.hf`).

Everything runs on the logits' device with the caller's `torch.Generator`, which must live there
too (HFGenerator makes it on the model's device). The draw itself is device-specific: on the CPU
the fp64 inverse-CDF below (a CPU tuning, bit-identical to earlier releases); elsewhere
`torch.multinomial`, whose one-sample CUDA kernel works in the probabilities' own dtype (fp32 here)
without the V-wide fp64 cumsum that GPUs run slowly."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlvr.rollout.generator import SamplingParams


def sample_from_logits(
    logits_B_V: torch.Tensor, sampling: SamplingParams, rng: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns (tokens_B, logprobs_B) with log-probs of the tempered softmax.

    Greedy when temperature == 0 (log-probs then from the untempered softmax).
    """
    logits_B_V = logits_B_V.float()
    if sampling.temperature == 0:
        logprobs_B_V = torch.log_softmax(logits_B_V, dim=-1)
        tokens_B = logprobs_B_V.argmax(dim=-1)
        return tokens_B, logprobs_B_V.gather(1, tokens_B[:, None]).squeeze(1)
    logprobs_B_V = torch.log_softmax(logits_B_V / sampling.temperature, dim=-1)
    probs_B_V = logprobs_B_V.exp()
    if sampling.top_p < 1.0:
        sorted_probs, sorted_idx = probs_B_V.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs_B_V = torch.zeros_like(probs_B_V).scatter(1, sorted_idx, sorted_probs)
    tokens_B = draw(probs_B_V, rng)
    return tokens_B, logprobs_B_V.gather(1, tokens_B[:, None]).squeeze(1)


def draw(probs_B_V: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """One draw per row from unnormalised probabilities (B, V) -> (B,), on their device: the fp64
    inverse CDF on the CPU (`inverse_cdf_sample`), `torch.multinomial` elsewhere. A
    zero-probability token is never drawn by either."""
    if probs_B_V.device.type == "cpu":
        return inverse_cdf_sample(probs_B_V, rng)
    return torch.multinomial(probs_B_V, 1, generator=rng).squeeze(1)


def inverse_cdf_sample(probs_B_V: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """One draw per row from unnormalised probabilities: one uniform per row, located in the row's
    cumulative sum. (B, V) -> (B,).

    torch.multinomial on CPU draws V exponential variates per row (the exponential-race trick): at
    batch 64 x 49k ids that was 18% of SmolLM2's decode step here. This draws B uniforms. The cumsum is
    float64 so a 49k-entry sum keeps every token's share (a float32 sum would lose the ~1e-8 tails).
    A zero-probability token owns an empty interval and is never drawn.
    """
    cdf_B_V = probs_B_V.double().cumsum(dim=-1)
    u_B1 = torch.rand(
        (probs_B_V.shape[0], 1), generator=rng, dtype=torch.float64, device=probs_B_V.device
    )
    # right=True: the first index whose cumulative mass exceeds the draw (skips empty intervals).
    index_B1 = torch.searchsorted(cdf_B_V, u_B1 * cdf_B_V[:, -1:], right=True)
    return index_B1.squeeze(1).clamp(max=probs_B_V.shape[1] - 1)


def shared_prefix_groups(
    prompts: Sequence[Sequence[int]], min_shared: int
) -> list[tuple[int, list[int]]]:
    """Split prompts into runs of consecutive prompts sharing a prefix of >= min_shared tokens.

    Returns [(prefix_length, member indices)] in order; prefix_length leaves every member at least
    one token of its own (the one whose logits start sampling); a run of one gets its prompt minus
    the last token.
    """
    runs: list[tuple[int, list[int]]] = []  # (common prefix length so far, members)
    for i, prompt in enumerate(prompts):
        if runs:
            length, members = runs[-1]
            first = prompts[members[0]]
            common = 0
            limit = min(length, len(prompt))
            while common < limit and first[common] == prompt[common]:
                common += 1
            if common >= min_shared:
                runs[-1] = (common, [*members, i])
                continue
        runs.append((len(prompt), [i]))
    # Every member keeps >= 1 token of its own; a lone prompt's "prefix" is all but its last token.
    return [
        (min(length, min(len(prompts[m]) for m in members) - 1), members)
        for length, members in runs
    ]
