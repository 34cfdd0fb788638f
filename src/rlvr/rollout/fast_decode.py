"""rlvr's own decode path for Llama (SmolLM2) and Qwen2/Qwen3: a plain-torch forward over a static
KV cache, instead of HF's layer code.

Over the 500-line guide (~550): the weight copy, the static cache it feeds and the layer loop over
it are one unit (the fixed-shape step for CUDA graphs lives apart, in decode_graphs.py).

Why: HF's layers issue ~1200 small ops per decode step (SmolLM2, 30 layers: a DynamicCache that
grows by `cat`, a mask rebuilt each step, GQA by copying K/V), so at 16 rows a step took ~2.5x its
matmul time here (docs/performance.md). Here the new keys and values are written into a cache
preallocated for the whole call; GQA needs no copy (the query heads sharing a KV head become extra
query rows of one attention call); the mask is built once per step for every layer; rows that finish
leave the cache by moving one row each (HFGenerator orders the survivors, `fill_holes_order`).

The weights (`DecodeWeights`, built from the policy once per weight version): in float32 the
policy's own matrices, no copy (fusing q/k/v and gate/up into one matrix each saved ~2% of a step
here, not worth a second float32 copy of them); in bfloat16, on hosts with native bf16, a fused
copy, half the bytes a decode step reads (residual stream, norms and RoPE in float32, matmul
inputs rounded to bf16 and outputs read as float32, as bf16 autocast does; the KV cache and
attention in bf16: at 64 rows a float32 cache outweighed the bf16 weights, +10% tokens/s). LoRA
adapters are merged into a new matrix (`W + scale * B @ A`; the policy's are never written). The
copy is rebuilt when the policy's weights change (`HFGenerator.refresh_weights`, called once a
step's rollouts are in, so the update runs without it; and a fingerprint check every `generate`).

The cache is [layers, 2 (K, V), rows, kv_heads, columns, head_dim]. Its columns are exactly those of
HFGenerator's attention mask: prompts left-padded to the longest, then one column per decode step;
padded columns are masked for every query, and each query sees the columns up to its own. Position
ids come from the caller (the mask's cumulative sum, as HFGenerator computes them for HF), so the
two paths see the same positions and the same keys. Tested against HF's forward token for token
(tests/test_fast_decode.py).

Inside a turn session (the cross-turn cache, turn_cache.py) this path keeps its rows in the same
store as HF's: `StaticDecode.extract` copies a finished row's real columns out as per-layer
(kv_heads, length, head_dim) keys and values, `StaticDecode.from_entries` builds the next turn's
cache from them (left-padded, with room for the new tokens and the decode steps), and
`stack_decoders` joins those rows with the plain prefill of prompts that missed. HFGenerator drops
the store when the copy's dtype or the forward changes (`HFGenerator._turn_key`).

`decline_reason(model)` says why a model cannot take this path (another architecture, a sliding
window, a dynamic RoPE, a LoRA variant, forward hooks); HFGenerator then uses HF's. Not here (yet):
torch.compile (without `freezing` it gained nothing on CPU, docs/performance.md). On CUDA a decode
step can be replayed as a CUDA graph (`generator.cuda_graphs`, rollout/decode_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlvr.rollout.decode_graphs import StaticSteps
from rlvr.rollout.fastlinear import mergeable, merged_linear
from rlvr.rollout.turn_cache import Entry, left_padded_mask, real_columns

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# RoPE types whose inverse frequencies are fixed at load time (HF recomputes "dynamic" and
# "longrope" from the sequence length): the model's own `inv_freq` and `attention_scaling` are used.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SKINNY_MAX_ROWS = 256  # below this many rows a matmul runs as W @ x^T (fastlinear.py)


def _inner(model: Any) -> Any:
    """The transformers model under a peft wrapper (peft replaces its linear layers in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decline_reason(model: Any) -> str | None:
    """Why `model` cannot take the fast path (None: it can)."""
    inner = _inner(model)
    name = type(inner).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(ARCHITECTURES)}"
    config = inner.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act} (only silu)"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention layers"
    rope_type = getattr(inner.model.rotary_emb, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)})"
    if type(inner.model.embed_tokens) is not torch.nn.Embedding:
        return f"input embedding is a {type(inner.model.embed_tokens).__name__}"
    for module_name, module in inner.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"forward hooks on {module_name or 'the model'} (only HF's forward runs them)"
    for layer in inner.model.layers[: config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            if not mergeable(module):
                return f"attention projection is a {type(module).__name__} (LoRA variant?)"
        for module in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if not mergeable(module):
                return f"MLP projection is a {type(module).__name__} (LoRA variant?)"
    if not mergeable(inner.lm_head):
        return f"lm_head is a {type(inner.lm_head).__name__}"
    return None


def lora_state(model: Any) -> tuple[tuple[bool, bool, tuple[str, ...]], ...]:
    """Per LoRA layer (adapters disabled, merged, active adapters): what the merged copy depends on
    beyond the weights themselves (the KL reference runs with adapters disabled)."""
    state = []
    for module in model.modules():
        if hasattr(module, "lora_A") and hasattr(module, "disable_adapters"):
            active = tuple(module.active_adapters)
            state.append((bool(module.disable_adapters), bool(module.merged), active))
    return tuple(state)


@dataclass
class LayerWeights:
    """One decoder layer. Matrices (out, in): the policy's own float32 tensors or a bf16 copy;
    biases and norms float32."""

    attn_norm: torch.Tensor  # (hidden,)
    # The q, k, v projections' matrices: one fused ((heads + 2 kv_heads) * head_dim, hidden) matrix
    # in a bf16 copy, or the policy's own three float32 matrices (no copy: fusing saved ~2% of a
    # decode step here and would hold a second float32 copy of them).
    qkv: tuple[torch.Tensor, ...]
    qkv_bias: torch.Tensor | None  # one vector over the three outputs
    q_norm: torch.Tensor | None  # (head_dim,), Qwen3
    k_norm: torch.Tensor | None
    o: torch.Tensor  # (hidden, heads * head_dim)
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: tuple[torch.Tensor, ...]  # (2 intermediate, hidden) fused, or (gate, up) as qkv
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # (hidden, intermediate)
    down_bias: torch.Tensor | None


@dataclass
class DecodeWeights:
    """The decode path's copy of a model's weights (module docstring), with the shapes it needs."""

    layers: list[LayerWeights]
    embed: torch.Tensor  # (vocab, hidden) the model's own: a lookup reads (and casts) its rows
    final_norm: torch.Tensor
    head: torch.Tensor  # (vocab, hidden)
    inv_freq: torch.Tensor  # (head_dim / 2,) float32, the model's own RoPE frequencies
    rope_scaling: float  # HF's `attention_scaling` (1.0 except yarn)
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    dtype: torch.dtype
    # How a decode step (one new column) runs: "eager" (below), "static" (fixed shapes per row
    # bucket, eagerly: the CPU test of the graph's body) or "graph" (that body captured as a CUDA
    # graph per bucket and replayed: rollout/decode_graphs.py). Prefills are always eager.
    step_mode: str = "eager"

    @property
    def bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads (every matrix once; the embedding lookup reads
        only its rows and is not counted)."""
        tensors = [self.head] + [
            t for lw in self.layers for t in (*lw.qkv, lw.o, *lw.gate_up, lw.down)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    @torch.no_grad()
    def build(
        cls, model: Any, dtype: torch.dtype = torch.float32, step_mode: str = "eager"
    ) -> DecodeWeights:
        """Copy `model`'s current weights (LoRA merged) for decoding in `dtype` (float32 or
        bfloat16), its decode steps run as `step_mode` says. The caller checked
        `decline_reason(model) is None`."""
        inner = _inner(model)
        config = inner.config
        first = inner.model.layers[0].self_attn

        def matrices(*modules: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
            pairs = [merged_linear(m) for m in modules]
            weights = [p[0] for p in pairs if p is not None]
            biases = [p[1] for p in pairs if p is not None]
            assert len(weights) == len(modules), "decline_reason should have refused this model"
            # The policy's own tensors where they are in `dtype` already (float32 weights for a
            # float32 path; bf16 weights of model.precision: lean or fsdp's bf16 sampling copy):
            # no copy (a LoRA layer's merged matrix is new). Else (bf16 from float32): one fused
            # copy.
            if dtype == torch.float32 or all(w.dtype == dtype for w in weights):
                parts = tuple(w.to(dtype).contiguous() for w in weights)
            else:
                fused = weights[0] if len(weights) == 1 else torch.cat(weights)
                parts = (fused.to(dtype).contiguous(),)
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [
                        b.float() if b is not None else w.new_zeros(w.shape[0], dtype=torch.float32)
                        for w, b in zip(weights, biases, strict=True)
                    ]
                )
            return parts, bias

        def matrix(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            (weight,), bias = matrices(module)
            return weight, bias

        def vector(module: Any) -> torch.Tensor:
            return module.weight.detach().float()

        layers = []
        for layer in inner.model.layers[: config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = matrices(attn.q_proj, attn.k_proj, attn.v_proj)
            o, o_bias = matrix(attn.o_proj)
            gate_up, gate_up_bias = matrices(mlp.gate_proj, mlp.up_proj)
            down, down_bias = matrix(mlp.down_proj)
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            layers.append(
                LayerWeights(
                    attn_norm=vector(layer.input_layernorm),
                    qkv=qkv,
                    qkv_bias=qkv_bias,
                    q_norm=vector(q_norm) if q_norm is not None else None,
                    k_norm=vector(k_norm) if k_norm is not None else None,
                    o=o,
                    o_bias=o_bias,
                    mlp_norm=vector(layer.post_attention_layernorm),
                    gate_up=gate_up,
                    gate_up_bias=gate_up_bias,
                    down=down,
                    down_bias=down_bias,
                )
            )
        head, _ = matrix(inner.lm_head)
        rotary = inner.model.rotary_emb
        return cls(
            layers=layers,
            embed=inner.model.embed_tokens.weight.detach(),  # rows cast as they are looked up
            final_norm=vector(inner.model.norm),
            head=head,
            inv_freq=rotary.inv_freq.detach().float(),
            rope_scaling=float(rotary.attention_scaling),
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=first.head_dim,
            eps=float(inner.model.norm.variance_epsilon),
            dtype=dtype,
            step_mode=step_mode,
        )


def _linear_parts(
    x: torch.Tensor, parts: tuple[torch.Tensor, ...], bias: torch.Tensor | None
) -> torch.Tensor:
    """`_linear` over matrices whose outputs are concatenated (one fused matrix, or q/k/v)."""
    if len(parts) == 1:
        return _linear(x, parts[0], bias)
    out = torch.cat([_linear(x, part, None) for part in parts], dim=-1)
    return out + bias if bias is not None else out


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) float32 -> (..., out) float32, the matmul in the weight's dtype (W @ x^T when x
    has few rows, as fastlinear.SkinnyLinear does for HF's layers)."""
    flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    if flat.shape[0] <= SKINNY_MAX_ROWS:
        # (W @ x^T)^T brought back to row-major by the same copy that casts a bf16 product to
        # float32: one copy, not two (casts and copies were ~22% of a 64-row bf16 step; +2.5%).
        out = (
            torch.mm(weight, flat.t()).t().to(torch.float32, memory_format=torch.contiguous_format)
        )
    else:
        out = F.linear(flat, weight).float()
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm in float32 (same operations in the same order): x (..., d), weight (d,)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _rotate(
    x_B_T_H_D: torch.Tensor, cos_B_T_1_D: torch.Tensor, sin_B_T_1_D: torch.Tensor
) -> torch.Tensor:
    """RoPE in HF's half-split convention: x * cos + rotate_half(x) * sin."""
    half = x_B_T_H_D.shape[-1] // 2
    rotated = torch.cat((-x_B_T_H_D[..., half:], x_B_T_H_D[..., :half]), dim=-1)
    return x_B_T_H_D * cos_B_T_1_D + rotated * sin_B_T_1_D


class StaticDecode:
    """One `generate` chunk's decode state: a preallocated KV cache and the forward over it.

    Same three calls as HFGenerator's HF path: `forward` (append columns and return the last
    column's logits), `repeat_interleave` (n samples per prefilled prompt), `select` (drop finished
    rows). `reserve` columns are kept free past each prefill, so the decode steps never reallocate.
    """

    def __init__(self, weights: DecodeWeights, reserve: int) -> None:
        self.w = weights
        self.reserve = reserve
        self.kv: torch.Tensor | None = None  # (layers, 2, rows, kv_heads, capacity, head_dim)
        self.rows = 0
        self.length = 0  # columns filled
        device = weights.embed.device
        self._cos = torch.empty(
            0, device=device
        )  # (positions, head_dim) RoPE tables, grown on demand
        self._sin = torch.empty(0, device=device)
        self._steps: StaticSteps | None = None  # fixed-shape decode steps (step_mode != "eager")

    def _ensure(self, rows: int, columns: int) -> torch.Tensor:
        """The cache with room for `columns` columns of `rows` rows (reallocated at a prefill that
        outgrows it: the first, or a suffix after a shared prefix)."""
        if self.kv is None:
            self.rows = rows
        assert rows == self.rows, (rows, self.rows)
        if self.kv is not None and self.kv.shape[4] >= columns:
            return self.kv
        kv = self._allocate(rows, columns + self.reserve)
        if self.kv is not None:
            kv[:, :, :, :, : self.length] = self.kv[:, :, : self.rows, :, : self.length]
        self.kv = kv
        return kv

    def _allocate(self, rows: int, capacity: int) -> torch.Tensor:
        """An uninitialised cache in the weights' dtype: every column is written (a prefill, a
        decode step, a copy, or zeros for padding) before anything reads it."""
        w = self.w
        shape = (len(w.layers), 2, rows, w.kv_heads, capacity, w.head_dim)
        return torch.empty(shape, dtype=w.dtype, device=w.embed.device)

    def _rope(self, positions_B_T: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, 1, head_dim) at these positions: the same float32 products and cos/sin
        as HF's rotary embedding, looked up from a table instead of recomputed per layer. The table
        covers `columns` positions: a position id counts a row's real tokens, so it is below the
        mask's column count (known on the host: no read-back of the positions each step)."""
        needed = columns
        if self._cos.shape[0] < needed:
            size = max(needed, 2 * self._cos.shape[0], 256)
            index = torch.arange(size, dtype=torch.float32, device=self.w.inv_freq.device)
            freqs = index[:, None] * self.w.inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            self._cos = angles.cos() * self.w.rope_scaling
            self._sin = angles.sin() * self.w.rope_scaling
        return self._cos[positions_B_T][:, :, None, :], self._sin[positions_B_T][:, :, None, :]

    @torch.no_grad()
    def forward(
        self,
        input_ids_B_T: torch.Tensor,
        attention_B_C: torch.Tensor,
        positions_B_T: torch.Tensor,
    ) -> torch.Tensor:
        """Run T new columns per row; returns the last column's logits (B, V) float32.

        attention_B_C: 1 for real tokens, 0 for padding, over every column so far (the C - T cached
        ones, then the T new ones), exactly HF's attention_mask; positions_B_T: their position ids.
        """
        w = self.w
        rows, new = input_ids_B_T.shape
        columns = attention_B_C.shape[1]
        start = columns - new
        assert start == self.length, (start, self.length)
        if new == 1 and w.step_mode != "eager":  # a decode step at fixed shapes (CUDA graphs)
            return self._static_steps().step(input_ids_B_T, attention_B_C, positions_B_T)
        kv = self._ensure(rows, columns)
        groups = w.heads // w.kv_heads

        # A query sees the real columns up to its own, and always itself: a padding query with no
        # real column before it would otherwise get an all-masked row (NaN), and its NaN keys and
        # values would reach real queries through a 0-weight product. Shared by every layer.
        key_col = torch.arange(columns, device=attention_B_C.device)
        query_col = start + torch.arange(new, device=attention_B_C.device)
        causal_T_C = key_col[None, :] <= query_col[:, None]
        allowed_B_T_C = (attention_B_C.bool()[:, None, :] & causal_T_C) | (
            key_col[None, :] == query_col[:, None]
        )
        # Grouped queries: row g * T + t of KV head k is query head k * groups + g at column t.
        mask = (
            allowed_B_T_C[:, None, None]
            .expand(rows, 1, groups, new, columns)
            .reshape(rows, 1, groups * new, columns)
        )
        cos, sin = self._rope(positions_B_T, columns)

        def write(index: int, k_B_K_T_D: torch.Tensor, v_B_K_T_D: torch.Tensor) -> None:
            kv[index, 0, :rows, :, start:columns] = k_B_K_T_D
            kv[index, 1, :rows, :, start:columns] = v_B_K_T_D

        x = w.embed[input_ids_B_T].float()  # (B, T, hidden) float32: the residual stream
        logits = self._layers(x, cos, sin, mask, write, kv[:, :, :rows, :, :columns])
        self.length = columns
        return logits

    def _layers(
        self,
        x_B_T_H: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        write: Any,
        kv_view: torch.Tensor,
    ) -> torch.Tensor:
        """The decoder layers over T new columns of B rows, then the head on the last column:
        `write(layer, k, v)` stores the new keys and values ((B, kv_heads, T, head_dim)) in the
        cache, whose columns the queries then attend over as `kv_view` ((layers, 2, B, kv_heads,
        columns, head_dim)) under `mask` ((B, 1, groups * T, columns), True = may attend)."""
        w, x = self.w, x_B_T_H
        rows, new = x.shape[:2]
        groups = w.heads // w.kv_heads
        q_size, kv_size = w.heads * w.head_dim, w.kv_heads * w.head_dim
        for index, lw in enumerate(w.layers):
            h = _rms_norm(x, lw.attn_norm, w.eps)
            qkv = _linear_parts(h, lw.qkv, lw.qkv_bias)
            q = qkv[..., :q_size].reshape(rows, new, w.heads, w.head_dim)
            k = qkv[..., q_size : q_size + kv_size].reshape(rows, new, w.kv_heads, w.head_dim)
            v = qkv[..., q_size + kv_size :].reshape(rows, new, w.kv_heads, w.head_dim)
            if lw.q_norm is not None and lw.k_norm is not None:  # Qwen3: per head, before RoPE
                q = _rms_norm(q, lw.q_norm, w.eps)
                k = _rms_norm(k, lw.k_norm, w.eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            write(index, k.transpose(1, 2), v.transpose(1, 2))
            q_grouped = (
                q.transpose(1, 2)
                .reshape(rows, w.kv_heads, groups, new, w.head_dim)
                .reshape(rows, w.kv_heads, groups * new, w.head_dim)
                .to(kv_view.dtype)
            )
            attended = F.scaled_dot_product_attention(
                q_grouped,
                kv_view[index, 0],
                kv_view[index, 1],
                attn_mask=mask,
                scale=w.head_dim**-0.5,
            )  # (B, kv_heads, groups * T, head_dim)
            attended = (
                attended.reshape(rows, w.heads, new, w.head_dim)
                .transpose(1, 2)
                .reshape(rows, new, q_size)
            )
            x = x + _linear(attended, lw.o, lw.o_bias)
            h = _rms_norm(x, lw.mlp_norm, w.eps)
            gate_up = _linear_parts(h, lw.gate_up, lw.gate_up_bias)
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, lw.down, lw.down_bias)
        last = _rms_norm(x[:, -1], w.final_norm, w.eps)
        return _linear(last, w.head, None)

    def _static_steps(self) -> StaticSteps:
        """This cache's fixed-shape decode steps, made anew when the cache was reallocated."""
        if self._steps is None or not self._steps.serves(self):
            self._steps = StaticSteps(self, graphs=self.w.step_mode == "graph")
        return self._steps

    def repeat_interleave(self, n: int) -> None:
        """Each row becomes n consecutive rows (a prompt's n samples share its prefill)."""
        if self.kv is None or n == 1:
            return
        kv = self.kv
        repeated = torch.empty(
            (*kv.shape[:2], self.rows * n, *kv.shape[3:]), dtype=kv.dtype, device=kv.device
        )
        filled = kv[:, :, : self.rows, :, : self.length]
        repeated[:, :, :, :, : self.length] = filled.repeat_interleave(n, dim=2)
        self.kv, self.rows = repeated, self.rows * n

    def select(self, index_B: torch.Tensor, order: Sequence[int] | None = None) -> None:
        """Rows become rows `index_B` of the old ones, in that order: finished rows dropped
        (compacted in place over the filled columns), or a shared prefix gathered for the prompts
        that continue it (an index may repeat; a new allocation when there are more rows).
        `order`: `index_B` as a host list, when the caller has it (no read-back from the device)."""
        if self.kv is None:
            return
        rows = int(index_B.numel())
        if rows <= self.rows:
            # Rows dropped (HFGenerator orders the survivors so few move): copy only the rows whose
            # position changes. The right side is gathered before anything is written.
            if order is None:
                order = index_B.tolist()
            changed = [i for i, b in enumerate(order) if b != i]
            if changed:
                moved = torch.tensor(changed, dtype=torch.long, device=index_B.device)
                filled = self.kv[:, :, :, :, : self.length]
                filled[:, :, moved] = filled[:, :, index_B[moved]]
            self.rows = rows
            return
        gathered = self.kv[:, :, :, :, : self.length][:, :, index_B]
        if rows > self.kv.shape[2]:
            self.kv = torch.empty(
                (*self.kv.shape[:2], rows, *self.kv.shape[3:]),
                dtype=self.kv.dtype,
                device=self.kv.device,
            )
        self.kv[:, :, :rows, :, : self.length] = gathered
        self.rows = rows

    # The cross-turn cache (turn_cache.py) stores a row as per-layer (kv_heads, length, head_dim)
    # keys and values: the layout HF's DynamicCache rows have too, and a slice of this cache.
    def keepable(self) -> bool:
        return True

    def extract(self, mask_B_C: torch.Tensor, batch_rows: Sequence[int]) -> list[Entry]:
        """Copies of some rows' real columns (mask 1), as turn_cache.extract_rows does for HF's."""
        assert self.kv is not None and mask_B_C.shape[1] == self.length, mask_B_C.shape
        out = []
        for b, positions in zip(batch_rows, real_columns(mask_B_C, batch_rows), strict=True):
            row = self.kv[:, :, b].index_select(3, positions)  # (layers, 2, kv_heads, L, head_dim)
            out.append(Entry(list(row[:, 0].unbind(0)), list(row[:, 1].unbind(0))))
        return out

    @classmethod
    def from_entries(
        cls, weights: DecodeWeights, entries: Sequence[Entry], reserve: int, extra: int
    ) -> tuple[StaticDecode, torch.Tensor, torch.Tensor]:
        """A cache of `entries` as rows, left-padded to the longest (zeros under mask 0: a padded
        column must be finite), with room for `extra` more columns (the new tokens' prefill), then
        `reserve`. Returns (decoder, mask (R, W), real length (R,)), as
        turn_cache.past_from_entries does for HF's path."""
        mask_R_W, lengths = left_padded_mask([e.length for e in entries], weights.embed.device)
        width = mask_R_W.shape[1]
        decoder = cls(weights, reserve)
        kv = decoder._allocate(len(entries), width + extra + reserve)
        for r, entry in enumerate(entries):
            pad = width - entry.length
            kv[:, :, r, :, :pad] = 0.0
            kv[:, 0, r, :, pad:width] = torch.stack(entry.keys)
            kv[:, 1, r, :, pad:width] = torch.stack(entry.values)
        decoder.kv, decoder.rows, decoder.length = kv, len(entries), width
        return decoder, mask_R_W, lengths


def stack_decoders(
    a: tuple[StaticDecode, torch.Tensor], b: tuple[StaticDecode, torch.Tensor]
) -> tuple[StaticDecode, torch.Tensor]:
    """Two (decoder, mask) batches as one, a's rows then b's, each left-padded (zeros, masked) to
    the wider, with `reserve` free columns after (turn_cache.merge_batches for HF's path)."""
    width = max(a[0].length, b[0].length)
    out = StaticDecode(a[0].w, a[0].reserve)
    kv = out._allocate(a[0].rows + b[0].rows, width + out.reserve)
    masks = []
    start = 0
    for part, mask in (a, b):
        assert part.kv is not None and mask.shape == (part.rows, part.length), mask.shape
        pad = width - part.length
        rows = slice(start, start + part.rows)
        kv[:, :, rows, :, :pad] = 0.0
        kv[:, :, rows, :, pad:width] = part.kv[:, :, : part.rows, :, : part.length]
        masks.append(torch.cat([mask.new_zeros((part.rows, pad)), mask], dim=1))
        start += part.rows
    out.kv, out.rows, out.length = kv, start, width
    return out, torch.cat(masks)
