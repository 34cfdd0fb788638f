"""vLLM in the trainer's own process (`generator.backend: vllm_colocate`), TRL's `vllm_mode="colocate"`.

One GPU holds both: the engine samples the round, sleeps while the policy updates (vLLM's sleep
mode, CUDA only: the KV cache is dropped and the weights offloaded, level 1, or discarded, level 2
when a full sync will overwrite them all anyway), wakes, and takes the new weights straight from
the trainer's tensors: `reload_weights` with an iterator of (name, tensor) in the engine's dtype,
cast one tensor at a time, never a file (the server backend's sync writes shards; rollout/server.py).
vLLM's in-place reload re-applies its kernel layouts (the CPU build repacks its linear weights: a
plain `model.load_weights` after start-up fails there). LoRA keeps vLLM's adapter hot-swap: the
adapter (a few MB) is saved to shared memory and requested under a new id each sync.

The protocol is the server backend's: prompts as token ids, the sampled ids and their tempered
log-probs back (`logprobs_mode="processed_logprobs"`), one seed per prompt from (seed, request
counter) so a resumed run sends the seeds the uninterrupted one would have; the canary after each
sync; a model whose head is tied to its embedding runs untied, its head synced explicitly (vLLM's
reload skips a tied head: issue 35).

vLLM runs in process only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (set here before the engine
starts): its engine core then lives in this process and `collective_rpc` reaches the worker
directly, so the weights pass by reference. Single process only: under torchrun use
`generator.backend: server` (one server for the job). On a CPU vLLM binds its threads and keeps
torch at one thread for the whole process: it is there for tests, not speed.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rlvr.config import GeneratorConfig
from rlvr.errors import ConfigError, RlvrError
from rlvr.models import Policy, eos_token_ids
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.server import (
    SHARED_MEMORY,
    VLLM_LORA_RANKS,
    ServerGenerator,
    _merged_state,
    request_seed,
    resolve_weight_sync,
    tied_head_name,
    write_folder,
)


class EngineError(RlvrError):
    """The colocated vLLM engine failed or answered outside the protocol."""


def import_vllm() -> Any:
    """The vllm module, with a one-line error saying how to get it when it is absent."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(
            f"generator.backend vllm_colocate needs vLLM in this environment ({err}): `pip install "
            "vllm` (its CUDA build; on a CPU, `make vllm-cpu` builds .venv-vllm, docs/scaling.md)"
        ) from None
    return vllm


def sleep_wanted(cfg: GeneratorConfig) -> bool:
    """generator.vllm.sleep resolved: auto = on exactly where sleep mode works (CUDA)."""
    if cfg.vllm.sleep == "auto":
        return torch.cuda.is_available()
    if cfg.vllm.sleep == "on" and not torch.cuda.is_available():
        raise ConfigError(
            "generator.vllm.sleep on: vLLM's sleep mode needs a CUDA GPU and this process sees "
            "none (set sleep: auto or off)"
        )
    return cfg.vllm.sleep == "on"


def engine_kwargs(
    cfg: GeneratorConfig,
    model_path: str,
    *,
    seed: int,
    weight_sync: str,
    lora_rank: int | None,
    tied_head: bool,
) -> dict[str, Any]:
    """vllm.LLM's keyword arguments from generator.vllm (then generator.vllm.engine_args, which win)."""
    v = cfg.vllm
    if v.tensor_parallel_size != 1 or v.devices is not None:
        raise ConfigError(
            "generator.backend vllm_colocate samples on the trainer's own GPU: "
            "generator.vllm.tensor_parallel_size must be 1 and devices unset (use backend: server "
            "for an engine on GPUs of its own)"
        )
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": v.dtype,
        "seed": seed,
        # Tempered log-probs, as the trainer scores them (not the raw logits' softmax).
        "logprobs_mode": "processed_logprobs",
        "enable_sleep_mode": sleep_wanted(cfg),
        # The engine shares its GPU with the trainer: a share that leaves the update most of it.
        "gpu_memory_utilization": v.gpu_memory_utilization or 0.3,
    }
    if v.max_model_len is not None:
        kwargs["max_model_len"] = v.max_model_len
    if weight_sync == "lora":
        rank = next((r for r in VLLM_LORA_RANKS if r >= (lora_rank or 16)), VLLM_LORA_RANKS[-1])
        kwargs |= {"enable_lora": True, "max_lora_rank": rank, "max_loras": 2}
    elif weight_sync == "full" and tied_head:
        kwargs["hf_overrides"] = {"tie_word_embeddings": False}  # its own head, synced each step
    return kwargs | dict(v.engine_args)


class ColocatedVllmGenerator:
    """A Generator on `vllm.LLM` in this process. `llm`: the engine (built by `build_colocated`, or
    a stand-in with the same methods in tests). `sync_dir`: where LoRA adapters are saved; removed
    at close when `owns_sync_dir`."""

    get_state = ServerGenerator.get_state  # (seed, request counter): the same resumable stream
    set_state = ServerGenerator.set_state

    def __init__(
        self,
        llm: Any,
        *,
        seed: int = 0,
        weight_sync: str = "full",
        stop_token_ids: Sequence[int] = (),
        sync_dtype: torch.dtype | None = None,
        sleep_mode: bool = False,
        sync_dir: Path | None = None,
        owns_sync_dir: bool = False,
    ) -> None:
        self.llm = llm
        self.seed, self.counter = seed, 0
        self.weight_sync = weight_sync
        self.stop_token_ids = sorted(set(stop_token_ids))
        # The engine's own dtype unless generator.sync_dtype names one.
        self.sync_dtype = sync_dtype or llm.llm_engine.model_config.dtype
        self.sleep_mode = sleep_mode
        self.asleep: int = 0  # the sleep level the engine is in (0: awake)
        self.sync_dir, self.owns_sync_dir = sync_dir, owns_sync_dir
        self.lora_request: Any = None  # the adapter requests name after a LoRA sync
        self.lora_ids = 0
        self.last_sync: dict[str, float] = {}  # sync/weight_bytes, sync/weight_seconds
        self.model = "colocated"  # what the rollout plan broadcasts under torchrun (never used)

    # ------------------------------------------------------------------------------------ generate
    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        if not prompts:
            return []
        self.wake()
        first = self.counter
        self.counter += len(prompts)
        params = [
            self._params(sampling, request_seed(self.seed, first + i)) for i in range(len(prompts))
        ]
        return self._run(prompts, params, sampling.n)

    def canary(self, prompt: Sequence[int], *, n: int, max_tokens: int) -> list[Completion]:
        """`n` samples of `prompt` at temperature 1 with the fixed canary seed, outside the request
        counter (rlvr.train.canary scores them against the trainer)."""
        from rlvr.observe.mismatch import CANARY_SEED

        self.wake()
        sampling = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_tokens)
        return self._run([prompt], [self._params(sampling, CANARY_SEED)], n)[0]

    def _params(self, sampling: SamplingParams, seed: int) -> Any:
        from vllm import SamplingParams as VllmSampling

        return VllmSampling(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=-1,  # explicit: vLLM would take the model's generation_config (top_k 20...)
            min_p=0.0,
            repetition_penalty=1.0,
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=self.stop_token_ids or None,
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob
        )

    def _run(
        self, prompts: Sequence[Sequence[int]], params: list[Any], n: int
    ) -> list[list[Completion]]:
        inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        try:
            outputs = self.llm.generate(
                inputs, params, use_tqdm=False, lora_request=self.lora_request
            )
        except (RuntimeError, ValueError) as err:
            raise EngineError(f"colocated vLLM: generate failed: {err}") from err
        if len(outputs) != len(prompts):
            raise EngineError(f"colocated vLLM returned {len(outputs)} outputs for {len(prompts)}")
        return [self._completions(o, n) for o in outputs]

    def _completions(self, output: Any, n: int) -> list[Completion]:
        samples = sorted(output.outputs, key=lambda s: int(s.index))
        if len(samples) != n:
            raise EngineError(f"colocated vLLM returned {len(samples)} samples for n={n}")
        out = []
        for s in samples:
            ids = [int(t) for t in s.token_ids]
            per_token = s.logprobs or []
            if len(per_token) != len(ids) or any(
                t not in d for t, d in zip(ids, per_token, strict=True)
            ):
                raise EngineError("colocated vLLM returned no log-prob for every sampled token")
            if s.finish_reason not in ("stop", "length"):
                raise EngineError(f"colocated vLLM finished a sample with {s.finish_reason!r}")
            values = tuple(float(d[t].logprob) for t, d in zip(ids, per_token, strict=True))
            out.append(Completion(tuple(ids), values, s.finish_reason))
        return out

    # ---------------------------------------------------------------------------- sleep and wake
    def sleep(self) -> None:
        """Before the update: free the GPU memory the engine holds. Level 2 (weights discarded)
        when a full sync refills every weight afterwards, else level 1 (offloaded to the host)."""
        if not self.sleep_mode or self.asleep:
            return
        level = 2 if self.weight_sync == "full" else 1
        self.llm.sleep(level=level)
        self.asleep = level

    def wake(self, tags: list[str] | None = None) -> None:
        """Wake what sleeps (`tags`: vLLM's "weights" / "kv_cache", None = both)."""
        if not self.asleep:
            return
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = 0

    # --------------------------------------------------------------------------------- weight sync
    def sync_weights(
        self, policy: Policy, step: int, full_state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """The engine samples from `policy`'s current weights from now on: full weights handed over
        in memory (`engine_weights`), or the LoRA adapter under a new id."""
        mode = resolve_weight_sync(self.weight_sync, policy)
        if mode == "none":
            return
        started = time.perf_counter()
        if mode == "lora":
            if not policy.lora:
                raise ConfigError("generator.weight_sync lora needs a LoRA policy (model.lora)")
            self.wake()
            sent = self._sync_adapter(policy, step)
        else:
            # Level 2 discarded the weights: their memory comes back first, the KV cache after
            # the reload, so the two never need the GPU at once with stale copies.
            self.wake(["weights"] if self.asleep == 2 else None)
            counted = ByteCount()
            weights = counted.wrap(engine_weights(policy, self.sync_dtype, full_state))
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            except (RuntimeError, ValueError, AssertionError) as err:
                raise EngineError(f"colocated vLLM: reload_weights failed: {err}") from err
            self.wake()
            self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
            sent = counted.bytes
        self.last_sync = {
            "sync/weight_bytes": float(sent),
            "sync/weight_seconds": time.perf_counter() - started,
        }

    def _sync_adapter(self, policy: Policy, step: int) -> int:
        from vllm.lora.request import LoRARequest

        if self.sync_dir is None:
            raise ConfigError("a LoRA sync to the colocated vLLM needs a sync_dir")
        folder = write_folder(self.sync_dir / f"step-{step}", policy.model.save_pretrained)
        previous = self.lora_request
        self.lora_ids += 1  # vLLM caches adapters by id: a new id loads the new weights
        self.lora_request = LoRARequest(f"rlvr-step-{step}", self.lora_ids, str(folder))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            if Path(previous.lora_path) != folder:
                shutil.rmtree(previous.lora_path, ignore_errors=True)
        return sum(f.stat().st_size for f in folder.rglob("*.safetensors"))

    # ---------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Shut the engine down and give its memory back; remove the adapters' folder."""
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception as err:  # closing anyway: say so, never raise from a finally
                    warnings.warn(f"colocated vLLM did not shut down cleanly: {err}", stacklevel=2)
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self.owns_sync_dir and self.sync_dir is not None:
            shutil.rmtree(self.sync_dir, ignore_errors=True)


class ByteCount:
    """Counts the bytes of the tensors an iterator hands out."""

    def __init__(self) -> None:
        self.bytes = 0

    def wrap(self, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor


@torch.no_grad()
def engine_weights(
    policy: Policy, dtype: torch.dtype, full_state: dict[str, torch.Tensor] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full weights as (checkpoint name, tensor in `dtype`), one cast at a time: a LoRA
    policy merged, a tied head named explicitly (the engine runs it untied). `full_state`: the
    unsharded state dict where the model's own tensors are shards."""
    base = policy.model.get_base_model() if policy.lora else policy.model
    state = full_state if full_state is not None else _merged_state(policy)
    tied = tied_head_name(base)
    for name, tensor in state.items():
        if name != tied:
            yield name, tensor.detach().to(dtype)
    if tied is not None:
        head = state.get(tied)
        if head is None:  # the state dict names the embedding only
            head = base.get_input_embeddings().weight
        yield tied, head.detach().to(dtype)


def adapter_dir(run_dir: Path) -> tuple[Path, bool]:
    """Where LoRA adapters go: a fresh folder in shared memory (removed at close), else
    RUN_DIR/weight_sync. (An adapter is a few MB: room is not checked.)"""
    if SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK):
        return Path(tempfile.mkdtemp(dir=SHARED_MEMORY, prefix="rlvr-sync-")), True
    return run_dir / "weight_sync", False


def build_colocated(
    policy: Policy, cfg: GeneratorConfig, model_path: str, run_dir: Path, *, seed: int
) -> ColocatedVllmGenerator:
    """Start the engine on `model_path` (the run's base model) and sync the policy's weights to it
    (step 0: a resumed or SFT-initialised policy differs from the files)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "generator.backend vllm_colocate runs in a single process; under torchrun use "
            "generator.backend: server (rank 0 launches one vLLM for the job)"
        )
    vllm = import_vllm()
    mode = resolve_weight_sync(cfg.weight_sync, policy)
    base = policy.model.get_base_model() if policy.lora else policy.model
    rank = policy.model.peft_config["default"].r if policy.lora else None
    kwargs = engine_kwargs(
        cfg,
        model_path,
        seed=seed,
        weight_sync=mode,
        lora_rank=rank,
        tied_head=tied_head_name(base) is not None,
    )
    if not torch.cuda.is_available():
        # vLLM's CPU worker drops torch to one thread for the whole process (and then disables
        # torch.set_num_threads) unless OMP_NUM_THREADS is set: the trainer's update would run
        # on one core. Set, it leaves torch's threads as they are.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    try:
        llm = vllm.LLM(**kwargs)
    except (RuntimeError, ValueError, TypeError) as err:
        why = " ".join(str(err).split())  # pydantic's errors span lines: one line here
        raise EngineError(f"colocated vLLM did not start on {model_path}: {why[:500]}") from err
    sync_dir, owned = adapter_dir(run_dir) if mode == "lora" else (None, False)
    dtype = None if cfg.sync_dtype == "auto" else getattr(torch, cfg.sync_dtype)
    generator = ColocatedVllmGenerator(
        llm,
        seed=seed,
        weight_sync=mode,
        stop_token_ids=sorted(eos_token_ids(base, policy.tokenizer)),
        sync_dtype=dtype,
        sleep_mode=bool(kwargs.get("enable_sleep_mode")),
        sync_dir=sync_dir,
        owns_sync_dir=owned,
    )
    try:
        generator.sync_weights(policy, step=0)
    except BaseException:
        generator.close()
        raise
    return generator
