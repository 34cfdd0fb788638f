"""Tests that need a CUDA device (marked `cuda`): skipped here, run by benchmarks/gpu_check.py on a GPU.

They check what the CPU suite can only check by proxy (tests/test_device_audit.py, test_placement.py):
that a run on a GPU keeps every model and tensor there, samples the same greedy tokens as the CPU,
and trains with every algorithm.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlvr.config import RunConfig, load_config
from rlvr.devices import device_of

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cfg(config_dir: Path, model_dir: Path, out: Path, *overrides: str) -> RunConfig:
    return load_config(
        config_dir / "tiny.yaml",
        [
            f"model.name={model_dir}",
            f"output_dir={out}",
            "tracking.progress=false",
            "model.device=cuda",
            "model.bf16=off",  # pinned: conftest's RLVR_AUTO_BF16 would decide `auto` here
            "eval.n=4",
            *overrides,
        ],
    )


def test_the_policy_loads_onto_the_gpu_in_fp32_master_weights(tiny_model_dir: Path) -> None:
    from rlvr.models import load_policy

    policy = load_policy(str(tiny_model_dir), device="cuda", need_reference=True)
    assert device_of(policy.model).type == "cuda"
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    with policy.reference() as ref:
        assert device_of(ref).type == "cuda"


@pytest.mark.parametrize("decode", ["hf", "fast"])
def test_greedy_tokens_on_the_gpu_equal_the_cpu(tiny_model_dir: Path, decode: str) -> None:
    """fp32 without TF32 on both sides: the greedy continuation of the tiny model is the CPU's, and
    the log-probs agree to float rounding; the sampler's RNG lives on the GPU."""
    from rlvr.models import eos_token_ids, load_policy
    from rlvr.rollout.generator import SamplingParams
    from rlvr.rollout.hf import HFGenerator

    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = [[2, 10, 11, 12, 13], [2, 20, 21], [2, 30, 31, 32, 33, 34, 35]]
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    outputs = {}
    for device in ("cpu", "cuda"):
        policy = load_policy(str(tiny_model_dir), device=device)
        eos = eos_token_ids(policy.model, policy.tokenizer)
        generator = HFGenerator(
            policy.model,
            policy.tokenizer,
            eos,
            autocast_bf16=False,
            decode="fast" if decode == "fast" else "hf",
        )
        if device == "cuda":
            assert generator.rng.device.type == "cuda"
        outputs[device] = generator.generate(prompts, greedy)
    for cpu_group, gpu_group in zip(outputs["cpu"], outputs["cuda"], strict=True):
        for cpu, gpu in zip(cpu_group, gpu_group, strict=True):
            assert cpu.token_ids == gpu.token_ids
            assert max(abs(a - b) for a, b in zip(cpu.logprobs, gpu.logprobs, strict=True)) < 1e-4


def test_cuda_graph_decode_samples_what_the_eager_steps_do(tiny_model_dir: Path) -> None:
    """generator.cuda_graphs: the decode steps captured per row bucket and replayed
    (rollout/decode_graphs.py) give the eager fast path's tokens and log-probs, rows leaving at
    EOS on the way (n=4 samples at temperature 1, the same seed), graphs captured and replayed.
    fp32 without TF32: the two differ only in the columns attended over (masked zeros)."""
    from rlvr.models import eos_token_ids, load_policy
    from rlvr.rollout.generator import SamplingParams
    from rlvr.rollout.hf import HFGenerator

    torch.backends.cuda.matmul.allow_tf32 = False
    policy = load_policy(str(tiny_model_dir), device="cuda")
    eos = eos_token_ids(policy.model, policy.tokenizer) | {12, 17}  # rows finish at varied steps
    prompts = [[2, 10, 11, 12, 13], [2, 20, 21], [2, 30, 31, 32, 33, 34, 35]]
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=24)
    replays: list[int] = []
    real = torch.cuda.CUDAGraph.replay

    def counted(graph: torch.cuda.CUDAGraph) -> None:
        replays.append(1)
        real(graph)

    outputs = []
    for graphs in (False, True):
        generator = HFGenerator(
            policy.model, policy.tokenizer, eos, seed=5, autocast_bf16=False, decode="fast",
            decode_dtype=torch.float32, cuda_graphs=graphs,
        )  # fmt: skip
        torch.cuda.CUDAGraph.replay = counted  # type: ignore[method-assign]
        try:
            outputs.append(generator.generate(prompts, sampling))
        finally:
            torch.cuda.CUDAGraph.replay = real  # type: ignore[method-assign]
        assert generator._fast is not None
        assert generator._fast.step_mode == ("graph" if graphs else "eager")
    assert replays, "no graph was replayed"
    lengths = set()
    for eager_group, graph_group in zip(*outputs, strict=True):
        for eager, graph in zip(eager_group, graph_group, strict=True):
            assert eager.token_ids == graph.token_ids
            gaps = [abs(a - b) for a, b in zip(eager.logprobs, graph.logprobs, strict=True)]
            assert max(gaps) < 1e-4
            lengths.add(len(eager.token_ids))
    assert len(lengths) > 1  # rows left the batch at different steps


@pytest.mark.parametrize(
    "algorithm", ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo"]
)
def test_every_algorithm_trains_a_step_on_the_gpu(
    algorithm: str, tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlvr.observe.tracking import read_metrics
    from rlvr.train.loop import train

    cfg = _cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / algorithm,
        f"algorithm={algorithm}",
        "train.steps=2",
        "objective.beta=0.04",
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in rows)


def test_lora_in_bf16_trains_on_the_gpu(
    tiny_config_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rlvr.observe.tracking import read_metrics
    from rlvr.train.loop import train

    cfg = _cfg(
        tiny_config_dir,
        tiny_model_dir,
        tmp_path / "lora",
        "model.lora.enabled=true",
        "model.bf16=on",
        "train.steps=2",
    )
    summary = train(cfg, config_dir=tiny_config_dir)
    rows = [m for m in read_metrics(summary.run_dir) if "loss" in m]
    assert len(rows) == 2 and all(m["perf/precision"] == 16.0 for m in rows)


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_rows_equal_padded_rows_on_the_gpu(tiny_model_dir: Path, attn: str) -> None:
    """The padding-free forward (rlvr.train.packing) on CUDA: with sdpa (an (N, N) block mask) and,
    where flash-attn is installed, flash_attention_2's varlen kernel, the log-probs of packed rows
    equal the padded rows' (fp32, no TF32; flash-attn computes in bf16, so within bf16 rounding)."""
    import importlib.util

    from rlvr.models import load_policy
    from rlvr.records import Trajectory
    from rlvr.train.batch import collate, token_logprobs
    from rlvr.train.packing import packing_is_exact

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    model = load_policy(
        str(tiny_model_dir), device="cuda", dtype=dtype, attn_implementation=attn
    ).model
    rows = [
        Trajectory(
            "a",
            tuple(range(4, 9)) + tuple(range(20, 20 + n)),
            (0,) * 5 + (1,) * n,
            (0.0,) * (5 + n),
            5,
            "",
            "stop",
        )
        for n in (1, 9, 4)
    ]
    advantages = [[0.0] * (len(t.token_ids) - 5) for t in rows]
    padded = collate(rows, advantages, 0, "cuda")
    packed = collate(rows, advantages, 0, "cuda", pack=True)
    assert packing_is_exact(model)
    with torch.no_grad():
        a, _ = token_logprobs(model, padded, share_prefix=False)
        b, _ = token_logprobs(model, packed, share_prefix=False)
    valid = padded.completion_mask_B_C.bool()
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(b[valid], a[valid], rtol=0.0, atol=tolerance)
