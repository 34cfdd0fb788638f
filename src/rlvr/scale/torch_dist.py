"""The update under `torchrun --nproc_per_node N`: data-parallel (ddp) or fully sharded (fsdp, FSDP2).

Every rank holds the whole batch of trajectories (the loop all-gathers the groups) and so computes the
same advantages and the same loss normalisers; each rank then forwards and backwards only its shard of
the rows, and the gradients are summed across ranks. Because every normaliser counts the full batch,
the summed gradient is the full-batch gradient, and every rank takes the optimizer step one process
would take on the whole batch (tests/test_torchrun.py checks this against a single process).

- ddp: every rank holds all the weights; after a rank's last micro-batch one coalesced all-reduce
  (SUM) of the accumulated gradients (`sum_gradients`). torch's DistributedDataParallel is not
  used: it all-reduces inside every backward, which needs the same number of backwards on every rank
  (ranks skip different numbers of zero-advantage rows) and one forward per backward (the shared
  prompt prefix calls the model twice per micro-batch).
- fsdp: FSDP2 `fully_shard` on each decoder layer and on the root; weights, gradients and optimizer
  state are sharded. Every forward all-gathers a layer's weights, so all ranks must run the same
  number of forwards in the same order: the update pads a rank's micro-batch list with zero-weight
  micro-batches (rlvr.train.update). FSDP reduce-scatters gradients with SUM (its default is the mean).

CPU runs use gloo, CUDA runs nccl (one GPU per rank, `cuda:LOCAL_RANK`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from rlvr.models import Policy
from rlvr.scale import chunk_bounds

T = TypeVar("T")

# Gradients are all-reduced in flat buffers of at most this many elements (256 MB of fp32): one
# collective for a small model, a few for a large one, never a second full copy of the gradients.
_BUCKET_ELEMENTS = 64 * 1024 * 1024


@dataclass
class DistContext:
    """This process's place in the torchrun job and the collectives the loop and the update use."""

    rank: int
    world_size: int
    local_rank: int
    strategy: Literal["ddp", "fsdp"]
    device: torch.device
    _mesh: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes checkpoints and metrics."""
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        return self.strategy == "fsdp"

    @classmethod
    def from_env(cls, strategy: Literal["ddp", "fsdp"]) -> DistContext | None:
        """The context torchrun's environment describes, with the process group started; None when
        this is not a multi-process job (WORLD_SIZE unset or 1). Touches no random seed."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        return cls(rank, world_size, local_rank, strategy, device)

    # ------------------------------------------------------------------------------ sharding data
    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous share of `items`; shares differ in length by at most one (the first
        `len % world_size` ranks take one more). Called on tasks, a task's whole group stays on one rank."""
        start, end = chunk_bounds(len(items), self.world_size)[self.rank]
        return list(items[start:end])

    # ------------------------------------------------------------------------------ collectives
    def all_gather_objects(self, items: list[T]) -> list[T]:
        """Every rank's `items` (any picklable values), concatenated in rank order, on every rank."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, list(items))
        return [item for part in gathered for item in part]

    def all_reduce_sums(self, values: dict[str, float]) -> dict[str, float]:
        """{name: sum over ranks}. A name missing on some ranks counts 0 there (a rank that forwarded
        nothing adds no metric sums); the names are agreed first, so ranks may pass different keys."""
        names: list[Any] = [None] * self.world_size
        dist.all_gather_object(names, sorted(values))
        keys = sorted({k for part in names for k in part})
        if not keys:
            return {}
        values_k = [float(values.get(k, 0.0)) for k in keys]
        vector = torch.tensor(values_k, dtype=torch.float64, device=self.device)
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        return dict(zip(keys, vector.tolist(), strict=True))

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (the argument is ignored elsewhere)."""
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0)
        result: T = box[0]
        return result

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------ the model
    def prepare_policy(self, policy: Policy, bf16: bool = False) -> None:
        """Make every rank start from rank 0's weights, then (fsdp) shard them. Call it before the
        optimizer is built: under fsdp the parameters become sharded DTensors, and the optimizer must
        hold those. The reference copy (full fine-tuning with beta > 0) is treated like the policy.
        `bf16` (the update's precision): fsdp gathers and computes with bf16 copies of the weights
        and reduces gradients in fp32 (FSDP2's MixedPrecisionPolicy); the shards, their gradients and
        the optimizer stay fp32."""
        if self.fsdp:
            embedding = policy.model.get_input_embeddings()
            if isinstance(embedding, torch.nn.Embedding):
                # FSDP reduce-scatters dense gradients only (see rlvr.models.sparse_tied_embedding_grad).
                embedding.sparse = False
        models = [policy.model] + ([policy._reference] if policy._reference is not None else [])
        for model in models:
            self.prepare_model(model, bf16)

    def prepare_model(self, model: Any, bf16: bool = False) -> None:
        """One model of the run (the policy, its reference, ppo's critic, distill's teacher) placed
        like the policy: on this rank's device, every rank holding rank 0's weights and, under fsdp,
        sharded over the ranks. Trained models get it before their optimizer is built; a frozen one
        (reference, teacher) forwards in lock-step with the policy's micro-batches (RankPlan), each
        forward a collective under fsdp."""
        if self.device.type != "cpu":
            model.to(self.device)
        # LoRA adapters are initialised from each rank's RNG: without this the ranks would train
        # different models. Buffers too (rotary caches are deterministic, but cheap to make sure).
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        if not self.fsdp:
            return
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        self._fully_shard(model, bf16)

    def _fully_shard(self, model: Any, bf16: bool = False) -> None:
        """FSDP2 on each decoder layer (the units whose weights are gathered one at a time) and on the
        root (embeddings, final norm, lm_head), with gradients summed rather than averaged."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        # bf16 all-gathers halve the bytes each forward moves; fp32 reduction keeps the summed
        # gradient as exact as the fp32 path's (TRL/verl's FSDP default for bf16 training).
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self._mesh, mp_policy=policy)
        fully_shard(model, mesh=self._mesh, mp_policy=policy)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Each rank's loss is its part of the full-batch loss: the gradient is the SUM over
                # ranks. A divide factor of 1 with sum-only comms (gloo has no PREMUL_SUM) gives it.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def full_state_dict(self, model: Any, keep: bool = True) -> dict[str, torch.Tensor]:
        """{name: unsharded tensor} as `model.state_dict()` names them, on the CPU. Under fsdp this is a
        collective (every rank must call it); a rank that passes `keep=False` takes part and keeps
        nothing (returns {}), so only the ranks that use the weights hold a host copy of them. On the
        CPU the tensors under ddp are the live weights, not copies: copy them to keep a snapshot
        across optimizer steps."""
        from torch.distributed.tensor import DTensor

        # Tied weights appear under two names: gathered once, on every rank alike (the same
        # sequence of collectives whether or not this rank keeps them).
        done: dict[int, torch.Tensor | None] = {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            key = id(tensor)
            if key not in done:
                full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                done[key] = full.detach().to("cpu") if keep else None
            kept = done[key]
            if kept is not None:
                out[name] = kept
        return out

    @torch.no_grad()
    def copy_full_weights(self, source: Any, target: Any) -> None:
        """Fill `target` (an unsharded copy of `source`, on this rank's device) with `source`'s
        current weights, gathering one tensor at a time on the device and copying it straight in:
        no host round trip and no second full state in memory (fsdp's sampling copy, refreshed
        after every update). Collective under fsdp: every rank calls it."""
        from torch.distributed.tensor import DTensor

        params = dict(target.named_parameters(remove_duplicate=False))
        params |= dict(target.named_buffers(remove_duplicate=False))
        missing = [name for name in source.state_dict() if name not in params]
        if missing:
            raise KeyError(f"fsdp sampling copy: no parameter {missing[0]!r}")
        # Each target tensor is filled once: a tied head once, an untied one (the bf16 sampling
        # copy's own head, models.matmul_weights_to_bf16) under its own name; copy_ casts.
        done: set[int] = set()
        for name, tensor in source.state_dict().items():
            if id(params[name]) in done:
                continue
            done.add(id(params[name]))
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            params[name].copy_(full)
            del full

    # ------------------------------------------------------------------------------ the update
    def sum_gradients(
        self, params: Sequence[torch.nn.Parameter], scalars: Sequence[float]
    ) -> list[float]:
        """Sum the accumulated `.grad` of `params` over ranks (ddp; FSDP has already reduce-scattered
        them), and `scalars` with them; returns the summed scalars.

        ddp: every parameter must have a `.grad` on every rank (the update fills in zeros where a rank
        forwarded nothing), so every rank sends the same buffers. The scalars ride in the first buffer:
        one collective for a small model.
        """
        extra = torch.tensor(list(scalars), dtype=torch.float32, device=self.device)
        if self.fsdp:
            dist.all_reduce(extra, op=dist.ReduceOp.SUM)
            return [float(v) for v in extra.tolist()]
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            raise RuntimeError("sum_gradients: a parameter has no .grad on this rank")
        buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for g in grads:
            assert g is not None
            if buckets[-1] and size + g.numel() > _BUCKET_ELEMENTS:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += g.numel()
        summed: list[float] = []
        for b, bucket in enumerate(buckets):
            dtype = bucket[0].dtype if bucket else torch.float32
            parts = [g.reshape(-1).to(dtype) for g in bucket]
            if b == 0:
                parts.append(extra.to(bucket[0].device if bucket else self.device, dtype))
            flat = torch.cat(parts)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if b == 0:
                summed = [float(v) for v in flat[offset:].tolist()]
        return summed


def reshard(model: Any) -> None:
    """Free the gathered weights a frozen fsdp model (a teacher) keeps after a forward: FSDP2 leaves
    the root module's (embeddings, lm_head) unsharded until a backward that never comes. A no-op for
    a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def norm_value(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float; under fsdp it is a replicated DTensor."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The transformer blocks of a HF causal LM (or a peft model wrapping one): the modules whose
    class HF lists in `_no_split_modules` (LlamaDecoderLayer, ...), else the children of the largest
    ModuleList."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else []


def contiguous_cuts(
    costs: Sequence[float],
    group_starts: Sequence[int],
    parts: int,
    split_costs: Sequence[float] | None = None,
) -> list[int]:
    """Boundaries [0, c_1, ..., c_{parts-1}, n] splitting n ordered items with `costs` into `parts`
    contiguous runs of about equal cost, where a group of items (`group_starts[j]`: the index where
    group j begins) is kept whole when that is cheaper than splitting it.

    A prompt's rows share its forward pass: cutting inside group j makes a second rank forward the
    prompt too (`split_costs[j]`, e.g. the prompt's length; default 0). So a cut that lands inside a
    group moves to the group's nearer edge when the imbalance that adds is at most the split cost.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    total = prefix[-1]
    starts = sorted({0, *group_starts})
    penalty = dict(zip(starts, split_costs or [0.0] * len(starts), strict=True))
    cuts = [0]
    for k in range(1, parts):
        target = total * k / parts
        best = min(range(cuts[-1], n + 1), key=lambda i: abs(prefix[i] - target))
        if best not in starts and best != n:
            # Inside the group that begins at `first`: its edges are `first` and the next start.
            first = max(s for s in starts if s <= best)
            end = next((s for s in starts if s > best), n)
            edge = min(
                (e for e in (first, end) if e >= cuts[-1]), key=lambda e: abs(prefix[e] - target)
            )
            if abs(prefix[edge] - target) <= abs(prefix[best] - target) + penalty[first]:
                best = edge
        cuts.append(best)
    cuts.append(n)
    return cuts
