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
The store holds at most `max_bytes` (`generator.turn_cache_mb`; `auto`: `auto_cap_mb` when the
session opens); rows past the cap are not kept (their next turn prefills in full, counted in
`stats["past_cap"]`, and HFGenerator warns once per session: `cap_warning`). The whole store is
dropped when the weights change (a parameter's version counter or a checksum of the trainable
weights moved: `weights_fingerprint`), when the forward that computed the entries changes (HF's or
the fast path's, its copy's dtype, LoRA adapters switched: the key HFGenerator passes to
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
from typing import Any, Literal

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

# `turn_cache_mb: auto`: this share of the memory free when a session opens. 20%, not more: while a
# turn runs, the stored rows, the padded cache built from them and the rows copied out after it are
# alive together (a 200-episode sokoban eval with a 12000 MiB cap peaked at ~19-20 GB RSS, about 3x
# the stored bytes, on a 24 GB host).
AUTO_SHARE = 0.2
AUTO_FLOOR_MB = 1024.0  # and never less than this (the fixed cap before `auto`)


def meminfo_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def free_bytes(device: torch.device) -> int | None:
    """Memory free for the store's entries, which live on `device`: a CUDA device's free memory
    (plus what torch's allocator holds unused), else the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + unused)
    return meminfo_available_bytes()


def auto_cap_mb(device: torch.device) -> float:
    """`turn_cache_mb: auto`: AUTO_SHARE of the memory free now, at least AUTO_FLOOR_MB."""
    free = free_bytes(device)
    return AUTO_FLOOR_MB if free is None else max(AUTO_FLOOR_MB, AUTO_SHARE * free / 2**20)


def resolve_cap_mb(setting: float | Literal["auto"], device: torch.device) -> float:
    """The cap in MiB: a number as given, `auto` as `auto_cap_mb` says."""
    return auto_cap_mb(device) if setting == "auto" else float(setting)


def weights_fingerprint(model: Any) -> Fingerprint:
    """Every parameter's identity and version counter (bumped by in-place writes: `copy_`,
    `load_state_dict`, most optimizers), and a strided checksum of the trainable ones (torch's fused
    AdamW writes without bumping the counters). An update moves nearly every trainable element, so
    one in 61 sampled elements catches it; the checksum reads ~2% of the weights."""
    params = list(model.parameters())
    checksum = 0.0
    with torch.no_grad():
        sums = [
            p.detach().reshape(-1)[::61].double().sum()
            for p in params
            if p.requires_grad and p.numel()
        ]
        if sums:  # one read-back, not one per parameter (each a wait on a GPU)
            checksum = float(torch.stack([s.to(sums[0].device) for s in sums]).sum())
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
            (
                "hits",
                "misses",
                "reused_tokens",
                "prefilled_tokens",
                "not_kept",  # rows the last `replace` calls could not keep (the cap)
                "past_cap",  # prompts prefilled in full because their row was not kept
                "invalidated",
            ),
            0,
        )
    )
    # The last `replace`: keys of the rows past the cap, how many rows it was given, their bytes.
    dropped: set[tuple[int, ...]] = field(default_factory=set)
    rows: int = 0
    rows_bytes: int = 0
    warned: bool = False  # HFGenerator warns once per session (`cap_warning`)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def check_weights(self, model: Any, key: Any = None) -> None:
        """Drop everything when the weights moved since the entries were computed (`key`: the
        caller's fingerprint of the weights and of the forward that will run; default
        `weights_fingerprint(model)`)."""
        fingerprint = key if key is not None else weights_fingerprint(model)
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            self.dropped.clear()  # their misses are the weights' doing now, not the cap's
            if self.entries:
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
        self.dropped = set()
        self.rows, self.rows_bytes = len(rows), 0
        total = 0
        for key, entry in rows:
            size = entry.nbytes
            self.rows_bytes += size
            if total + size > self.max_bytes:
                self.stats["not_kept"] += 1
                self.dropped.add(key)
                continue
            self.entries[key] = entry
            total += size

    def count_past_cap(self, misses: Sequence[Sequence[int]]) -> int:
        """How many of these prompts (no stored match) extend a row the cap dropped last call;
        added to `stats["past_cap"]`."""
        lengths = sorted({len(k) for k in self.dropped}, reverse=True)
        count = 0
        for prompt in misses:
            p = tuple(prompt)
            count += any(n < len(p) and p[:n] in self.dropped for n in lengths)
        self.stats["past_cap"] += count
        return count

    def cap_warning(self, lost: int, prompts: int, setting: float | str) -> str:
        """The one-line warning for `lost` of `prompts` conversations prefilled in full this call
        because the cap dropped their rows (numbers from the last `replace`)."""
        cap = size_text(self.max_bytes)
        if setting == "auto":
            cap += f" (auto: {AUTO_SHARE:.0%} of the memory free when the rollout began)"
        kept = self.rows - len(self.dropped)
        more = size_text(max(0, self.rows_bytes - self.max_bytes))
        return (
            f"generator.turn_cache: {lost} of {prompts} conversations re-prefill their whole "
            f"conversation this turn: the cross-turn KV cache's cap of {cap} kept {kept} of the "
            f"last turn's {self.rows} rows ({size_text(self.rows_bytes)} of keys and values; "
            f"~{more} more would have kept them all). Raise generator.turn_cache_mb (MiB) for "
            f"faster multi-turn rollouts (same results); warned once per rollout."
        )


def size_text(nbytes: float) -> str:
    """Bytes for a message: whole MiB from 10 MiB, one decimal below, KiB under 1 MiB."""
    mib = nbytes / 2**20
    if mib >= 10:
        return f"{mib:.0f} MiB"
    return f"{mib:.1f} MiB" if mib >= 1 else f"{nbytes / 2**10:.0f} KiB"


def _layers(cache: DynamicCache) -> list[Any]:
    return list(cache.layers)  # DynamicLayers (see `cacheable`): .keys, .values (B, H, L, D)


def real_columns(mask_B_L: torch.Tensor, batch_rows: Sequence[int]) -> list[torch.Tensor]:
    """Each row's real columns (mask 1), as index tensors on the mask's device: the rows' mask is
    read back to the host once for all of them (`nonzero` on a GPU would wait once per row)."""
    if not batch_rows:
        return []
    rows = list(batch_rows)
    index = torch.tensor(rows, dtype=torch.long, device=mask_B_L.device)
    host = mask_B_L.index_select(0, index).cpu()
    return [host[i].nonzero().squeeze(1).to(mask_B_L.device) for i in range(len(rows))]


def left_padded_mask(
    lengths: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (R, W) with each row's `lengths[r]` ones at the right, W = the longest; lengths (R,)),
    both long tensors on `device`."""
    width = max(lengths)
    bits = [[0] * (width - n) + [1] * n for n in lengths]
    return (
        torch.tensor(bits, dtype=torch.long, device=device),
        torch.tensor(list(lengths), dtype=torch.long, device=device),
    )


def extract_rows(
    cache: DynamicCache, mask_B_L: torch.Tensor, batch_rows: Sequence[int]
) -> list[Entry]:
    """Copy the real positions (mask 1) of some batch rows out of `cache`."""
    out = []
    for b, positions in zip(batch_rows, real_columns(mask_B_L, batch_rows), strict=True):
        keys = [layer.keys[b].index_select(1, positions) for layer in _layers(cache)]
        values = [layer.values[b].index_select(1, positions) for layer in _layers(cache)]
        out.append(Entry(keys, values))
    return out


def past_from_entries(entries: Sequence[Entry]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """A batch cache of `entries`, left-padded to the longest; returns (cache, mask (R, Lc),
    real length (R,)). Padded positions are zeros under mask 0."""
    mask_R_L, lengths = left_padded_mask([e.length for e in entries], entries[0].keys[0].device)
    width = mask_R_L.shape[1]
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
