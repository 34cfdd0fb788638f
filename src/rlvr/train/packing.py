"""Padding-free forward passes: a micro-batch's rows laid end to end in one sequence.

The plain path (rlvr.train.batch) pads every row to the micro-batch's longest prompt + completion, so
a batch whose completions run 20 to 400 tokens pushes ~2x the tokens it scores through every layer.
Packed, the rows are concatenated into a single (1, N) sequence with N = the sum of their lengths,
and `position_ids` restart at 0 at each row:

    input_ids      [p p p c c | p p c c c c | p c]        (1, N), no padding
    position_ids   [0 1 2 3 4 | 0 1 2 3 4 5 | 0 1]

transformers reads the restarts as row boundaries (masking_utils.find_packed_sequence_indices) and
attends within a row only: block-diagonal causal attention, so each row's log-probs are those of the
plain path up to float rounding (tests/test_packing.py). With flash_attention_2 the kernel runs
variable-length rows directly (varlen: the cost of attention is the sum of the rows' squares); with
sdpa and eager it is given an (N, N) mask, whose attention costs N^2 however the rows split: hence
`train.padding_free: auto` packs with a varlen kernel only (see `packing_wanted`).

A model whose attention ignored the restarts would let rows see each other and give silently wrong
log-probs, so before a model's first packed pass `packing_is_exact` compares a tiny packed input with
the same rows run one at a time, once per model, and the caller falls back to the plain path (with a
warning) when they differ.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

# Attention implementations that run packed rows as variable-length sequences (no (N, N) mask).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
_EXACT_ATTRIBUTE = "_rlvr_packing_exact"


@dataclass(frozen=True)
class PackedRows:
    """Where each row of a padded (B, C) completion layout lies in the packed sequence.

    input_ids_1_N / position_ids_1_N: the rows end to end (prompt, then completion minus its last
    token, which predicts nothing that is scored). predicting_B_C: the packed position whose output
    predicts completion token c of row b (padding positions point at a valid one; they are masked).
    """

    input_ids_1_N: torch.Tensor
    position_ids_1_N: torch.Tensor
    predicting_B_C: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.input_ids_1_N.shape[1])


def pack_rows(
    prompts: list[list[int]], completions: list[list[int]], width: int, device: torch.device
) -> PackedRows:
    """Pack row b = `prompts[b]` + `completions[b]` (unpadded token lists; each completion has at least
    one token) for a (B, `width`) completion layout. Built as Python lists, one tensor each on
    `device`."""
    ids: list[int] = []
    positions: list[int] = []
    predicting: list[list[int]] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        fed = prompt + completion[:-1]
        first = len(ids) + len(prompt) - 1  # the prompt's last position predicts completion[0]
        ids += fed
        positions += range(len(fed))
        row = [first + j for j in range(len(completion))]
        predicting.append(row + [first] * (width - len(row)))
    return PackedRows(
        torch.tensor([ids], dtype=torch.long, device=device),
        torch.tensor([positions], dtype=torch.long, device=device),
        torch.tensor(predicting, dtype=torch.long, device=device),
    )


def packed_outputs(model: Any, packed: PackedRows, hidden: bool) -> torch.Tensor:
    """(B, C, V) logits, or with `hidden` the decoder's (B, C, H) final hidden states, at the positions
    that predict the C completion tokens of each row; one forward over the packed sequence (no
    attention mask: the position restarts delimit the rows)."""
    batch_rows, width = packed.predicting_B_C.shape
    flat = packed.predicting_B_C.reshape(-1)
    inputs = {
        "input_ids": packed.input_ids_1_N,
        "position_ids": packed.position_ids_1_N,
        "use_cache": False,
    }
    if hidden:
        states_1_N_H = model.get_decoder()(**inputs).last_hidden_state
        out = states_1_N_H.index_select(1, flat)
    else:
        # `logits_to_keep` as indices: the lm_head runs only where a completion token is predicted.
        out = model(**inputs, logits_to_keep=flat).logits
    return out.view(batch_rows, width, out.shape[-1])


def packing_wanted(setting: bool | str, model: Any) -> bool:
    """`train.padding_free` resolved: auto = on where the attention kernel is variable-length
    (flash_attention_2/3), off with sdpa and eager, whose (N, N) mask makes attention cost N^2 for the
    whole micro-batch (measured on CPU in docs/performance.md: slower there than padding)."""
    if setting != "auto":
        return bool(setting)
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in VARLEN_ATTENTION


def packing_is_exact(model: Any) -> bool:
    """Whether `model` keeps packed rows apart: two short rows packed against each run alone, the second
    row's logits within rounding of its own (1e-4 of the largest logit for fp32 weights, 2e-2 for
    bf16: rows that saw each other differ by far more). Probed once per model; a model that fails
    gets a warning and the plain path."""
    known = getattr(model, _EXACT_ATTRIBUTE, None)
    if known is not None:
        return bool(known)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 32)
    parameter = next(model.parameters())
    device = parameter.device
    tolerance = 1e-4 if parameter.dtype == torch.float32 else 2e-2
    rows = [[(7 * i + 3) % vocab for i in range(5)], [(11 * i + 5) % vocab for i in range(4)]]
    with torch.no_grad():
        alone = [
            model(
                input_ids=torch.tensor([row], device=device),
                position_ids=torch.arange(len(row), device=device)[None, :],
                use_cache=False,
            ).logits[0]
            for row in rows
        ]
        packed = model(
            input_ids=torch.tensor([rows[0] + rows[1]], device=device),
            position_ids=torch.tensor(
                [list(range(len(rows[0]))) + list(range(len(rows[1])))], device=device
            ),
            use_cache=False,
        ).logits[0]
    # The first row is causal-prefix either way; only the second can see a row that is not its own.
    expected = alone[1].float()
    gap = (packed[len(rows[0]) :].float() - expected).abs().max()
    exact = bool(gap <= tolerance * expected.abs().max().clamp(min=1.0))
    if not exact:
        warnings.warn(
            f"train.padding_free: {type(model).__name__} lets packed rows attend to each other "
            f"(logit gap {float(gap):.3g}); the update pads its rows instead",
            stacklevel=2,
        )
    setattr(model, _EXACT_ATTRIBUTE, exact)
    return exact
