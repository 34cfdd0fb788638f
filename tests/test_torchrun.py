"""The update under torchrun (rlvr.scale.torch_dist): 2 gloo ranks take the single process's step.

One `torchrun --nproc_per_node 2` launch runs tests/torchrun_update_check.py: for ddp and then fsdp
(FSDP2 on CPU/gloo), three scenarios on a fixed 20-row batch (5 prompts, uneven lengths, a group and a
row with A = 0): grpo (zero-advantage rows skipped), kl (beta > 0 against the frozen copy, two
optimizer steps, entropy bonus, a 1-token completion), lora (adapters initialised differently on
each rank, the KL in the reward: reference_logprobs sharded too) and distill (the teacher sharded
like the policy); then ppo's critic (full and LoRA) and a reference loaded late. Each is compared
with the same scenario run here in one process.

Tolerances (fp32), with the largest difference measured here over all scenarios and both strategies:
- loss, grad_norm and every other metric: rel 1e-5 (measured: loss 2.7e-7, grad_norm 8.5e-8, the kl
  metric 7.8e-7);
- updated parameters: abs 1e-6 (measured 2.5e-7). grpo and lora take one fused-AdamW step (lr 1e-3:
  each weight moves by ~1e-3 times a ratio close to +-1); kl takes two SGD steps with lr 1, so the
  weight change is the clipped gradient itself (two AdamW steps turn rounding noise in near-zero
  gradient entries into ~2e-5 weight differences, which says nothing about the distributed update);
- reference log-probs: abs 1e-5 (measured 4.8e-7: fsdp scores without the fused head).
The fsdp kl run takes the plain (unshared-prompt) path because of the 1-token completion, so it is
compared with a single process on that path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlvr.scale.torch_dist import DistContext, contiguous_cuts
from rlvr.train.micro_batching import micro_batches, shard_rows

HELPER = Path(__file__).with_name("torchrun_update_check.py")
sys.path.insert(0, str(HELPER.parent))
import torchrun_update_check as check  # noqa: E402

METRIC_RTOL = 1e-5
PARAM_ATOL = 1e-6
REF_ATOL = 1e-5
STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path) -> dict[str, Any]:
    """Every scenario in this process (no DistContext), plus kl on the plain path (see above)."""
    with torch.random.fork_rng(devices=[]):
        out = {
            name: check.run_scenario(str(tiny_model_dir), name, None) for name in check.SCENARIOS
        }
        out["kl-plain"] = check.run_scenario(
            str(tiny_model_dir), "kl", None, ["train.share_prompt_prefix=false"]
        )
        for name in check.CRITIC_SCENARIOS:
            out[name] = check.run_critic(str(tiny_model_dir), name, None)
        out["late-reference"] = check.run_late_reference(str(tiny_model_dir), None)
    return out


@pytest.fixture(scope="module")
def distributed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The helper under torchrun, 2 ranks on gloo, both strategies in one launch."""
    out_file = tmp_path_factory.mktemp("torchrun") / "results.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_VERBOSITY"] = "error"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--standalone",
        str(HELPER),
        str(tiny_model_dir),
        str(out_file),
        ",".join(STRATEGIES),
    ]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    print(f"torchrun took {time.perf_counter() - started:.1f} s")
    results: dict[str, Any] = torch.load(out_file)
    return results


def expected_for(single: dict[str, Any], strategy: str, name: str) -> dict[str, Any]:
    # fsdp keeps forwards in lock-step by taking the plain path when a completion has 1 token.
    plain = strategy == "fsdp" and check.uses_one_token_row(name)
    return single["kl-plain" if plain else name]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(check.SCENARIOS))
def test_two_ranks_take_the_single_process_step(
    single: dict[str, Any],
    distributed: dict[str, Any],
    strategy: str,
    name: str,
    tiny_model_dir: Path,
) -> None:
    want = expected_for(single, strategy, name)
    # The step moved the weights by far more than the tolerance (LoRA: B starts at 0).
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    moved = [
        (tensor - initial[key]).abs().max() if key in initial else tensor.abs().max()
        for key, tensor in want["params"].items()
        if key in initial or "lora_B" in key
    ]
    assert max(moved) > 100 * PARAM_ATOL
    got = distributed[f"{strategy}/{name}"]
    skip = {
        "perf/update_gflops",
        "perf/update_gflops_per_s",
        "update/micro_batches",  # this rank's forwards, by definition fewer than one process's
    }  # rank shards share prompts differently
    assert set(got["metrics"]) == set(want["metrics"])
    for key, value in want["metrics"].items():
        if key not in skip:
            assert got["metrics"][key] == pytest.approx(value, rel=METRIC_RTOL, abs=1e-9), key
    assert got["metrics"]["update/skipped_nonfinite"] == 0.0
    assert set(got["params"]) == set(want["params"])
    for key, tensor in want["params"].items():
        torch.testing.assert_close(got["params"][key], tensor, rtol=0, atol=PARAM_ATOL, msg=key)
    if want["ref"] is None:
        assert got["ref"] is None
    else:
        for a, b in zip(got["ref"], want["ref"], strict=True):
            assert a == pytest.approx(b, abs=REF_ATOL)
    # distill's teacher is sharded like the policy (its forwards then keep step on every rank)
    assert got["teacher_sharded"] == (name == "distill" and strategy == "fsdp")
    assert got["teacher_sharded_after"] == got["teacher_sharded"]
    if name == "distill":
        assert want["metrics"]["distill/reverse_kl"] > 1e-6  # the second pass pulled


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(check.CRITIC_SCENARIOS))
def test_two_ranks_train_the_critic_as_one_process_does(
    single: dict[str, Any], distributed: dict[str, Any], strategy: str, name: str
) -> None:
    """ppo's critic under torchrun: each rank scores and trains on its shard of the rows (fsdp: the
    critic sharded, padding micro-batches in step), gradients summed, whole-batch metrics."""
    want, got = single[name], distributed[f"{strategy}/{name}"]
    assert got["sharded"] == (strategy == "fsdp")
    assert want["metrics"]["critic/grad_norm"] > 0  # the second update moved the backbone
    assert set(got["metrics"]) == set(want["metrics"])
    for key, value in want["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=METRIC_RTOL, abs=1e-9), key
    assert max(abs(v) for row in want["values"] for v in row) > 1e-3  # values moved off 0
    for a, b in zip(got["values"], want["values"], strict=True):
        assert a == pytest.approx(b, abs=REF_ATOL)
    assert set(got["params"]) == set(want["params"])
    for key, tensor in want["params"].items():
        torch.testing.assert_close(got["params"][key], tensor, rtol=0, atol=PARAM_ATOL, msg=key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_late_reference_is_placed_like_the_policy(
    single: dict[str, Any], distributed: dict[str, Any], strategy: str
) -> None:
    """A reference loaded when a mitigation raises beta is sharded under fsdp (not a full copy per
    rank) and scores as one process's does."""
    want, got = single["late-reference"], distributed[f"{strategy}/late-reference"]
    assert got["sharded"] == (strategy == "fsdp")
    for a, b in zip(got["ref"], want["ref"], strict=True):
        assert a == pytest.approx(b, abs=REF_ATOL)


def test_the_scenarios_give_the_ranks_unequal_work() -> None:
    """fsdp's padding micro-batches only run if the ranks' micro-batch counts differ: check the
    scenarios make them differ (in the update, or for lora in reference_logprobs)."""
    counts = {}
    for name, overrides in check.SCENARIOS.items():
        size = int(next(o for o in overrides if "micro_batch_size" in o).split("=")[1])
        trajectories, advantages = check.fixed_batch(check.uses_one_token_row(name))
        rows = range(len(trajectories))
        if name == "grpo":
            rows = [i for i in rows if any(advantages[i])]
        shards = shard_rows(trajectories, list(rows), 2)
        counts[name] = [len(micro_batches(trajectories, s, size)) for s in shards]
    assert all(a != b for a, b in counts.values()), counts


# --------------------------------------------------------------------------- no process group needed
def test_contiguous_cuts_balance_and_keep_groups_whole() -> None:
    # Four groups of equal cost: the cut falls between groups 2 and 3.
    assert contiguous_cuts([1.0] * 8, [0, 2, 4, 6], 2) == [0, 4, 8]
    # A cut inside a group moves to its edge when that costs less imbalance than the split (5) ...
    assert contiguous_cuts([1.0] * 10, [0, 3], 2, [5.0, 5.0]) == [0, 3, 10]
    # ... and stays inside when the prompt is cheap.
    assert contiguous_cuts([1.0] * 10, [0, 3], 2, [0.5, 0.5]) == [0, 5, 10]
    assert contiguous_cuts([], [], 3) == [0, 0, 0, 0]


def test_shard_gives_contiguous_balanced_chunks() -> None:
    items = list(range(7))
    shards = [DistContext(r, 3, r, "ddp", torch.device("cpu")).shard(items) for r in range(3)]
    assert shards == [[0, 1, 2], [3, 4], [5, 6]]
    assert DistContext(2, 3, 2, "ddp", torch.device("cpu")).shard([1]) == []


def test_from_env_is_none_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert DistContext.from_env("ddp") is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert DistContext.from_env("fsdp") is None
