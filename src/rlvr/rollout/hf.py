"""HF transformers generator: batched sampling with a KV cache, written for CPU throughput.

Over the 500-line guide (~575: issue 34 added device handling, issue 61 the decode speed); the
stop-string check lives in stops.py.

Why not `model.generate`: it returns no behaviour log-probs without a second pass, keeps finished rows in
the batch until the longest one ends, and prefills each prompt once per sample. Here:
- each distinct prompt is prefilled once and its KV cache repeated for its n samples;
- rows that finished (EOS or a stop string) are dropped from the batch and the cache at once;
- matmuls run under bf16 autocast when asked (about 4x the fp32 rate on these CPUs), while the
  softmax / log-probs are taken in fp32;
- with `turn_cache`, inside `turn_session` (the engine's multi-turn rollouts) each conversation's
  KV cache is kept from one turn to the next, so a turn prefills only its new tokens (turn_cache.py),
  under a memory cap (`turn_cache_mb`: MiB, or "auto"); rows past it re-prefill, with a warning;
- with `decode="fast"`, Llama/Qwen2/Qwen3 models run rlvr's own forward over a static KV cache from
  a fused (optionally bf16) copy of the weights instead of HF's layers (fast_decode.py), inside turn
  sessions too (the store's entries fit either cache); other models keep HF's forward.
Sampling draws from a `torch.Generator` owned by this object, whose state is checkpointed, so a resumed
run samples exactly what the uninterrupted run would have.

Devices: every tensor here, and the generator, is made on the model's device (`device_of`), so a
CUDA model samples on its GPU; each decode step brings the batch's tokens, log-probs and end flags to
the host in one transfer. The CPU tunings (`SkinnyLinear`, merging LoRA into temporary fp32 weights,
the fp64 inverse-CDF draw in sampling.py) apply only when the model is on the CPU, where the outputs
are bit-identical to what they were before devices were considered. Stop strings are checked on a
decoded tail of each row (`stop_hit`), not the whole row.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol

import torch
from transformers import DynamicCache

from rlvr.devices import device_of
from rlvr.models import cache_kwarg, matmul_weights_to_fp32
from rlvr.rollout.fast_decode import (
    DecodeWeights,
    StaticDecode,
    decline_reason,
    lora_state,
    stack_decoders,
)
from rlvr.rollout.fastlinear import SkinnyLinear, merged_lora
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.sampling import inverse_cdf_sample, sample_from_logits, shared_prefix_groups
from rlvr.rollout.stops import stop_hit
from rlvr.rollout.turn_cache import (
    Entry,
    TurnCache,
    cacheable,
    extract_rows,
    merge_batches,
    past_from_entries,
    resolve_cap_mb,
    weights_fingerprint,
)

__all__ = ["HFGenerator", "inverse_cdf_sample", "sample_from_logits", "shared_prefix_groups"]


class Decoder(Protocol):
    """One chunk's forward and KV cache: HF's (`HFDecode`) or rlvr's static one (`StaticDecode`)."""

    def forward(
        self, input_ids_B_T: torch.Tensor, attention_B_C: torch.Tensor, positions_B_T: torch.Tensor
    ) -> torch.Tensor:
        """Append T columns per row to the cache; the last column's logits (B, V)."""
        ...

    def repeat_interleave(self, n: int) -> None: ...

    def select(self, index_B: torch.Tensor, order: Sequence[int] | None = None) -> None:
        """Keep rows `index_B` (on the cache's device), in that order; `order`: the same indices
        as a host list, when the caller has them (saves reading `index_B` back)."""
        ...

    def keepable(self) -> bool:
        """Whether rows can be copied out for the cross-turn cache (turn_cache.py)."""
        ...

    def extract(self, mask_B_C: torch.Tensor, batch_rows: Sequence[int]) -> list[Entry]:
        """Copies of these rows' real columns (mask 1), one turn-cache entry each."""
        ...


class HFDecode:
    """HF's forward over a DynamicCache: bf16 autocast when asked, `W @ x^T` matmuls while decoding."""

    def __init__(self, generator: HFGenerator, cache: DynamicCache | None = None) -> None:
        self.generator = generator
        self.cache = cache if cache is not None else DynamicCache()

    def forward(
        self, input_ids_B_T: torch.Tensor, attention_B_C: torch.Tensor, positions_B_T: torch.Tensor
    ) -> torch.Tensor:
        g = self.generator
        decoding = g._decode_context() if input_ids_B_T.shape[1] == 1 else contextlib.nullcontext()
        with g._autocast(), decoding:
            out = g.model(
                input_ids=input_ids_B_T,
                attention_mask=attention_B_C,
                position_ids=positions_B_T,
                **{cache_kwarg(g.model): self.cache},
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1, :]

    def repeat_interleave(self, n: int) -> None:
        if n > 1:
            self.cache.batch_repeat_interleave(n)

    def select(self, index_B: torch.Tensor, order: Sequence[int] | None = None) -> None:
        self.cache.batch_select_indices(index_B)

    def keepable(self) -> bool:
        return cacheable(self.cache)

    def extract(self, mask_B_C: torch.Tensor, batch_rows: Sequence[int]) -> list[Entry]:
        return extract_rows(self.cache, mask_B_C, batch_rows)


class HFGenerator:
    """Generator over an in-process HF causal LM (a plain model or a peft wrapper).

    `decode`: "hf" runs HF's forward; "fast" runs fast_decode.py's for the architectures it
    supports (else HF's, with a warning naming why: `fast_decode_declined`). `decode_dtype` is the
    fast path's weight copy: float32, or bfloat16 (None: bfloat16 exactly when `autocast_bf16`).
    `skinny_linear` and `merge_lora` are CPU tunings: ignored when the model is on another device
    (merging would hold an fp32 copy of every adapted weight there; peft's own path samples).
    The sampler's generator lives on the model's device, seeded with `seed`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        eos_token_ids: set[int],
        *,
        seed: int = 0,
        autocast_bf16: bool = True,
        max_batch_rows: int = 256,
        min_shared_prefix: int = 32,
        skinny_linear: bool = True,
        merge_lora: bool = True,
        turn_cache: bool = False,
        turn_cache_mb: float | Literal["auto"] = "auto",
        decode: Literal["hf", "fast"] = "hf",
        decode_dtype: torch.dtype | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.autocast_bf16 = autocast_bf16
        self.max_batch_rows = max_batch_rows
        self.min_shared_prefix = min_shared_prefix
        self.skinny_linear = skinny_linear
        self.merge_lora = merge_lora
        self.seed = seed
        self.rng = torch.Generator(device=device_of(model)).manual_seed(seed)
        self._rng_used = False  # drawn from or restored: a device change must not reseed it
        self._piece_chars: dict[int, int] = {}  # token id -> its decoded length (`stop_hit`)
        self.turn_cache = turn_cache
        self.turn_cache_mb = turn_cache_mb
        self.turns: TurnCache | None = None  # open inside `turn_session` (turn_cache.py)
        self.turn_stats: dict[str, int] | None = None  # the last session's `TurnCache.stats`
        self._kept: list[tuple[tuple[int, ...], Entry]] = []
        self.decode = decode
        self.decode_dtype = decode_dtype or (torch.bfloat16 if autocast_bf16 else torch.float32)
        self.cuda_graphs = cuda_graphs  # the fast path's decode steps as CUDA graphs, on CUDA
        self.fast_decode_declined: str | None = None  # why the fast path is not taken
        self._fast: DecodeWeights | None = None  # the fast path's weights for this call
        self._fast_weights: DecodeWeights | None = None
        self._fast_key: Any = None  # the policy weights' fingerprint that `_fast_weights` copies
        # Decode forwards and their seconds (sampling and the host read included) since the last
        # `take_decode_stats`: `perf/decode_ms_per_step`, what a GPU's host-bound decode costs.
        self._decode_steps, self._decode_seconds = 0, 0.0

    @contextlib.contextmanager
    def turn_session(self) -> Iterator[TurnCache | None]:
        """Keep each conversation's KV cache from one `generate` call to the next inside the block
        (the engine opens one per multi-turn rollout); everything is dropped on exit. Yields the store
        (its `stats`), or None when `turn_cache` is off. Nested sessions share the outer one. The
        cap: `turn_cache_mb`, "auto" resolved now from the memory free on the model's device."""
        if not self.turn_cache or self.turns is not None:
            yield self.turns
            return
        cap_mb = resolve_cap_mb(self.turn_cache_mb, device_of(self.model))
        self.turns = TurnCache(max_bytes=int(cap_mb * 2**20))
        try:
            yield self.turns
        finally:
            self.turn_stats = dict(self.turns.stats)
            self.turns = None
            self._kept = []

    # The sampler's state travels with checkpoints (see train/checkpoint.py): a host uint8 tensor,
    # the Mersenne Twister's 5056 bytes on the CPU, the Philox seed and offset (16 bytes) on CUDA.
    def get_state(self) -> torch.Tensor:
        return self.rng.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        """Restore `get_state`'s tensor. A state from a generator on another kind of device (a CPU
        run's checkpoint resumed on a GPU, or back) cannot continue its stream there: the generator
        is seeded from the state's bytes instead (deterministic, so two resumes sample alike), with
        a warning."""
        state = state.detach().to("cpu", torch.uint8)
        self._rng_used = True
        if state.numel() == self.rng.get_state().numel():
            self.rng.set_state(state)
            return
        warnings.warn(
            f"generator state of {state.numel()} bytes is another device kind's (this sampler's "
            f"generator is on {self.rng.device}): its stream cannot carry over; seeded from it",
            stacklevel=2,
        )
        self.rng.manual_seed(_seed_from(state))

    def _follow_model(self) -> torch.device:
        """The model's device, with the generator moved there if the model moved since (e.g. to
        a rank's GPU after this object was built): reseeded with `seed` when it was never used,
        else from its state, as `set_state` does across device kinds."""
        device = device_of(self.model)
        if self.rng.device != device:
            seed = _seed_from(self.rng.get_state()) if self._rng_used else self.seed
            self.rng = torch.Generator(device=device).manual_seed(seed)
        return device

    def refresh_weights(self) -> None:
        """The policy's weights changed (the trainer calls this after each update and on resume;
        also before each update, to free the copy's memory for it): the fast path's copy is rebuilt
        at the next `generate`. A fingerprint of the weights is
        checked before every call as well, so a write without this call is seen too."""
        self._fast = self._fast_weights = None
        self._fast_key = None

    def _fast_decode_weights(self) -> DecodeWeights | None:
        """The fast path's weight copy for this call, rebuilt when the weights changed; None when
        HF's forward runs (decode "hf", a model the fast path declines)."""
        if self.decode != "fast":
            return None
        reason = decline_reason(self.model)  # every call: a hook may come and go
        if reason is not None and reason != self.fast_decode_declined:
            warnings.warn(f"decode: fast falls back to HF's forward: {reason}", stacklevel=3)
        self.fast_decode_declined = reason
        if reason is not None:
            return None
        key = (weights_fingerprint(self.model), lora_state(self.model))
        if self._fast_key != key:
            self._fast = self._fast_weights = None  # the old copy goes before the new one is built
            graphs = self.cuda_graphs and device_of(self.model).type == "cuda"
            self._fast_weights = DecodeWeights.build(
                self.model, self.decode_dtype, step_mode="graph" if graphs else "eager"
            )
            self._fast_key = key
        return self._fast_weights

    def take_decode_stats(self) -> dict[str, float]:
        """Decode steps and ms per step since the last call (then counted afresh); {} if none."""
        steps, seconds = self._decode_steps, self._decode_seconds
        self._decode_steps, self._decode_seconds = 0, 0.0
        if not steps:
            return {}
        return {"perf/decode_steps": float(steps), "perf/decode_ms_per_step": 1e3 * seconds / steps}

    def _turn_key(self) -> Any:
        """What the turn store's entries depend on: the weights (`weights_fingerprint`), the LoRA
        adapters' state, and which forward computes them (HF's, or the fast path's copy in its
        dtype: a bf16 copy's keys are not fp32 HF's). `_fast_key` holds the first two already."""
        if self._fast is not None:
            return (self._fast_key, "fast", self._fast.dtype)
        if self.decode == "hf":  # as before the fast path existed
            return weights_fingerprint(self.model)
        return ((weights_fingerprint(self.model), lora_state(self.model)), "hf")

    def _new_decoder(self, reserve: int) -> Decoder:
        """An empty cache for a plain prefill: the fast path's (`reserve` decode columns) or HF's."""
        if self._fast is not None:
            return StaticDecode(self._fast, reserve=reserve)
        return HFDecode(self)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_bf16:
            return torch.autocast(device_of(self.model).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _decode_context(self) -> contextlib.AbstractContextManager[Any]:
        # Few rows per matmul while decoding: the W @ x^T layout is faster there on the CPUs this was
        # measured on (fastlinear.py); a CPU tuning, not applied on other devices.
        if self.skinny_linear and device_of(self.model).type == "cpu":
            return SkinnyLinear()
        return contextlib.nullcontext()

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        if not prompts:
            return []
        # Chunk so that a chunk's prompts x n rows stay under max_batch_rows.
        prompts_per_chunk = max(1, self.max_batch_rows // sampling.n)
        self._kept = []
        self._follow_model()
        self._fast = self._fast_decode_weights()
        if self.turns is not None:
            self.turns.check_weights(self.model, self._turn_key())
        past_cap = self.turns.stats["past_cap"] if self.turns is not None else 0
        out: list[list[Completion]] = []
        for start in range(0, len(prompts), prompts_per_chunk):
            out.extend(self._generate_chunk(prompts[start : start + prompts_per_chunk], sampling))
        if self.turns is not None:  # this call's rows replace the previous call's
            lost = self.turns.stats["past_cap"] - past_cap
            if lost and not self.turns.warned:  # silently slow no more: say so, once
                self.turns.warned = True
                message = self.turns.cap_warning(lost, len(prompts), self.turn_cache_mb)
                warnings.warn(message, stacklevel=2)
            self.turns.replace(self._kept)
            self._kept = []
        return out

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        was_training = self.model.training
        self.model.eval()
        try:
            # LoRA adapters as one merged matmul per layer while sampling (fastlinear.py), on the
            # CPU; the fast path's copy has them merged already.
            on_cpu = device_of(self.model).type == "cpu"
            merge = self.merge_lora and self._fast is None and on_cpu
            if self._fast is None and not self.autocast_bf16 and matmul_weights_to_fp32(self.model):
                warnings.warn(
                    "HF's fp32 forward samples: the LoRA policy's frozen base weights, stored in bf16 "
                    "for the fast path's copy, are fp32 again (their bf16-rounded values)",
                    stacklevel=4,
                )
            with merged_lora(self.model) if merge else contextlib.nullcontext():
                return self._sample(prompts, sampling)
        finally:
            self.model.train(was_training)

    def _sample(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        n = sampling.n
        num_prompts = len(prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("cannot generate from an empty prompt")
        device = device_of(self.model)
        self._rng_used = True
        decoder: Decoder
        if self.turns is not None:
            logits_P_V, mask_P_L, next_pos_P, decoder = self._prefill_turns(
                prompts, self.turns, sampling.max_new_tokens
            )
        else:
            decoder = self._new_decoder(sampling.max_new_tokens)
            logits_P_V, mask_P_L, next_pos_P = self._prefill(prompts, decoder)
        keep_rows = self.turns is not None and decoder.keepable()
        # One prefill per prompt; its cache is shared by the prompt's n samples.
        decoder.repeat_interleave(n)
        logits_B_V = logits_P_V.repeat_interleave(n, dim=0)
        mask_B_L = mask_P_L.repeat_interleave(n, dim=0)
        next_pos_B = next_pos_P.repeat_interleave(n, dim=0)

        rows = num_prompts * n
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs: list[list[float]] = [[] for _ in range(rows)]
        finish: list[str] = ["length"] * rows
        active = list(range(rows))  # row ids still generating, in batch order
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)

        decode_started, decode_steps = time.perf_counter(), 0
        for step in range(sampling.max_new_tokens):
            new_tokens_B, new_logprobs_B = sample_from_logits(logits_B_V, sampling, self.rng)
            done_B = torch.isin(new_tokens_B, eos)
            # One device-to-host transfer per step for the whole batch: token ids (< 2^53) and
            # float32 log-probs are exact in float64.
            step_tokens, step_logprobs, step_done = torch.stack(
                [new_tokens_B.double(), new_logprobs_B.double(), done_B.double()]
            ).tolist()
            keep: list[int] = []
            for b, row in enumerate(active):
                tokens[row].append(int(step_tokens[b]))
                logprobs[row].append(step_logprobs[b])
                if step_done[b] or (sampling.stop and self._hit_stop(tokens[row], sampling.stop)):
                    finish[row] = "stop"
                else:
                    keep.append(b)
            if not keep or step == sampling.max_new_tokens - 1:
                if keep_rows:
                    self._keep(decoder, mask_B_L, range(len(active)), active, prompts, tokens, n)
                break
            if len(keep) < len(active):
                if keep_rows:
                    kept = set(keep)
                    done = [b for b in range(len(active)) if b not in kept]
                    self._keep(decoder, mask_B_L, done, active, prompts, tokens, n)
                # Drop finished rows from the batch and the KV cache right away; survivors from
                # the end fill the holes, so a static cache moves only as many rows as finished.
                order = fill_holes_order(keep)
                index = torch.tensor(order, dtype=torch.long, device=device)
                decoder.select(index, order)
                new_tokens_B = new_tokens_B[index]
                mask_B_L = mask_B_L[index]
                next_pos_B = next_pos_B[index]
                active = [active[b] for b in order]
            mask_B_L = torch.cat([mask_B_L, mask_B_L.new_ones((len(active), 1))], dim=1)
            logits_B_V = decoder.forward(new_tokens_B[:, None], mask_B_L, next_pos_B[:, None])
            next_pos_B = next_pos_B + 1
            decode_steps += 1
        # The loop's last host read synchronised the device: the time is the device's too.
        self._decode_steps += decode_steps
        self._decode_seconds += time.perf_counter() - decode_started

        completions = [
            Completion(
                tuple(tokens[r]), tuple(logprobs[r]), "stop" if finish[r] == "stop" else "length"
            )
            for r in range(rows)
        ]
        return [completions[i * n : (i + 1) * n] for i in range(num_prompts)]

    def _keep(
        self,
        decoder: Decoder,
        mask_B_L: torch.Tensor,
        batch_rows: Sequence[int],
        active: list[int],
        prompts: Sequence[Sequence[int]],
        tokens: list[list[int]],
        n: int,
    ) -> None:
        """Store finished rows for the next turn: the cache holds the prompt and every sampled token
        but the last (sampled, never fed)."""
        entries = decoder.extract(mask_B_L, batch_rows)
        for b, entry in zip(batch_rows, entries, strict=True):
            row = active[b]
            key = (*prompts[row // n], *tokens[row][:-1])
            assert len(key) == entry.length, (len(key), entry.length)
            self._kept.append((tuple(int(t) for t in key), entry))

    def _prefill_turns(
        self, prompts: Sequence[Sequence[int]], turns: TurnCache, reserve: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Decoder]:
        """`_prefill`, but prompts that extend a stored conversation prefill only their new tokens;
        the others take the plain path and the two batches are stacked (masked left padding).
        `reserve`: the decode steps' columns (the fast path's static cache)."""
        matches = [turns.match(p) for p in prompts]
        hit = [i for i, e in enumerate(matches) if e is not None]
        miss = [i for i, e in enumerate(matches) if e is None]
        reused = [matches[i] for i in hit]
        turns.stats["hits"] += len(hit)
        turns.stats["misses"] += len(miss)
        turns.stats["reused_tokens"] += sum(e.length for e in reused if e is not None)
        turns.stats["prefilled_tokens"] += sum(len(p) for p in prompts) - sum(
            e.length for e in reused if e is not None
        )
        if miss and turns.dropped:  # which misses the cap caused (HFGenerator.generate warns)
            turns.count_past_cap([prompts[i] for i in miss])
        if not hit:
            decoder = self._new_decoder(reserve)
            return (*self._prefill(prompts, decoder), decoder)
        entries = [e for e in reused if e is not None]
        tails = [list(prompts[i][e.length :]) for i, e in zip(hit, entries, strict=True)]
        past: Decoder
        if self._fast is not None:
            extra = max(len(t) for t in tails)
            past, past_mask, past_length = StaticDecode.from_entries(
                self._fast, entries, reserve, extra
            )
        else:
            cache, past_mask, past_length = past_from_entries(entries)
            past = HFDecode(self, cache)
        logits, mask, next_pos = self._prefill_plain(tails, past, past_mask, past_length)
        if not miss:
            return logits, mask, next_pos, past
        fresh = self._new_decoder(reserve)
        logits_m, mask_m, next_m = self._prefill([prompts[i] for i in miss], fresh)
        merged: Decoder
        if isinstance(past, StaticDecode) and isinstance(fresh, StaticDecode):
            merged, mask = stack_decoders((past, mask), (fresh, mask_m))
        else:
            assert isinstance(past, HFDecode) and isinstance(fresh, HFDecode)
            both, mask = merge_batches((past.cache, mask), (fresh.cache, mask_m))
            merged = HFDecode(self, both)
        # Back to prompt order: the inverse of the permutation hit + miss.
        order = sorted(range(len(prompts)), key=(hit + miss).__getitem__)
        inverse = torch.tensor(order, dtype=torch.long, device=device_of(self.model))
        merged.select(inverse, order)
        return (
            torch.cat([logits, logits_m])[inverse],
            mask[inverse],
            torch.cat([next_pos, next_m])[inverse],
            merged,
        )

    def _prefill(
        self, prompts: Sequence[Sequence[int]], decoder: Decoder
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the prompts into `decoder`'s cache; returns (last logits (P, V), attention mask (P, L), next
        position (P,)). Consecutive prompts that share a long prefix (the G conversations of one
        task after its first turn) prefill that prefix once, then only their own suffixes."""
        groups = shared_prefix_groups(prompts, self.min_shared_prefix)
        if all(len(members) == 1 for _, members in groups):
            return self._prefill_plain(prompts, decoder)
        prefixes = [list(prompts[members[0]][:length]) for length, members in groups]
        _, prefix_mask_Q_L, prefix_next_Q = self._prefill_plain(prefixes, decoder)
        row_prefix = [q for q, (_, members) in enumerate(groups) for _ in members]
        index = torch.tensor(row_prefix, dtype=torch.long, device=device_of(self.model))
        decoder.select(index, row_prefix)
        suffixes = [list(prompts[i][length:]) for length, members in groups for i in members]
        # Suffixes left-padded after their prefix: the padding sits in the middle, masked out.
        return self._prefill_plain(
            suffixes,
            decoder,
            past_mask=prefix_mask_Q_L.index_select(0, index),
            past_length=prefix_next_Q.index_select(0, index),
        )

    def _prefill_plain(
        self,
        prompts: Sequence[Sequence[int]],
        decoder: Decoder,
        past_mask: torch.Tensor | None = None,
        past_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-pad and run `prompts` (continuing rows already in `decoder`'s cache when `past_mask`, (P, Lc),
        and `past_length`, (P,) real tokens so far, are given)."""
        # Left padding, so the newest token of every row sits in the last column. Padded on the
        # host, one copy per tensor to the model's device.
        max_len = max(len(p) for p in prompts)
        device = device_of(self.model)
        ids = [[self.pad_token_id] * (max_len - len(p)) + [int(t) for t in p] for p in prompts]
        bits = [[0] * (max_len - len(p)) + [1] * len(p) for p in prompts]
        input_ids_P_L = torch.tensor(ids, dtype=torch.long, device=device)
        mask_P_L = torch.tensor(bits, dtype=torch.long, device=device)
        positions_P_L = (mask_P_L.cumsum(dim=1) - 1).clamp(min=0)
        attention_P_L = mask_P_L
        next_P = mask_P_L.sum(dim=1)  # real tokens so far (also right for an all-padding row: 0)
        if past_mask is not None and past_length is not None:
            attention_P_L = torch.cat([past_mask, mask_P_L], dim=1)
            positions_P_L = positions_P_L + past_length[:, None]
            next_P = next_P + past_length
        logits_P_V = decoder.forward(input_ids_P_L, attention_P_L, positions_P_L)
        return logits_P_V, attention_P_L, next_P

    def _hit_stop(self, row_tokens: list[int], stops: tuple[str, ...]) -> bool:
        return stop_hit(self.tokenizer, row_tokens, stops, self._piece_chars)


def _seed_from(state: torch.Tensor) -> int:
    """A 63-bit seed from a generator state's bytes (`HFGenerator.set_state` across device kinds)."""
    digest = hashlib.sha256(state.to("cpu", torch.uint8).numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def fill_holes_order(keep: Sequence[int]) -> list[int]:
    """The new batch order when only the (ascending) batch positions `keep` survive: a survivor
    already within the first len(keep) positions stays where it is, and the survivors beyond fill
    the holes, in order. So compacting a static cache in place moves one row per finished row,
    not every row after the first finished one. E.g. keep [1, 2, 4, 5] -> [4, 1, 2, 5]."""
    size = len(keep)
    staying = {b for b in keep if b < size}
    movers = iter(b for b in keep if b >= size)
    return [b if b in staying else next(movers) for b in range(size)]
