"""The fast decode path's step at fixed shapes, so that a GPU can replay it as a CUDA graph.

Why: an eager decode step of rollout/fast_decode.py issues ~2,000-2,900 small ops at 28 layers, and
on a GPU each costs a kernel launch from Python: a 1.5B or a 7B model then decodes at about the
same ~10 ms a step, host-bound (issue 61). A CUDA graph records the step's kernels once and replays
them in one launch, which needs every shape and address fixed. The eager step has two that move:
the columns attended over (one more every step) and the rows (finished rows leave the batch). Here:
- the columns: every step attends over the cache's whole capacity (prefill + `reserve`, allocated
  once per chunk), the columns not yet written masked out (and zeroed once, so a masked 0-weight
  product never meets uninitialised memory); the new keys and values are written at a column held
  in a device tensor (`index_copy_`), not a Python slice;
- the rows: a step runs the smallest power-of-two bucket of rows that holds the live ones (at
  most the cache's rows). HFGenerator compacts live rows to the front (`fill_holes_order`), so the
  rows past them in the bucket are finished ones, computed and ignored. One graph per bucket, all
  in one memory pool; 256 rows make at most 9.
Inputs (token ids, positions, the step's column, which columns each row may see) are copied into
fixed buffers before each replay, and the logits copied out after.

Modes (`DecodeWeights.step_mode`): "static" runs this body eagerly (any device: the CPU test,
tests/test_fast_decode.py, that it samples the tokens the eager step does), "graph" captures it on
CUDA (`generator.cuda_graphs: true`; off by default until a GPU lease has measured it). On a CPU
neither is used by default, so the CPU's samples are bit-identical to before. Prefills stay eager.
"""

from __future__ import annotations

from typing import Any

import torch


class StaticSteps:
    """One StaticDecode's fixed-shape decode steps: input buffers sized to its cache's rows and
    capacity, and (graphs) one captured CUDA graph per row bucket."""

    def __init__(self, decoder: Any, *, graphs: bool) -> None:
        kv = decoder.kv
        assert kv is not None, "a decode step follows a prefill"
        self.decoder, self.kv = decoder, kv
        self.graphs = graphs and kv.device.type == "cuda"
        slots, capacity = kv.shape[2], kv.shape[4]
        device = kv.device
        self.ids_B_1 = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.positions_B_1 = torch.zeros((slots, 1), dtype=torch.long, device=device)
        self.column_1 = torch.zeros(1, dtype=torch.long, device=device)
        self.allowed_B_C = torch.zeros((slots, capacity), dtype=torch.bool, device=device)
        self.logits_B_V: torch.Tensor | None = None
        # Columns past the filled ones are read (masked) from now on: never uninitialised memory.
        kv[:, :, :, :, decoder.length :].zero_()
        decoder._rope(torch.zeros((1, 1), dtype=torch.long, device=device), capacity)  # the table
        self.captured: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = torch.cuda.graph_pool_handle() if self.graphs else None

    def serves(self, decoder: Any) -> bool:
        """Whether these buffers still fit `decoder`'s cache (a prefill may have reallocated it)."""
        return decoder.kv is self.kv

    def step(
        self, ids_B_1: torch.Tensor, attention_B_C: torch.Tensor, positions_B_1: torch.Tensor
    ) -> torch.Tensor:
        """StaticDecode.forward for one new column: the same arguments, the same logits (B, V)."""
        decoder, kv = self.decoder, self.kv
        rows, columns = ids_B_1.shape[0], attention_B_C.shape[1]
        capacity = kv.shape[4]
        assert rows <= kv.shape[2] and columns <= capacity, (rows, columns, kv.shape)
        bucket = min(1 << max(0, rows - 1).bit_length(), kv.shape[2])
        # Inputs into the fixed buffers. A row sees its real columns, and always its own new one
        # (a finished row in the bucket too: no all-masked row, no NaN).
        self.ids_B_1[:rows] = ids_B_1
        self.ids_B_1[rows:bucket] = 0
        self.positions_B_1[:rows] = positions_B_1
        self.positions_B_1[rows:bucket] = 0
        self.column_1.fill_(columns - 1)
        self.allowed_B_C[:bucket].zero_()
        self.allowed_B_C[:rows, :columns] = attention_B_C.bool()
        self.allowed_B_C[:bucket, columns - 1] = True
        if not self.graphs:
            logits = self._body(bucket)
        elif bucket in self.captured:
            self.captured[bucket].replay()
            assert self.logits_B_V is not None
            logits = self.logits_B_V[:bucket]
        else:
            logits = self._capture(bucket)
        decoder.length = columns
        return logits[:rows].clone() if self.graphs else logits[:rows]

    def _body(self, bucket: int) -> torch.Tensor:
        """The decode step of `bucket` rows over the whole capacity: only fixed shapes, device
        tensors for everything that changes, no host read (so it can be captured)."""
        decoder, kv, w = self.decoder, self.kv, self.decoder.w
        groups, capacity = w.heads // w.kv_heads, kv.shape[4]
        positions = self.positions_B_1[:bucket]
        cos = decoder._cos[positions][:, :, None, :]
        sin = decoder._sin[positions][:, :, None, :]
        mask = self.allowed_B_C[:bucket, None, None, :].expand(bucket, 1, groups, capacity)
        column = self.column_1

        def write(index: int, k_B_K_1_D: torch.Tensor, v_B_K_1_D: torch.Tensor) -> None:
            kv[index, 0, :bucket].index_copy_(2, column, k_B_K_1_D.to(kv.dtype))
            kv[index, 1, :bucket].index_copy_(2, column, v_B_K_1_D.to(kv.dtype))

        x = w.embed[self.ids_B_1[:bucket]].float()
        return decoder._layers(x, cos, sin, mask, write, kv[:, :, :bucket])

    def _capture(self, bucket: int) -> torch.Tensor:
        """Run the step once on a side stream (CUDA's warm-up before a capture; it computes this
        step's real logits and writes its real keys), then record it for later replays."""
        stream = torch.cuda.Stream(device=self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            logits = self._body(bucket)
            if self.logits_B_V is None:
                self.logits_B_V = torch.empty(
                    (self.kv.shape[2], logits.shape[-1]), dtype=logits.dtype, device=logits.device
                )
            self.logits_B_V[:bucket] = logits
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # recorded, not run: the warm-up wrote
            self.logits_B_V[:bucket] = self._body(bucket)
        self.captured[bucket] = graph
        return self.logits_B_V[:bucket]
