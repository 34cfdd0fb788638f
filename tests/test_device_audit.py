"""Issue 34: every tensor rlvr creates is made on a device it names, so a run on a GPU keeps it there.

No GPU here, so the proof is a proxy: tiny training runs (single- and multi-turn, several algorithms,
LoRA and full fine-tuning, eval, decode "hf" and "fast", the offline SFT and DPO stages) under a
`TorchFunctionMode` that records every tensor factory (`torch.zeros`, `full`, `arange`, `tensor`,
`rand*`, ...) called directly from a file under src/rlvr without a `device=` argument (or with
`device=None`), and every `torch.Generator` built there without a device. On a GPU such a tensor
lands on the host: the sampler's mask meets the model's CUDA keys and the first eval raises a
device-mismatch error (or, when it is `.to(device)`-ed at once, it costs a host allocation and a
copy per call). The `*_like` / `Tensor.new_*` factories inherit their source's device and pass;
so does an explicit `device="cpu"`, which says the tensor is meant to stay on the host (metrics,
host-side bookkeeping). The failure names each file:line.

Not seen: code run in other threads (torch's mode stack is per thread: async rollouts, env worker
threads) or other processes (Ray actors, servers), and paths these runs do not take.
tests/test_cuda.py runs the same kind of runs on a real GPU (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rlvr
from rlvr.config import load_config
from rlvr.train.loop import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SRC = Path(rlvr.__file__).resolve().parent

# Factories that allocate a new tensor on the default device (the host) unless told otherwise.
FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.empty_strided,
    torch.arange,
    torch.range,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.normal,
}
# Given a tensor, these return it (or a copy) where it already is.
FROM_DATA = {torch.tensor, torch.as_tensor}


def _caller(depth: int) -> tuple[str, int] | None:
    """(path under src/rlvr, line) of the Python frame that made the call, if rlvr's own code."""
    frame = sys._getframe(depth)
    while frame.f_code.co_name == "__torch_function__" and frame.f_back is not None:
        frame = frame.f_back  # forwarded by another mode (SkinnyLinear): its caller made the call
    path = Path(frame.f_code.co_filename)
    if not path.is_absolute() or SRC not in path.resolve().parents:
        return None
    return f"src/rlvr/{path.resolve().relative_to(SRC)}", frame.f_lineno


class DeviceAudit(TorchFunctionMode):
    """Records rlvr's device-less tensor factories and generators: `found[(file, line)] = name`."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[tuple[str, int], str] = {}

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            from_tensor = func in FROM_DATA and args and isinstance(args[0], torch.Tensor)
            site = None if from_tensor else _caller(2)
            if site is not None:
                self.found.setdefault(site, func.__name__)
        return func(*args, **kwargs)

    @property
    def report(self) -> str:
        return "\n".join(
            f"  {f}:{line}: torch.{name}" for (f, line), name in sorted(self.found.items())
        )


@pytest.fixture()
def audit(monkeypatch: pytest.MonkeyPatch) -> Iterator[DeviceAudit]:
    """The mode, entered for the test's body, with `torch.Generator` patched to record rlvr's
    device-less generators (a constructor, not a function the mode sees)."""
    mode = DeviceAudit()
    real = torch.Generator

    class _Meta(type):
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, real)

    class AuditedGenerator(metaclass=_Meta):
        def __new__(cls, device: Any = None) -> Any:
            if device is None:
                site = _caller(2)
                if site is not None:
                    mode.found.setdefault(site, "Generator")
            return real() if device is None else real(device)

    monkeypatch.setattr(torch, "Generator", AuditedGenerator)
    with mode:
        yield mode
    monkeypatch.setattr(torch, "Generator", real)


def _assert_clean(audit: DeviceAudit) -> None:
    assert not audit.found, (
        "tensors created by rlvr without a device (on a GPU they land on the host):\n"
        + audit.report
    )


def _config(tmp_path: Path, model_dir: Path, name: str, *overrides: str) -> Any:
    for file in (name, "tiny_rewards.py", "tiny_envs.py"):
        if not (tmp_path / file).exists():
            shutil.copy(EXAMPLES / file, tmp_path / file)
    return load_config(
        tmp_path / name,
        [
            f"model.name={model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "tracking.progress=false",
            "model.bf16=off",
            "train.steps=1",
            "sampling.group_size=4",
            "sampling.prompts_per_step=2",
            "sampling.max_new_tokens=6",
            "eval.n=2",
            *overrides,
        ],
    )


RUNS = {
    # full fine-tuning with a KL reference, eval at both ends, top-p and stop strings, HF's forward
    "grpo-full-hf": (
        "tiny.yaml",
        "algorithm=grpo",
        "objective.beta=0.04",
        "sampling.top_p=0.9",
        "sampling.stop=['7']",
        "generator.decode=hf",
    ),
    # the critic, LoRA, rlvr's decode path
    "ppo-lora-fast": (
        "tiny.yaml",
        "algorithm=ppo",
        "model.lora.enabled=true",
        "generator.decode=fast",
        "eval.at_start=false",
    ),
    # the teacher (the tiny model itself: same tokenizer), full fine-tuning, the fast path
    "distill-fast": (
        "tiny.yaml",
        "algorithm=distill",
        "generator.decode=fast",
        "eval.at_start=false",
    ),
    # turns, the cross-turn KV cache on HF's path; a checkpointed, padding-free update
    "multiturn-grpo-hf": (
        "tiny_multiturn.yaml",
        "generator.decode=hf",
        "rollout.max_turns=2",
        "model.gradient_checkpointing=true",
        "train.padding_free=true",
        "eval.at_start=false",
    ),
    # turns on rlvr's decode path (its static cache in the turn store), LoRA, rloo
    "multiturn-rloo-lora-fast": (
        "tiny_multiturn.yaml",
        "algorithm=rloo",
        "objective.credit=bi-level",
        "model.lora.enabled=true",
        "generator.decode=fast",
        "rollout.max_turns=2",
        "eval.at_start=false",
    ),
    # the other algorithms, quickly: no eval
    **{
        algorithm: (
            "tiny.yaml",
            f"algorithm={algorithm}",
            "eval.at_start=false",
            "eval.at_end=false",
        )
        for algorithm in (
            "dapo",
            "dr_grpo",
            "gspo",
            "cispo",
            "reinforce_pp",
            "reinforce_pp_baseline",
        )
    },
}


def test_the_audit_sees_what_it_should(audit: DeviceAudit) -> None:
    """Code compiled as if it were a file of rlvr's: device-less factories and generators are
    reported with their lines; a device, a `*_like` source, a tensor given to `torch.tensor`, and
    code outside rlvr are not."""
    code = "\n".join(
        [
            "x = torch.zeros(3)",  # 1: reported
            "g = torch.Generator()",  # 2: reported
            "torch.arange(4, device=x.device)",
            "torch.zeros_like(x); x.new_ones(2)",
            "torch.as_tensor(x); torch.tensor([1], device='cpu')",
            "torch.full((2,), 1.0, device=None)",  # 6: reported (None is the host)
            "assert isinstance(g, torch.Generator)",
        ]
    )
    exec(compile(code, str(SRC / "not_a_module.py"), "exec"), {"torch": torch})
    exec(compile("torch.zeros(3)", __file__, "exec"), {"torch": torch})
    assert audit.found == {
        ("src/rlvr/not_a_module.py", 1): "zeros",
        ("src/rlvr/not_a_module.py", 2): "Generator",
        ("src/rlvr/not_a_module.py", 6): "full",
    }
    audit.found.clear()


@pytest.mark.parametrize("run", list(RUNS))
def test_training_creates_every_tensor_on_a_named_device(
    run: str, tiny_model_dir: Path, tmp_path: Path, audit: DeviceAudit
) -> None:
    name, *overrides = RUNS[run]
    if "algorithm=distill" in overrides:
        overrides.append(f"distill.teacher={tiny_model_dir}")
    if "algorithm=reinforce_pp" in overrides:
        overrides.append("objective.beta=0.1")  # the KL in the reward
    cfg = _config(tmp_path, tiny_model_dir, name, *overrides)
    train(cfg, config_dir=tmp_path)
    _assert_clean(audit)


def test_offline_stages_create_every_tensor_on_a_named_device(
    tiny_model_dir: Path, tmp_path: Path, audit: DeviceAudit
) -> None:
    """SFT (packed, LoRA), DPO with its reference, and teacher data sampled by HFGenerator."""
    from rlvr.offline import (
        DistillDataConfig,
        DPOConfig,
        SFTConfig,
        generate_teacher_data,
        train_dpo,
        train_sft,
    )

    common = {"steps": 1, "batch_size": 4, "micro_batch_size": 2, "max_length": 64}
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"say {i}"},
                {"role": "assistant", "content": f"{i}"},
            ]
        }
        for i in range(8)
    ]
    model = {"name": str(tiny_model_dir), "bf16": "off"}
    sft = {"model": model, "data": {"heldout_fraction": 0.25}}
    train_sft(
        SFTConfig.model_validate(
            {**sft, "output_dir": str(tmp_path / "sft"), "packing": True, "train": common}
        ),
        rows=chats,
    )
    train_sft(
        SFTConfig.model_validate(
            {
                **sft,
                "output_dir": str(tmp_path / "sft-lora"),
                "model": {**model, "lora": {"enabled": True}},
                "train": common,
            }
        ),
        rows=chats,
    )
    pairs = [{"prompt": f"is {i}?", "chosen": "yes", "rejected": "no"} for i in range(8)]
    train_dpo(
        DPOConfig.model_validate({**sft, "output_dir": str(tmp_path / "dpo"), "train": common}),
        rows=pairs,
    )
    generate_teacher_data(
        DistillDataConfig(
            teacher=str(tiny_model_dir),
            bf16="off",
            prompts_path="unused.jsonl",
            samples_per_prompt=2,
            max_new_tokens=4,
            drop_truncated=False,
            output_path=str(tmp_path / "teacher.jsonl"),
        ),
        rows=[{"prompt": f"say {i}", "answer": str(i)} for i in range(3)],
    )
    _assert_clean(audit)
