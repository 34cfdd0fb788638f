"""Cross-turn KV cache for HFGenerator: a live episode's next turn prefills only its new tokens.

In a multi-turn rollout the engine calls `generate` once per turn with every live conversation; the
next turn's prompt of an episode is its previous prompt + the tokens just sampled + the observation
glue. Without this store each turn re-prefilled the whole conversation. With it, each row's keys and
values are copied out of the decode cache when the row finishes (its real positions only, no
padding), keyed by the token ids they hold: the prompt and every sampled token but the last (the
last sampled token, often the EOS, was never fed to the model). A later prompt that extends a stored
key reuses it and prefills only the tail (that last sampled token + the glue).

Matching is on token ids (like vLLM's automatic prefix caching), so a wrong reuse is impossible: a
prompt that does not extend a stored entry (a rewritten history, a cut turn) falls back to the plain
prefill. Lifetime, as the engine uses it: an entry lives until the next `generate` call; there it is
either continued (and replaced by the longer entry of the new turn) or dropped (its episode ended).
The store holds at most `max_bytes`; rows past the cap are not kept (their next turn prefills in
full). The whole store is dropped when the weights change (a parameter's version counter or a checksum of
the trainable weights moved: `weights_fingerprint`), when the forward that computed the entries changes
(HF's or the fast path's, its copy's dtype, LoRA adapters switched: the key HFGenerator passes to
`check_weights`), and when the engine's rollout ends (`HFGenerator.turn_session`), which is before
every update.

An entry is per layer (kv_heads, length, head_dim) keys and values: a row of HF's DynamicCache
(`extract_rows`, `past_from_entries`, `merge_batches` below) and a row of the fast path's static
cache (`StaticDecode.extract`, `StaticDecode.from_entries`, `stack_decoders` in fast_decode.py)
alike, so `decode: fast` keeps its rows here in the same store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass
class Entry:
    """One conversation's cached keys and values: per layer (heads, length, head_dim)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


Fingerprint = tuple[tuple[tuple[int, int], ...], float]


def weights_fingerprint(model: Any) -> Fingerprint:
    """Every parameter's identity and version counter (bumped by in-place writes: `copy_`,
    `load_state_dict`, most optimizers), and a strided checksum of the trainable ones (torch's fused
    AdamW writes without bumping the counters). An update moves nearly every trainable element, so
    one in 61 sampled elements catches it; the checksum reads ~2% of the weights."""
    params = list(model.parameters())
    checksum = 0.0
    with torch.no_grad():
        for p in params:
            if p.requires_grad and p.numel():
                checksum += float(p.detach().reshape(-1)[::61].double().sum())
    return tuple((id(p), p._version) for p in params), checksum


def cacheable(cache: DynamicCache) -> bool:
    """Plain full-attention layers only (a sliding-window or linear-attention cache is not cut into
    rows here)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class TurnCache:
    """Stored entries keyed by the token ids they hold, and counters for tests and logs."""

    max_bytes: int
    entries: dict[tuple[int, ...], Entry] = field(default_factory=dict)
    fingerprint: Any = None  # what the entries were computed from (`check_weights`)
    stats: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("hits", "misses", "reused_tokens", "prefilled_tokens", "not_kept", "invalidated"), 0
        )
    )

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def check_weights(self, model: Any, key: Any = None) -> None:
        """Drop everything when the weights moved since the entries were computed (`key`: the
        caller's fingerprint of the weights and of the forward that will run; default
        `weights_fingerprint(model)`)."""
        fingerprint = key if key is not None else weights_fingerprint(model)
        if self.fingerprint is not None and fingerprint != self.fingerprint and self.entries:
            self.stats["invalidated"] += 1
            self.entries.clear()
        self.fingerprint = fingerprint

    def match(self, prompt: Sequence[int]) -> Entry | None:
        """The longest stored entry whose tokens are a strict prefix of `prompt` (the prompt keeps
        at least one token of its own: its last logits start sampling)."""
        prompt = tuple(prompt)
        for length in sorted({len(k) for k in self.entries}, reverse=True):
            if length < len(prompt) and (entry := self.entries.get(prompt[:length])) is not None:
                return entry
        return None

    def replace(self, rows: Sequence[tuple[tuple[int, ...], Entry]]) -> None:
        """The store after a generate call: this call's rows, in order, while they fit the cap.
        Entries of the previous call are dropped (continued ones are superseded by their rows)."""
        self.entries = {}
        total = 0
        for key, entry in rows:
            size = entry.nbytes
            if total + size > self.max_bytes:
                self.stats["not_kept"] += 1
                continue
            self.entries[key] = entry
            total += size


def _layers(cache: DynamicCache) -> list[Any]:
    return list(cache.layers)  # DynamicLayers (see `cacheable`): .keys, .values (B, H, L, D)


def extract_rows(
    cache: DynamicCache, mask_B_L: torch.Tensor, batch_rows: Sequence[int]
) -> list[Entry]:
    """Copy the real positions (mask 1) of some batch rows out of `cache`."""
    out = []
    for b in batch_rows:
        positions = mask_B_L[b].nonzero().squeeze(1)
        keys = [layer.keys[b].index_select(1, positions) for layer in _layers(cache)]
        values = [layer.values[b].index_select(1, positions) for layer in _layers(cache)]
        out.append(Entry(keys, values))
    return out


def past_from_entries(entries: Sequence[Entry]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """A batch cache of `entries`, left-padded to the longest; returns (cache, mask (R, Lc),
    real length (R,)). Padded positions are zeros under mask 0."""
    lengths = torch.tensor([e.length for e in entries], dtype=torch.long)
    width = int(lengths.max())
    mask_R_L = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    layers = []
    for i in range(len(entries[0].keys)):
        pair = []
        for part in ("keys", "values"):
            first = getattr(entries[0], part)[i]
            heads, _, dim = first.shape
            out = first.new_zeros((len(entries), heads, width, dim))
            for r, entry in enumerate(entries):
                out[r, :, width - entry.length :, :] = getattr(entry, part)[i]
            pair.append(out)
        layers.append((pair[0], pair[1]))
    return DynamicCache(ddp_cache_data=layers), mask_R_L, lengths


def merge_batches(
    a: tuple[DynamicCache, torch.Tensor], b: tuple[DynamicCache, torch.Tensor]
) -> tuple[DynamicCache, torch.Tensor]:
    """Stack two (cache, mask) batches of different widths: each left-padded (masked) to the wider."""
    width = max(a[1].shape[1], b[1].shape[1])

    def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - t.shape[dim]
        if missing == 0:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_zeros(shape), t], dim=dim)

    layers = [
        (
            torch.cat([pad(la.keys, 2), pad(lb.keys, 2)]),
            torch.cat([pad(la.values, 2), pad(lb.values, 2)]),
        )
        for la, lb in zip(_layers(a[0]), _layers(b[0]), strict=True)
    ]
    return DynamicCache(ddp_cache_data=layers), torch.cat([pad(a[1], 1), pad(b[1], 1)])
