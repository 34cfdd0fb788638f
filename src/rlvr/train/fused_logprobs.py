"""Token log-probs and entropies straight from hidden states, without the (N, V) logits in memory.

The trainer needs, per completion position, log p(token) and the entropy of the tempered softmax over
the whole vocabulary. The plain way materialises the logits (N x V: 8 rows x 64 positions x 49k ids
of SmolLM2 = 100 MB in fp32), their log-softmax (another 100 MB, kept for the backward) and, in the
backward, two more tensors of that size, next to the lm_head's weight gradient. Here the lm_head and
the softmax run `rows` positions at a time; the forward keeps only the hidden states and two numbers
per position (log-sum-exp, entropy), and the backward recomputes each chunk's logits:

    z = h W^T / T,  p = softmax(z),  logp_t = z_t - lse,  H = lse - sum_v p_v z_v
    d logp_t / d z = onehot(t) - p          d H / d z = -p * (log p + H)

Cost: one more lm_head matmul per position (recomputed in the backward), ~4% of a full fine-tuning
update for SmolLM2 in fp32; saving: ~0.4 GB of peak memory per 8-row micro-batch. Same arithmetic as
the plain path up to float rounding (tests/test_fastpath.py). The same idea as Liger-Kernel's fused
linear cross-entropy, written for log-probs + entropy rather than a loss.

In bf16 (`compute_dtype`, the trainer's bf16 update) the lm_head matmuls take bf16 inputs and their
logits are read back as fp32, as under bf16 autocast; the softmax work stays fp32. The backward keeps
the logit gradients of a block of up to `_BACKWARD_BLOCK_ROWS` positions in bf16 (what autocast's
backward of the head would take as its input) and runs the two head matmuls once per block. Up to one
block (1024 positions: 8 rows of 128 tokens) the weight gradient is rounded to bf16 once, as
autocast's is, bit for bit; past it each block's bf16 weight gradient is summed in fp32, so memory
stays bounded at (block, V) however many positions a micro-batch has (8 rows x 4k tokens of a 152k
vocabulary would be a 10 GB (N, V) buffer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_CHUNK_ROWS = [128]  # positions per chunk: a 128 x 49k fp32 block is 25 MB (256: ~15% slower here)
# bf16 backward: positions whose bf16 logit gradients are kept for one pair of head matmuls
# (1024 x 152k ids = 311 MB); a multiple of _CHUNK_ROWS is used.
_BACKWARD_BLOCK_ROWS = [1024]


@contextlib.contextmanager
def fused_backward_block_rows(rows: int) -> Iterator[None]:
    """Use bf16 backward blocks of `rows` positions inside the block (tests cross block edges)."""
    before = _BACKWARD_BLOCK_ROWS[0]
    _BACKWARD_BLOCK_ROWS[0] = rows
    try:
        yield
    finally:
        _BACKWARD_BLOCK_ROWS[0] = before


@contextlib.contextmanager
def fused_logprobs_chunk_rows(rows: int) -> Iterator[None]:
    """Use chunks of `rows` positions inside the block (tests use small ones to cross chunk edges)."""
    before = _CHUNK_ROWS[0]
    _CHUNK_ROWS[0] = rows
    try:
        yield
    finally:
        _CHUNK_ROWS[0] = before


class LinearTokenLogprobs(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), targets (N,), temperature, compute dtype of the head's matmuls)
    -> (logp (N,), entropy (N,)), both fp32.

    Each pass reuses two (rows, V) fp32 buffers over its chunks (`_ChunkBuffers`): a fresh 50 MB
    tensor per operation was paid in page faults (a first write of fresh memory ran at ~1 GB/s on the
    2-core VMs here), and every elementwise step works in place."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        targets_N: torch.Tensor,
        temperature: float,
        compute_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, rows = hidden_N_H.shape[0], _CHUNK_ROWS[0]
        ctx.rows, ctx.compute_dtype = rows, compute_dtype
        logp_N = hidden_N_H.new_empty(n, dtype=torch.float32)
        entropy_N = hidden_N_H.new_empty(n, dtype=torch.float32)
        lse_N = hidden_N_H.new_empty(n, dtype=torch.float32)
        weight_c_V_H = weight_V_H.to(compute_dtype)  # no copy when it already is
        buffers = _ChunkBuffers(min(n, rows), weight_c_V_H)
        for s in range(0, n, rows):
            e = min(n, s + rows)
            z_r_V = buffers.logits(hidden_N_H[s:e], temperature)
            lse_r = torch.logsumexp(z_r_V, dim=-1)
            lse_N[s:e] = lse_r
            logp_N[s:e] = z_r_V.gather(1, targets_N[s:e, None]).squeeze(1) - lse_r
            # H = -sum_v p_v log p_v: log p in place of z, p in the second buffer, the sum a dot
            logprobs_r_V = z_r_V.sub_(lse_r[:, None])
            p_r_V = buffers.exp(logprobs_r_V)
            entropy_N[s:e] = -_rowwise_dot(p_r_V, logprobs_r_V)
        # The cast weight is kept for the backward (autocast keeps its cast too): not cast twice.
        ctx.save_for_backward(hidden_N_H, weight_V_H, weight_c_V_H, targets_N, lse_N, entropy_N)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    def backward(
        ctx: Any, grad_logp_N: torch.Tensor | None, grad_entropy_N: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden_N_H, weight_V_H, weight_c_V_H, targets_N, lse_N, entropy_N = ctx.saved_tensors
        temperature, compute_dtype = ctx.temperature, ctx.compute_dtype
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp_N is None and grad_entropy_N is None:
            return (
                torch.zeros_like(hidden_N_H) if want_hidden else None,
                torch.zeros_like(weight_V_H) if want_weight else None,
                None,
                None,
                None,
            )
        # fp32: each chunk's head gradients are accumulated as the chunk is done (no (N, V) buffer);
        # bf16: a block's logit gradients are kept, rounded to bf16, for one matmul per head input.
        low = compute_dtype != torch.float32
        n, rows = hidden_N_H.shape[0], ctx.rows
        block = max(rows, _BACKWARD_BLOCK_ROWS[0] // rows * rows)
        grad_z_K_V = weight_c_V_H.new_empty(min(n, block), weight_V_H.shape[0]) if low else None
        grad_hidden = torch.zeros_like(hidden_N_H) if want_hidden and not low else None
        if want_hidden and low:
            grad_hidden = torch.empty_like(hidden_N_H)
        grad_weight = (
            torch.zeros_like(weight_V_H) if want_weight and (not low or n > block) else None
        )
        buffers = _ChunkBuffers(min(n, rows), weight_c_V_H)
        for s in range(0, n, rows):
            e = min(n, s + rows)
            h_r_H = hidden_N_H[s:e]
            logprobs_r_V = buffers.logits(h_r_H, temperature).sub_(lse_N[s:e, None])
            p_r_V = buffers.exp(logprobs_r_V)
            # d/dz of g_lp * logp_t + g_H * H = g_lp * (onehot(t) - p) - g_H * p * (log p + H)
            #                                = p * (-g_H * (log p + H) - g_lp) + g_lp * onehot(t)
            if grad_entropy_N is not None:
                grad_z_r_V = logprobs_r_V.add_(entropy_N[s:e, None])
                grad_z_r_V.mul_(-grad_entropy_N[s:e, None])
            else:
                grad_z_r_V = logprobs_r_V.zero_()  # reuse the chunk's buffer
            if grad_logp_N is not None:
                grad_z_r_V.sub_(grad_logp_N[s:e, None])
            grad_z_r_V.mul_(p_r_V)
            if grad_logp_N is not None:
                grad_z_r_V.scatter_add_(1, targets_N[s:e, None], grad_logp_N[s:e, None])
            if temperature != 1.0:
                grad_z_r_V.div_(temperature)
            if grad_z_K_V is not None:
                start = s - s % block  # the block this chunk belongs to
                grad_z_K_V[s - start : e - start] = grad_z_r_V
                if e - start == block or e == n:
                    grad_weight = _bf16_block_grads(
                        grad_z_K_V[: e - start],
                        weight_c_V_H,
                        hidden_N_H[start:e],
                        grad_hidden[start:e] if grad_hidden is not None else None,
                        grad_weight,
                        want_weight,
                    )
                continue
            if grad_hidden is not None:
                torch.mm(grad_z_r_V, weight_V_H, out=grad_hidden[s:e])
            if grad_weight is not None:
                grad_weight.addmm_(grad_z_r_V.t(), h_r_H)  # in place: no (V, H) temporary
        if grad_weight is not None and grad_weight.dtype != weight_V_H.dtype:
            grad_weight = grad_weight.to(weight_V_H.dtype)
        return grad_hidden, grad_weight, None, None, None


def _bf16_block_grads(
    grad_z_K_V: torch.Tensor,
    weight_c_V_H: torch.Tensor,
    hidden_K_H: torch.Tensor,
    grad_hidden_K_H: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    want_weight: bool,
) -> torch.Tensor | None:
    """One bf16 block of the head's backward: the hidden states' gradient written in place, the
    weight's returned (the block's own bf16 product when it is the only block, else added in fp32
    to `grad_weight`). Both matmul operands are bf16: autocast has nothing to change."""
    if grad_hidden_K_H is not None:
        grad_hidden_K_H.copy_(grad_z_K_V @ weight_c_V_H)
    if not want_weight:
        return grad_weight
    part_V_H = grad_z_K_V.t() @ hidden_K_H.to(grad_z_K_V.dtype)
    if grad_weight is None:  # a single block: rounded to bf16 once, as autocast's gradient is
        return part_V_H
    return grad_weight.add_(part_V_H)


class _ChunkBuffers:
    """Two (rows, V) fp32 buffers (and, for a bf16 head, the matmul's bf16 output) reused by every
    chunk of one pass; a short last chunk uses their first rows."""

    def __init__(self, rows: int, weight_c_V_H: torch.Tensor) -> None:
        vocab = weight_c_V_H.shape[0]
        self.weight_c_V_H = weight_c_V_H
        self.z_R_V = weight_c_V_H.new_empty(rows, vocab, dtype=torch.float32)
        self.p_R_V = torch.empty_like(self.z_R_V)
        low = weight_c_V_H.dtype != torch.float32
        self.low_R_V = weight_c_V_H.new_empty(rows, vocab) if low else None

    def logits(self, h_r_H: torch.Tensor, temperature: float) -> torch.Tensor:
        """fp32 logits of one chunk, the matmul in the weight's dtype (autocast, if on around the
        caller, must not pick another)."""
        r = h_r_H.shape[0]
        z_r_V = self.z_R_V[:r]
        with torch.autocast(h_r_H.device.type, enabled=False):
            h_c = h_r_H.to(self.weight_c_V_H.dtype)
            if self.low_R_V is None:
                torch.mm(h_c, self.weight_c_V_H.t(), out=z_r_V)
            else:
                z_r_V.copy_(torch.mm(h_c, self.weight_c_V_H.t(), out=self.low_R_V[:r]))
        return z_r_V.div_(temperature) if temperature != 1.0 else z_r_V

    def exp(self, logprobs_r_V: torch.Tensor) -> torch.Tensor:
        p_r_V = self.p_R_V[: logprobs_r_V.shape[0]]
        return torch.exp(logprobs_r_V, out=p_r_V)


def _rowwise_dot(a_r_V: torch.Tensor, b_r_V: torch.Tensor) -> torch.Tensor:
    """sum_v a[r, v] * b[r, v] as a batched (1, V) @ (V, 1) product: no (r, V) temporary."""
    return torch.bmm(a_r_V[:, None, :], b_r_V[:, :, None]).view(-1)


def plain_head(model: Any) -> torch.nn.Linear | None:
    """The lm_head when the model's logits are exactly `head(decoder(...).last_hidden_state)`: a
    plain nn.Linear, no logit scaling or soft-capping, a decoder reachable by `get_decoder()`; else
    None (the caller lets the model run its own head)."""
    if _fsdp_sharded(model):
        return None  # its root weights (embeddings, lm_head) are gathered by its own forward only
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return None  # e.g. a peft LoRA layer on the lm_head
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            return None
    if not callable(getattr(model, "get_decoder", None)):
        return None
    return head


def _fsdp_sharded(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def fusable_head(model: Any) -> torch.Tensor | None:
    """The lm_head weight when the logits are exactly `hidden @ W^T` (`plain_head`, bias-free, an
    fp32 or bf16 weight); else None and the caller takes the plain path."""
    head = plain_head(model)
    if head is None or head.bias is not None:
        return None
    if head.weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    weight: torch.Tensor = head.weight
    return weight


def token_logprobs_from_hidden(
    hidden_B_c_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    targets_B_c: torch.Tensor,
    temperature: float,
    bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, c, H) hidden states -> (B, c) log-probs of `targets_B_c` and (B, c) entropies (fp32).
    The head's matmuls run in bf16 when `bf16` (the trainer's bf16 autocast) or the weight is bf16
    (a bf16 reference copy), else in fp32."""
    b, c, h = hidden_B_c_H.shape
    compute_dtype = torch.bfloat16 if bf16 else weight_V_H.dtype
    logp_N, entropy_N = LinearTokenLogprobs.apply(
        hidden_B_c_H.reshape(b * c, h),
        weight_V_H,
        targets_B_c.reshape(b * c),
        temperature,
        compute_dtype,
    )
    return logp_N.view(b, c), entropy_N.view(b, c)
