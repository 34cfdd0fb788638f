"""fsdp with a bf16 update under torchrun: FSDP2's MixedPrecisionPolicy is applied (issue 35, item 4).

    python -m torch.distributed.run --nproc_per_node 2 --standalone \
        tests/torchrun_mixed_precision_check.py MODEL_DIR OUT_FILE

Rank 0 writes {"forward_weight_dtypes", "shard_dtypes", "grad_dtypes", "metrics"} to OUT_FILE:
the dtypes a decoder layer's linear weights have inside the forward (the gathered copies), the
sharded parameters' and their gradients' dtypes after one `policy_update`, and its metrics.
tests/test_torchrun_resume.py compares the loss with one process's bf16 autocast update.
"""

from __future__ import annotations

import sys

import torch

import torchrun_update_check as check
from rlvr.build import build_optimizer, build_policy
from rlvr.scale.torch_dist import DistContext, decoder_layers
from rlvr.train.update import policy_update

BF16 = ["model.bf16='on'", "train.micro_batch_size=7"]


def run(model_dir: str, dist: DistContext | None) -> dict[str, object]:
    cfg = check.config(model_dir, BF16)
    torch.manual_seed(1000)
    policy = build_policy(cfg)
    if dist is not None:
        dist.prepare_policy(policy, bf16=True)
    optimizer, _ = build_optimizer(policy, cfg)
    seen: set[str] = set()
    layer = decoder_layers(policy.model)[0]
    linear = next(m for m in layer.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_pre_hook(lambda m, _args: seen.add(str(m.weight.dtype)))
    params = list(policy.model.parameters())
    grad_dtypes: set[str] = set()  # read as the optimizer steps: the update frees them after

    def record_grads(*_: object) -> None:
        grad_dtypes.update(str(p.grad.dtype) for p in params if p.grad is not None)

    step_hook = optimizer.register_step_pre_hook(record_grads)
    trajectories, advantages = check.fixed_batch(one_token=False)
    metrics = policy_update(policy, optimizer, trajectories, advantages, cfg, dist=dist)
    hook.remove()
    step_hook.remove()
    return {
        "forward_weight_dtypes": sorted(seen),
        "shard_dtypes": sorted({str(p.dtype) for p in params}),
        "grad_dtypes": sorted(grad_dtypes),
        "metrics": metrics,
    }


def main() -> None:
    model_dir, out_file = sys.argv[1], sys.argv[2]
    context = DistContext.from_env("fsdp")
    if context is None:
        raise SystemExit("run me under torchrun (WORLD_SIZE > 1)")
    result = run(model_dir, context)
    if context.is_main:
        torch.save(result, out_file)
    context.barrier()
    context.close()


if __name__ == "__main__":
    main()
