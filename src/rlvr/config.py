"""One typed config for `rlvr train` (and `rlvr eval`), each field described once.

Loaded from YAML, overridden with `--set a.b=value`; every error names the field and what is allowed,
in one line. Unknown keys are errors (a typo must not silently fall back to a default).

Longer than our ~500-line guide on purpose: this file is the one place a user reads to learn every
knob of a run (each section, its fields and the per-algorithm defaults), so it is not split.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rlvr.errors import ConfigError
from rlvr.registry import ALGORITHMS as ALGORITHM_REGISTRY
from rlvr.registry import TRACKERS as TRACKER_REGISTRY
from rlvr.registry import Registry, absolute_ref
from rlvr.yaml_types import file_booleans, override_value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def bf16_sampling_copy(
    backend: Any, decode: Any, decode_dtype: Any, bf16: Any, device: Any = "auto"
) -> bool:
    """Whether the sampler decodes from a bf16 copy of the weights while the trainer scores with its
    own: an in-process generator (`generator.backend: hf`) on rlvr's decode path (`decode: fast`,
    or `auto`) with `decode_dtype: bfloat16`, or `auto` where `rlvr.precision.bf16_sampler_on` says
    so (a CPU with native bf16, `model.bf16` not off). Plain values, so that both the resolved config
    (the mismatch monitor) and the raw dict (the truncated-IS default below) ask the same question."""
    if backend == "server" or decode == "hf" or decode_dtype == "float32":
        return False
    from rlvr.precision import bf16_sampler_on  # lazily: it imports torch

    return decode_dtype == "bfloat16" or bf16_sampler_on(str(bf16), str(device))


def decode_path(
    backend: Any, decode: Any, decode_dtype: Any, bf16: Any, device: Any = "auto"
) -> str:
    """`generator.decode` resolved: "fast" or "hf". `auto` takes rlvr's decode path exactly when it
    samples from a bf16 copy (`bf16_sampling_copy`): the copy is what makes it faster (2.1-2.3x
    HF's generate on two native-bf16 CPU kinds, docs/performance.md); in float32 it gains ~5-20%."""
    if decode in ("hf", "fast"):
        return str(decode)
    return "fast" if bf16_sampling_copy(backend, decode, decode_dtype, bf16, device) else "hf"


class LoraConfig(_Section):
    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | list[str] = Field("all-linear", description="peft target_modules.")


class ModelConfig(_Section):
    name: str = Field(
        "smollm2-135m-instruct",
        description="HF model directory, hub id, or alias (smollm2-135m-instruct, tiny-random).",
    )
    lora: LoraConfig = LoraConfig()
    gradient_checkpointing: bool = False
    bf16: Literal["auto", "on", "off"] = Field(
        "auto",
        description="bf16 autocast for the trainer's matmuls (fp32 weights stay the optimizer's master "
        "copy; log-probs and losses stay fp32). 'auto': on a CPU with native bf16 the RL loop times an "
        "update micro-batch both ways and takes bf16 only when it takes <= 0.85x the fp32 time, "
        "cached per host and model size (rlvr.train.precision_choice); fp32 on AVX2-only CPUs and in "
        "offline stages on CPUs; on a CUDA device bf16 where it is native (compute capability 8.0+), "
        "not timed. Sampling never autocasts (a bf16 sampler is generator.decode: fast with a "
        "bf16 copy).",
    )
    device: str = Field(
        "auto",
        description="Where the policy (and its reference, critic, teacher, reward models) lives: "
        "auto = cuda:LOCAL_RANK where CUDA is available, else cpu; or cpu, cuda, cuda:N.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa",
        description="transformers' attention kernel for the update and HF's sampler: sdpa (PyTorch's "
        "fused attention), eager, or flash_attention_2 (needs the flash-attn package and a GPU).",
    )

    @field_validator("device")
    @classmethod
    def _device_known(cls, value: str) -> str:
        text = str(value).strip().lower()
        if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
            return text
        raise PydanticCustomError(
            "device",
            "expected auto, cpu, cuda or cuda:N (N a GPU index), got '{value}'",
            {"value": value},
        )


Operation = Literal["+", "-", "*"]


class ArithmeticConfig(_Section):
    digits: int = Field(2, ge=1, le=6, description="Digits per operand.")
    operations: list[Operation] = Field(default_factory=lambda: list[Operation](["+"]))
    heldout_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of problems never trained on."
    )
    prompt: str = Field("What is {a} {op} {b}?", description="Template with {a}, {op}, {b}.")


class DatasetConfig(_Section):
    path: str = Field(..., description="A .jsonl/.json/.parquet file, or a datasets hub name.")
    split: str = "train"
    heldout_path: str | None = Field(
        None, description="Separate held-out file; else a split is carved."
    )
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    prompt_column: str = "prompt"
    answer_column: str | None = "answer"
    system_column: str | None = None
    extra_columns: list[str] = Field(default_factory=list, description="More fields for verifiers.")


class EnvConfig(_Section):
    name: str = Field(..., description="A built-in env (`rlvr envs` lists them).")
    options: dict[str, Any] = Field(default_factory=dict, description="The env family's options.")
    reward_weights: dict[str, float] = Field(
        default_factory=dict, description="Weight per env reward part, over the env's defaults."
    )
    num_train: int = Field(2000, ge=1, description="Distinct training instances generated.")
    num_heldout: int = Field(200, ge=1, description="Distinct held-out instances generated.")
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)


class TaskConfig(_Section):
    source: Literal["arithmetic", "dataset", "env"] = "arithmetic"
    arithmetic: ArithmeticConfig = ArithmeticConfig()
    dataset: DatasetConfig | None = None
    env: EnvConfig | None = None
    system_prompt: str | None = Field(None, description="Prepended as a system message when set.")

    @model_validator(mode="after")
    def _source_present(self) -> TaskConfig:
        if self.source == "dataset" and self.dataset is None:
            raise ValueError(
                "task.source is 'dataset' but task.dataset is missing (needs at least path)"
            )
        if self.source == "env" and self.env is None:
            raise ValueError("task.source is 'env' but task.env is missing (needs at least name)")
        if self.source == "env" and self.system_prompt is not None:
            raise ValueError(
                "task.system_prompt is not used by an env (the env writes its prompts)"
            )
        return self


class RolloutConfig(_Section):
    """Limits on one episode (multi-turn envs); a single-turn task uses one turn whatever is set."""

    max_turns: int | None = Field(None, ge=1, description="Turn cap; None = the env's default.")
    max_total_tokens: int = Field(
        1024, ge=1, description="Completion tokens per episode: sampled turns + observations."
    )
    max_observation_tokens: int = Field(
        256, ge=1, description="Each observation message is cut to this many tokens."
    )
    observation_truncation: Literal["left", "right", "middle"] = Field(
        "right", description="Which side of a long observation is dropped."
    )
    tool_timeout_s: float = Field(5.0, gt=0.0, description="Wall-clock limit per tool call.")
    max_tool_calls_per_turn: int = Field(4, ge=1)
    tool_format: Literal["auto", "hermes", "qwen3", "llama3_json", "mistral"] = Field(
        "auto",
        description="How tool calls are written and read (docs/envs.md, Tool-call formats): auto = "
        "the chat template's own (Mistral's [TOOL_CALLS], Llama 3.x's JSON turn, Qwen3's "
        "<tool_call> outside <think>, else Hermes <tool_call>); a name forces that format.",
    )
    env_workers: int = Field(
        4,
        ge=1,
        description="Threads stepping envs in parallel (code runs, tools); 1 = the main thread.",
    )
    mode: Literal["internal", "external"] = Field(
        "internal",
        description="internal: rlvr plays the episodes (tasks, envs). external: the user's own agent "
        "(external.agent) talks to the policy through an OpenAI-compatible endpoint and rlvr trains "
        "on the recorded token-exact trajectories (OpenPipe ART's model). `rollout: external` is "
        "shorthand for `rollout: {mode: external}`.",
    )
    async_rollouts: bool = Field(
        False,
        description="Generate the next batches (on a copy of the policy) while the update runs: "
        "up to max_staleness updates off-policy, corrected by objective.off_policy_correction "
        "(truncated IS per token, tis_cap 2.0, unless set).",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="Async rollouts: k, the staleness bound. The sampler runs up to k rounds ahead, "
        "so a batch is sampled by weights up to k updates old (AReaL's eta); one older than that "
        "(several updates per round) is dropped and sampled again. 0 makes async rollouts wait "
        "for the latest weights (no overlap).",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"mode": data} if isinstance(data, str) else data


class VllmLaunch(_Section):
    """How rlvr starts `vllm serve` (`generator.launch: vllm`): flags from here, then launch_args.
    One server per job: under torchrun rank 0 launches it and every rank sends it prompts."""

    dtype: Literal["bfloat16", "float16", "float32", "auto"] = Field(
        "bfloat16",
        description="--dtype. bfloat16 (what RL trainers sync and sample in); auto = vLLM's rule, "
        "which serves an fp32 checkpoint (rlvr's syncs are fp32) in float16. The sampler-mismatch "
        "threshold follows it.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="--gpu-memory-utilization: the share of its GPU vLLM takes (weights + KV cache). "
        "None = 0.3 when the server shares the trainer's GPU (devices unset), leaving the trainer "
        "the rest; vLLM's own 0.9 on GPUs of its own (devices set).",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="--max-model-len (None: the model's; a shorter one saves KV cache).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="--tensor-parallel-size.")
    devices: str | None = Field(
        None,
        description="CUDA_VISIBLE_DEVICES for the server, e.g. '7' or '6,7' (GPUs the trainer's "
        "ranks do not use); None = the launching process's visible GPUs (it shares GPU 0).",
    )


class GeneratorConfig(_Section):
    """Where rollouts are sampled. `hf`: transformers in this process. `server`: an OpenAI-compatible
    server returning token ids and log-probs (vLLM's `vllm serve`, or `rlvr serve` speaking the same
    protocol), weights pushed to it after every update; truncated importance sampling is on (the
    server's numerics differ from the trainer's)."""

    backend: Literal["hf", "server"] = "hf"
    url: str | None = Field(
        None, description="Base URL of a running server, e.g. http://127.0.0.1:8000/v1."
    )
    launch: Literal["vllm", "rlvr"] | None = Field(
        None, description="Start the server as a subprocess: `vllm serve` or `rlvr serve`."
    )
    vllm: VllmLaunch = Field(default_factory=VllmLaunch)
    launch_args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments for the launched server."
    )
    weight_sync: Literal["auto", "lora", "full", "none"] = Field(
        "auto",
        description="After each update: lora = save the adapter and (re)load it by name; full = save "
        "the weights and have the server reload them; auto = lora for LoRA runs, else full; none = "
        "never (the server keeps its weights: evaluation only).",
    )
    sync_dir: str | None = Field(
        None,
        description="Where synced weights are written (a path the server can read); "
        "default RUN_DIR/weight_sync.",
    )
    request_timeout_s: float = Field(600.0, gt=0.0)
    max_concurrency: int = Field(32, ge=1, description="Requests in flight at once.")
    startup_timeout_s: float = Field(600.0, gt=0.0, description="Wait for a launched server.")
    turn_cache: bool = Field(
        True,
        description="hf backend, multi-turn rollouts: keep each live episode's KV cache from one "
        "turn to the next, so a turn prefills only its new tokens (the observation) instead of "
        "the whole conversation. Same samples and log-probs as without it (to float rounding); "
        "dropped when the rollout ends, before every update (rollout/turn_cache.py).",
    )
    turn_cache_mb: float | Literal["auto"] = Field(
        "auto",
        description="Memory cap of the turn cache (MiB); episodes past it re-prefill their "
        "conversation next turn (a warning says how many, once per rollout). auto = 20% of the "
        "memory free when each rollout starts (the model's GPU, else the host's MemAvailable), "
        "at least 1024.",
    )

    @field_validator("turn_cache_mb", mode="before")
    @classmethod
    def _cap_or_auto(cls, value: Any) -> Any:
        text = value.strip().lower() if isinstance(value, str) else None
        if text == "auto":
            return "auto"
        try:
            number = float(value) if text is not None or type(value) in (int, float) else None
        except ValueError:
            number = None
        if number is None or not 0.0 <= number < float("inf"):  # also NaN, bools, lists
            raise PydanticCustomError("cap", "expected auto or a number of MiB >= 0")
        return number

    decode: Literal["auto", "hf", "fast"] = Field(
        "auto",
        description="hf backend: whose forward samples. hf = transformers' layers; fast = rlvr's "
        "own decode path for Llama/SmolLM2 and Qwen2/Qwen3 (static KV cache; float32 reads the "
        "policy's own matrices, LoRA merged into new ones refreshed after every update; tested "
        "token for token against hf, with the cross-turn cache too), falling back to hf for other "
        "models (rollout/fast_decode.py); auto = fast exactly when it samples from a bf16 copy "
        "(decode_dtype), else hf.",
    )
    decode_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="decode: fast, the weights' dtype: a bfloat16 copy (fused QKV and gate/up) "
        "halves the bytes a decode step reads; auto = bfloat16 on a CPU with native bf16 "
        "(avx512_bf16 / AMX) unless model.bf16 is off, else float32 (RLVR_AUTO_BF16=on|off "
        "overrides the CPU check). On such CPUs the copy samples ~2x as fast as HF and learned "
        "more in 10 minutes (docs/performance.md). A bf16 copy samples with other numerics than "
        "the trainer's: truncated importance sampling is then on by default (objective.tis_cap) "
        "and the sampler_mismatch monitor uses its bf16 threshold.",
    )


class DistributedConfig(_Section):
    """Beyond one process: Ray rollout workers, and the update's strategy under torchrun."""

    ray: bool = Field(
        False, description="Play episodes on Ray actors (each with a copy of the policy)."
    )
    rollout_workers: int = Field(2, ge=1, description="Ray actors playing episodes.")
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', 'ray://host:10001'); None = start a local one.",
    )
    worker_cpus: float = Field(1.0, gt=0.0, description="CPUs Ray reserves per rollout worker.")
    worker_gpus: float = Field(0.0, ge=0.0, description="GPUs Ray reserves per rollout worker.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="Under `torchrun --nproc_per_node N`: ddp = every rank holds the weights and "
        "gradients are averaged; fsdp = weights, gradients and optimizer state sharded (FSDP2).",
    )


class ExternalConfig(_Section):
    """`rollout: external`: the agent is the user's code, speaking the OpenAI API to `rlvr serve`."""

    agent: str | None = Field(
        None,
        description="'file.py:function' or 'module:function' called as fn(base_url=, model=, "
        "task=, rollout_id=) for each of G rollouts of each task; returns None, a reward (float) or "
        "a dict of named reward parts, logged and added to the rubric's.",
    )
    command: str | list[str] | None = Field(
        None,
        description="Instead of `agent`: a program run once per rollout (any language), from the "
        "config's folder, with OPENAI_BASE_URL and OPENAI_API_KEY=rlvr-rollout-<id> set (an "
        "unmodified OpenAI client is then recorded under its rollout id), RLVR_ROLLOUT_ID, "
        "RLVR_MODEL and RLVR_TASK (JSON: id, messages, fields). Its last stdout line, when it is "
        "JSON (a number or an object of numbers), is its reward parts; a non-zero exit is an error.",
    )
    concurrency: int = Field(16, ge=1, description="Agent calls running at once (threads).")
    timeout_s: float = Field(600.0, gt=0.0, description="Wall-clock limit for one agent call.")
    host: str = Field("127.0.0.1", description="Where the in-run server listens.")
    port: int = Field(0, ge=0, description="0 = any free port.")


class FilterConfig(_Section):
    """Which sampled groups reach the update. StarPO-S (RAGEN, Wang et al. 2025) keeps the groups whose
    rewards vary most; DAPO (Yu et al. 2025) drops zero-variance groups and samples again."""

    group_filter: Literal["none", "std-top-p", "std-top-k"] = Field(
        "none",
        description="std-top-p: keep the highest-std groups holding top_p of the total std; "
        "std-top-k: keep the top_k_fraction of groups by std.",
    )
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    top_k_fraction: float = Field(0.75, gt=0.0, le=1.0)
    drop_zero_std: bool = Field(False, description="Drop groups whose rewards are all equal.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: keep sampling until prompts_per_step groups survive the filter.",
    )
    max_sampling_rounds: int = Field(3, ge=1, description="Cap on rollout rounds per step.")


class RewardSpec(_Section):
    fn: str = Field(..., description="Built-in name, 'module:function' or 'file.py:function'.")
    name: str | None = Field(None, description="Metric name; defaults to the function's name.")
    weight: float = Field(1.0, description="0 = computed and logged, not optimised.")
    options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments.")
    style: Literal["auto", "rlvr", "trl", "trl_text"] = Field(
        "auto",
        description="How it is called. rlvr: fn(completion_text, **task_fields) per completion. "
        "trl: TRL's batch signature fn(prompts, completions, completion_ids, **columns) -> list of "
        "float or None, chat messages; trl_text: the same with plain strings. auto: trl when the "
        "function has a `completions` parameter, else rlvr (docs/coming_from_trl.md).",
    )


class SamplingConfig(_Section):
    group_size: int = Field(8, ge=2, description="G completions per prompt.")
    prompts_per_step: int = Field(2, ge=1, description="P distinct prompts per step (batch = P*G).")
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list)


class ObjectiveConfig(_Section):
    """The objective and its guard rails. Defaults follow DeepSeekMath's GRPO except where a comment says otherwise."""

    epsilon: float = Field(0.2, gt=0.0, description="PPO clip range, lower side.")
    epsilon_high: float | None = Field(
        None, description="Upper clip (DAPO 'clip-higher' uses 0.28); None = epsilon."
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        description="KL penalty weight. 0 (no reference model) as in DAPO/Dr.GRPO and TRL's default.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    scale_rewards: bool = Field(True, description="Divide advantages by the group std (GRPO).")
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        Field(
            "token-mean",
            description="token-mean is DAPO's (TRL's default); GRPO's paper used seq-mean-token-mean.",
        )
    )
    num_iterations: int = Field(
        1, ge=1, description="Policy updates per generated batch (mu in GRPO)."
    )
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight.")
    credit: Literal["trajectory", "turn", "bi-level", "gigpo"] = Field(
        "trajectory",
        description="trajectory: every policy token gets the trajectory's group advantage; turn: "
        "each turn gets the group advantage of its discounted return; bi-level: both, summed; "
        "gigpo: the trajectory's advantage plus turn_weight x the turn's return normalised among "
        "the group's turns that acted from the same state (GiGPO anchor states).",
    )
    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="Discount across turns (turn, bi-level, gigpo credit)."
    )
    turn_weight: float = Field(
        1.0,
        ge=0.0,
        description="Weight of the turn advantage in bi-level credit (omega of the step "
        "advantage in gigpo).",
    )
    kl_in_reward: bool = Field(
        False,
        description="Put the KL penalty in the reward (per token, InstructGPT/REINFORCE++/PPO) "
        "instead of in the loss (GRPO).",
    )
    tis_cap: float | None = Field(
        None,
        gt=0.0,
        description="Truncated importance sampling: weight each token by min(pi_old / "
        "pi_behaviour, cap) when another engine generates (Yao et al. 2025; 2.0 is usual). "
        "Unless set (null turns it off), 2.0 with a server backend, async rollouts, or decode: "
        "fast from a bf16 weight copy (generator.decode_dtype).",
    )
    off_policy_correction: (
        Literal[
            "tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop", "geo_mask", "none"
        ]
        | None
    ) = Field(
        None,
        description="How tokens another policy sampled count (rlvr/algorithms/off_policy.py): "
        "tis_ truncates the ratio pi_old / pi_behaviour at tis_cap, mis_ drops tokens (sequences) "
        "above it, per token or per sequence (product of ratios); icepop drops tokens whose ratio "
        "leaves off_policy_bounds; geo_mask drops sequences whose geometric-mean ratio leaves them. "
        "Unset: tis_token when tis_cap is set, else none (GSPO weighs tis_token per sequence).",
    )
    off_policy_bounds: tuple[float, float] | None = Field(
        None,
        description="[lo, hi] of icepop and geo_mask; None = [0.5, 5] for icepop (IcePop's), "
        "[0.999, 1.001] for geo_mask.",
    )
    overlong_buffer_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="DAPO soft overlong punishment: completions in the last fraction of the "
        "length limit lose up to overlong_penalty (linear), past it the full penalty.",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="Size of the overlong punishment.")
    mask_truncated: bool = Field(
        False, description="DAPO overlong filtering: truncated completions get no loss."
    )
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (ppo).")
    whiten_advantages: bool = Field(
        True, description="ppo / token-level REINFORCE++: normalise advantages over the batch."
    )

    @model_validator(mode="after")
    def _check_off_policy(self) -> ObjectiveConfig:
        capped = ("tis_token", "tis_sequence", "mis_token", "mis_sequence")
        if self.off_policy_correction in capped and self.tis_cap is None:
            raise ValueError(f"off_policy_correction {self.off_policy_correction} needs tis_cap")
        lo, hi = self.off_policy_bounds or (0.5, 5.0)
        if not 0.0 < lo < hi:
            raise ValueError(f"off_policy_bounds must satisfy 0 < lo < hi, got [{lo}, {hi}]")
        return self


class CriticConfig(_Section):
    """The value model of `algorithm: ppo` (a transformer with a scalar head)."""

    model: str | None = Field(
        None, description="Model to start the critic from; None = the policy's."
    )
    learning_rate: float = Field(1e-5, gt=0.0, description="The critic's own learning rate.")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="Clip value updates to old +- this (PPO2); None = no clipping."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Steps that train only the critic before the policy moves."
    )
    lora: LoraConfig = LoraConfig()


class DistillConfig(_Section):
    """On-policy distillation (`algorithm: distill`): the student samples, the teacher grades every token."""

    teacher: str | None = Field(None, description="Teacher model: alias, directory or hub id.")
    reward_weight: float = Field(
        0.0,
        ge=0.0,
        description="Also follow the verifiable reward: loss = KL + reward_weight * GRPO loss.",
    )


class TrainConfig(_Section):
    steps: int = Field(100, ge=1)
    learning_rate: float = Field(1e-5, gt=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0.0)
    micro_batch_size: int = Field(8, ge=1, description="Trajectories per forward/backward.")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Also cap a micro-batch's padded tokens (rows x longest row): rows are packed "
        "into micro-batches of at most micro_batch_size rows and this many tokens (a row longer "
        "than the cap goes alone). Bounds activation memory when completion lengths vary; None = "
        "rows only. The loss is the same either way (normalisers are over the whole batch).",
    )
    keep_freed_memory: bool = Field(
        True,
        description="Linux/glibc: freed tensor memory stays in the process (no mmap per large "
        "block, no heap trimming), so each step reuses pages instead of faulting fresh ones in "
        "(rlvr.allocator). Update ~1.5x faster on a Xeon with AMX; RSS stays near its peak.",
    )
    skip_zero_advantage_rows: bool = Field(
        True,
        description="Skip forward/backward of rows with advantage 0 when beta = 0 and entropy_coef = 0: "
        "they add exactly 0 to the gradient (the loss normalisers still count them).",
    )
    share_prompt_prefix: bool = Field(
        True,
        description="Run each prompt once per micro-batch and reuse its KV cache for its samples.",
    )
    padding_free: bool | Literal["auto"] = Field(
        "auto",
        description="Where a micro-batch's rows run whole (gradient checkpointing on, or "
        "share_prompt_prefix off), lay them end to end in one sequence with position ids that "
        "restart per row instead of padding them to the longest (rlvr.train.packing; exact: "
        "block-diagonal attention, checked once per model). auto = with a variable-length "
        "attention kernel (flash_attention_2/3) only: with sdpa or eager the packed rows get an "
        "(N x N) mask whose attention costs N^2 (measured in docs/performance.md). A packed "
        "micro-batch counts its real tokens against max_tokens_per_micro_batch.",
    )
    fused_logprobs: bool | Literal["auto"] = Field(
        "auto",
        description="Token log-probs and entropies from hidden states a chunk at a time, never "
        "holding the (rows x length x vocab) logits (rlvr.train.fused_logprobs; bf16 matmuls in a "
        "bf16 update). auto = LoRA runs (either precision) and every run on a GPU (memory binds "
        "there): on CPUs LoRA holds ~260 MB less for ~8% more bf16 "
        "update time. Full fine-tuning: `true` held ~190 MB less at the same bf16 update time "
        "(its logged update GFLOP/s read ~25% lower, not yet explained); in fp32 the recomputed "
        "lm_head matmul costs ~5-10% of the update (measured, docs/performance.md).",
    )
    seed: int = 0
    time_limit_minutes: float | None = Field(
        None,
        gt=0.0,
        description="Wall-clock budget: stop after the first step that ends past it (counted from "
        "the first step's start), with a checkpoint and the final eval as at a normal end.",
    )
    max_reward_error_fraction: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Stop when more than this share of a step's rollouts failed to score.",
    )


class EvalConfig(_Section):
    every: int = Field(0, ge=0, description="Held-out eval every k steps (0 = only start and end).")
    n: int = Field(100, ge=1, description="Held-out tasks evaluated (greedy pass@1).")
    at_start: bool = True
    at_end: bool = True
    max_new_tokens: int | None = Field(None, description="Defaults to sampling.max_new_tokens.")
    metric: str | None = Field(
        None, description="Reward component read as accuracy; default the first."
    )


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="Save every k steps (0 = only at the end).")
    keep_last: int = Field(2, ge=1)
    save_final: bool = True


class TrackingConfig(_Section):
    report_to: list[str] = Field(
        ["trackio"],
        description="Trackers that get the metrics, config, alert events and rollouts table, as "
        "TRL spells them; `none` or [] for metrics.jsonl only (always written). wandb, tensorboard "
        "and mlflow are extras: pip install 'rlvr[wandb]' (docs/tracking.md); your own is "
        "'file.py:NAME', 'package.module:NAME' or an installed plug-in (docs/extending.md).",
    )
    trackio: bool = Field(True, description="false drops trackio from report_to (older configs).")
    project: str = "rlvr"
    run_name: str | None = None
    progress: bool = True
    trajectories_every: int = Field(
        1,
        ge=0,
        description="Save token-level trajectories (for `rlvr inspect`) every k steps; 0 = never.",
    )

    @model_validator(mode="before")
    @classmethod
    def _report_to_as_trl_takes_it(cls, data: Any) -> Any:
        # TRL also takes one name as a string, and "none" for no tracker.
        if isinstance(data, dict) and isinstance(data.get("report_to"), str):
            name = data["report_to"]
            data = {**data, "report_to": [] if name == "none" else [name]}
        return data

    @property
    def trackers(self) -> list[str]:
        """report_to, each once, less trackio when `trackio: false`."""
        names = dict.fromkeys(self.report_to)
        return [n for n in names if n != "trackio" or self.trackio]


class SandboxConfig(_Section):
    """Where model-written code runs (code_tests, the code env): here, or on a sandbox service."""

    url: str | list[str] | None = Field(
        None,
        description="Sandbox service URL(s) (`rlvr sandbox serve`, or SandboxFusion with "
        "api: sandboxfusion): code is sent there, spread across the URLs, instead of run here. "
        "None: RLVR_SANDBOX_URL if set, else this host's sandbox (`rlvr sandbox check`).",
    )
    api: Literal["rlvr", "sandboxfusion"] = Field(
        "rlvr", description="rlvr: /v1/run_tests; sandboxfusion: SandboxFusion's /run_code."
    )
    api_key: str | None = Field(
        None, description="Sent as 'Authorization: Bearer KEY'; default RLVR_SANDBOX_API_KEY."
    )
    timeout_seconds: float = Field(
        300.0,
        gt=0.0,
        description="Longest one check may take, queueing and retries included; past it, or on "
        "any answer that is not a verdict, the reward is an error (never a 0).",
    )


class WatchdogConfig(_Section):
    """Per-phase deadlines (seconds; 0 = not watched). A phase that runs past its deadline gets every
    thread's stack written to RUN_DIR/hang_stacks.txt, a message naming the phase, and the process
    exits with code 124 instead of hanging (docs/monitors.md, "Hang watchdog")."""

    generation_s: float = Field(
        3600.0, ge=0.0, description="One generator call (a turn of every live episode, or an eval)."
    )
    env_step_s: float = Field(600.0, ge=0.0, description="One env.reset or env.step call.")
    reward_s: float = Field(600.0, ge=0.0, description="One reward function on one rollout.")
    update_s: float = Field(
        3600.0, ge=0.0, description="One policy update (all its micro-batches)."
    )
    server_request_s: float = Field(
        1800.0,
        ge=0.0,
        description="One HTTP request to a generation server (completions, weight sync, canary).",
    )
    backstop_grace_s: float = Field(
        10.0,
        gt=0.0,
        description="A hang that holds the GIL (a C extension such as `re` that never lets go) "
        "starves the watchdog thread; faulthandler's C timer then dumps the stacks this long after "
        "the deadline and exits with code 1.",
    )


MonitorAction = Literal["warn", "stop", "mitigate"]


class _Monitor(_Section):
    enabled: bool = Field(True, description="Evaluate this monitor's rules every step.")
    action: MonitorAction = Field(
        "warn",
        description="warn: log and print; stop: finish the step, save a checkpoint, end the run; "
        "mitigate: change the config from the next step (docs/monitors.md says how).",
    )


class EntropyCollapseMonitor(_Monitor):
    """Policy entropy falls below a fraction of its early mean and stays there. Mitigation: StarPO-S."""

    metric: str = Field(
        "completions/neg_logprob_mean",
        description="Entropy metric watched. The default, -log p of the sampled tokens, exists for "
        "every rollout; `entropy` is null when the update skipped every row (all groups equal), "
        "which is exactly when a run has collapsed.",
    )
    early_steps: int = Field(
        5, ge=1, description="Steps (with a value) whose mean is the baseline."
    )
    fraction: float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description="Fires below this share of the baseline. 0.1 (a 10x fall) stays quiet on the "
        "SmolLM2 demo, whose entropy falls ~5x while held-out accuracy climbs 9% -> 67%.",
    )
    patience: int = Field(5, ge=1, description="Consecutive steps below the threshold needed.")


class RewardHackingMonitor(_Monitor):
    """Train reward rising while what it should measure does not. Mitigation: raise objective.beta."""

    window: int = Field(5, ge=1, description="Steps averaged at each end of a comparison.")
    reward_rise: float = Field(
        0.2,
        gt=0.0,
        description="heldout: fires when train reward (mean over `window` steps) rose at least this "
        "since the best earlier held-out eval while eval/accuracy is not above that best + "
        "accuracy_tolerance (and that best is below 1 - accuracy_tolerance).",
    )
    accuracy_tolerance: float = Field(
        0.03,
        ge=0.0,
        description="heldout, length: an accuracy gain up to this counts as flat.",
    )
    component_rise: float = Field(
        0.2,
        gt=0.0,
        description="component: fires when a weighted reward component rose at least this since "
        "the accuracy component's best `window`-step mean while that fell by accuracy_fall.",
    )
    accuracy_fall: float = Field(
        0.1,
        gt=0.0,
        description="component: how far the accuracy component must fall below its best window.",
    )
    length_rise: float = Field(
        0.5,
        gt=0.0,
        description="length: fires when mean completion length rose by this share of its first "
        "`window` steps while the train accuracy component did not rise (accuracy_tolerance).",
    )


class EchoTrapMonitor(_Monitor):
    """RAGEN's Echo Trap (Wang et al. 2025): rewards stop varying within groups, samples repeat,
    gradients spike. Each sign is its own alert (echo_trap/...). Mitigation: StarPO-S filtering."""

    window: int = Field(5, ge=1, description="Steps averaged for the current level.")
    early_steps: int = Field(
        5, ge=1, description="Steps (with a value) whose mean is the baseline."
    )
    zero_std_frac: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="zero_variance: fires when frac_reward_zero_std averaged over `window` steps "
        "is at or above this.",
    )
    std_fraction: float = Field(
        0.25,
        gt=0.0,
        lt=1.0,
        description="std_collapse: fires when rollout/in_group_std averaged over `window` steps is "
        "below this share of its early mean (the demo's lowest is ~0.5 as groups become all-right).",
    )
    duplicate_frac: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="duplicates: fires when rollout/duplicate_frac averaged over `window` steps is "
        "at or above this and at least duplicate_rise above its early mean.",
    )
    duplicate_rise: float = Field(
        0.5, ge=0.0, description="duplicates: the rise over the early mean also required."
    )
    grad_window: int = Field(
        20, ge=2, description="grad_spike: previous grad norms the z-score is measured against."
    )
    grad_min_history: int = Field(
        10, ge=2, description="grad_spike: no verdict before this many previous grad norms."
    )
    grad_z: float = Field(
        6.0,
        gt=0.0,
        description="grad_spike: robust z-score (median, 1.4826 MAD) at or above this fires.",
    )


class KLBlowupMonitor(_Monitor):
    """The KL to the reference runs away (only when there is one: beta > 0). Mitigation: raise beta."""

    max_kl: float = Field(
        1.0,
        gt=0.0,
        description="Fires when the per-token KL (nats, objective.kl_estimator) is above this on "
        "`patience` consecutive steps.",
    )
    patience: int = Field(2, ge=1, description="Consecutive steps above max_kl needed.")
    jump_factor: float = Field(
        10.0,
        gt=1.0,
        description="Also fires when one step's KL is this many times the median of the previous "
        "`jump_window` steps and above min_kl.",
    )
    jump_window: int = Field(
        5, ge=1, description="Previous steps whose median a jump is judged by."
    )
    min_kl: float = Field(
        0.1, ge=0.0, description="A jump below this is ignored (tiny KLs jump harmlessly)."
    )


class NonFiniteMonitor(_Section):
    """A step whose loss or gradient was not finite: the update skipped it (update/skipped_nonfinite)."""

    enabled: bool = Field(True, description="Alert on every skipped step.")
    action: Literal["warn", "stop"] = Field(
        "warn", description="The step is already skipped; 'stop' also ends the run."
    )


class SamplerMismatchMonitor(_Section):
    """The sampler's log-probs drift from the trainer's on the same tokens: a weight sync that did not
    take, another model on the server, or numerics (docs/monitors.md argues the thresholds)."""

    enabled: bool = Field(True, description="Watch the sampler/trainer log-prob gap.")
    action: Literal["warn", "stop"] = Field(
        "warn", description="Nothing to mitigate (a broken sync is not a hyper-parameter)."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="Which threshold applies. auto: fp32 when the trainer and the sampler are both "
        "known fp32 (model.bf16 off and an in-process or `rlvr serve` sampler), else bf16 (a vLLM "
        "or hand-started server is assumed to serve bf16; decode: fast from a bf16 weight copy "
        "samples in bf16).",
    )
    max_abs_diff_fp32: float = Field(
        1e-3,
        gt=0.0,
        description="Mean |sampler - trainer| log-prob per token that fires when both sides are "
        "fp32. Measured noise: ~4e-6; one missed sync at lr 1e-6 (SmolLM2): ~0.016.",
    )
    max_abs_diff_bf16: float = Field(
        0.1,
        gt=0.0,
        description="The same with bf16 on either side. Measured noise (SmolLM2, T 0.7): ~0.03.",
    )
    canary: bool = Field(
        True,
        description="After each weight sync to a server, score a fixed short sequence on both "
        "sides and log the gap as sync/canary_logprob_abs_diff.",
    )


class MonitorsConfig(_Section):
    """Failure-mode monitors evaluated every step on the metric history (docs/monitors.md). Each alert
    is an event row in metrics.jsonl, an `alerts/<name>` metric and a console warning."""

    enabled: bool = Field(True, description="False turns every monitor off.")
    entropy_collapse: EntropyCollapseMonitor = EntropyCollapseMonitor()
    reward_hacking: RewardHackingMonitor = RewardHackingMonitor()
    echo_trap: EchoTrapMonitor = EchoTrapMonitor()
    kl_blowup: KLBlowupMonitor = KLBlowupMonitor()
    nonfinite: NonFiniteMonitor = NonFiniteMonitor()
    sampler_mismatch: SamplerMismatchMonitor = SamplerMismatchMonitor()
    beta_factor: float = Field(
        2.0,
        gt=1.0,
        description="Mitigation: objective.beta becomes max(beta * factor, beta_floor).",
    )
    beta_floor: float = Field(
        0.04,
        gt=0.0,
        description="Beta a beta-0 run gets (DeepSeekMath's GRPO value). A full fine-tuning run "
        "started with beta 0 then loads the base model as its reference.",
    )


def _default_rewards(task: Any) -> list[dict[str, Any]]:
    # Envs score themselves (their reward parts); plain tasks default to a numeric answer check.
    source = task.get("source") if isinstance(task, dict) else getattr(task, "source", None)
    return [] if source == "env" else [{"fn": "numeric_match", "name": "correct"}]


class MixtureComponent(_Section):
    """One source of a mixture: a task set or env with its own rubric, drawn with `weight`."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Used in metric names.")
    weight: float = Field(1.0, gt=0.0, description="Relative sampling weight.")
    task: TaskConfig
    rewards: list[RewardSpec] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _rewards_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rewards" not in data:
            data = {**data, "rewards": _default_rewards(data.get("task", {}))}
        return data


class ScheduleEntry(_Section):
    step: int = Field(..., ge=0, description="From this step on (step 0: from the start).")
    weights: dict[str, float] = Field(
        ..., description="Mixture weight per component name; unnamed ones keep their own."
    )


class CurriculumConfig(_Section):
    """Difficulty levels promoted on rolling train success, and/or mixture weights on a schedule
    (rlvr.train.curriculum, docs/curriculum.md). Off while both lists are empty."""

    levels: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Env option overrides per level, easiest first, over task.env.options.",
    )
    source: str | None = Field(
        None, description="Mixture component the levels apply to (default: the only source)."
    )
    metric: str | None = Field(
        None, description="Reward component (or 'reward') read as success; default eval's metric."
    )
    threshold: float = Field(0.8, description="Promote when the rolling success reaches this.")
    window: int = Field(
        8, ge=1, description="Rolling success = mean of the last N steps at a level."
    )
    min_steps_per_level: int | None = Field(
        None, ge=1, description="Steps at a level before it can be left; default window."
    )
    eval_level: Literal["final", "current"] = Field(
        "final", description="Held-out eval on the final level's tasks, or the current level's."
    )
    schedule: list[ScheduleEntry] = Field(
        default_factory=list, description="Mixture weights from given steps on (needs a mixture)."
    )


def _resolve_extension(registry: Registry[Any], ref: str, config_dir: Any) -> tuple[str, Any]:
    """(`ref` with a relative file made absolute against the config's folder, what it names).

    Asked of rlvr.registry, which lists no names here: a built-in, a file, a module or an installed
    plug-in. An unknown name is a ValueError whose one line names the field and the known names."""
    ref = absolute_ref(ref, config_dir)
    try:
        return ref, registry.resolve(ref)
    except ConfigError as err:
        raise ValueError(str(err)) from None


def _merge_under(defaults: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """`data` over `defaults`, recursively for sections; `data` is not modified."""
    merged = dict(defaults)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge_under(merged[key], value)
        else:
            merged[key] = value
    return merged


class RunConfig(_Section):
    algorithm: str = Field(
        "grpo",
        description="Chooses advantage function, loss and their defaults: a built-in (grpo, "
        "dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp, reinforce_pp_baseline, ppo, distill), "
        "'file.py:NAME', 'package.module:NAME' or an installed plug-in (docs/extending.md).",
    )
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="numeric_match", name="correct")],
        description="Rubric functions; default numeric_match for plain tasks, none for envs.",
    )
    mixture: list[MixtureComponent] = Field(
        default_factory=list,
        description="Several task sets / envs in one run, each with its rubric; replaces task and rewards.",
    )
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    generator: GeneratorConfig = GeneratorConfig()
    distributed: DistributedConfig = DistributedConfig()
    external: ExternalConfig = ExternalConfig()
    filter: FilterConfig = FilterConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    critic: CriticConfig = CriticConfig()
    distill: DistillConfig = DistillConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    monitors: MonitorsConfig = MonitorsConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    sandbox: SandboxConfig = SandboxConfig()
    output_dir: str = Field(
        "runs/latest",
        description="RUN_DIR: metrics, checkpoints, config. A relative path is taken from the "
        "working directory rather than the config file's folder (unlike the reward, env and data "
        "files a config names), so `rlvr train examples/x.yaml` writes runs/ where you run it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _rewards_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "rewards" not in data and not data.get("mixture"):
            data = {**data, "rewards": _default_rewards(data.get("task", {}))}
        return data

    @model_validator(mode="before")
    @classmethod
    def _extensions(cls, data: Any, info: ValidationInfo) -> Any:
        """The algorithm's defaults merged under the config, and the algorithm and trackers named
        as the registry finds them (a relative file made absolute: the saved config works from
        anywhere). `load_config` passes the config file's folder as `config_dir`."""
        if not isinstance(data, dict):
            return data
        config_dir = (info.context or {}).get("config_dir")
        name = data.get("algorithm", "grpo")
        if isinstance(name, str):  # anything else is left to the field's own type error
            ref, algorithm = _resolve_extension(ALGORITHM_REGISTRY, name, config_dir)
            data = _merge_under(dict(algorithm.defaults), {**data, "algorithm": ref})
        tracking = data.get("tracking")
        report_to = tracking.get("report_to") if isinstance(tracking, dict) else None
        if isinstance(report_to, list | str) and report_to != "none":
            names = [report_to] if isinstance(report_to, str) else report_to
            refs = [
                _resolve_extension(TRACKER_REGISTRY, n, config_dir)[0] if isinstance(n, str) else n
                for n in names
            ]
            data = {**data, "tracking": {**tracking, "report_to": refs}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _tis_on_when_off_engine(cls, data: Any) -> Any:
        """Truncated importance sampling (cap 2.0, Yao et al. 2025) unless the user set tis_cap: on
        when another engine (a server), older weights (async rollouts) or a bf16 copy of the weights
        (decode: fast, `bf16_sampling_copy`) sample the tokens."""
        if not isinstance(data, dict):
            return data
        gen, rollout = data.get("generator") or {}, data.get("rollout") or {}
        objective, model = data.get("objective") or {}, data.get("model") or {}
        off_engine = isinstance(gen, dict) and gen.get("backend") == "server"
        stale = isinstance(rollout, dict) and bool(rollout.get("async_rollouts"))
        bf16_copy = isinstance(gen, dict) and bf16_sampling_copy(
            gen.get("backend"),
            gen.get("decode", GeneratorConfig.model_fields["decode"].default),
            gen.get("decode_dtype", GeneratorConfig.model_fields["decode_dtype"].default),
            model.get("bf16", ModelConfig.model_fields["bf16"].default)
            if isinstance(model, dict)
            else None,
            model.get("device", "auto") if isinstance(model, dict) else "auto",
        )
        # A correction named by the user that truncates or masks at the cap gets the cap too.
        correction = objective.get("off_policy_correction") if isinstance(objective, dict) else None
        capped = isinstance(correction, str) and correction.startswith(("tis_", "mis_"))
        if (
            (off_engine or stale or bf16_copy or capped)
            and isinstance(objective, dict)
            and "tis_cap" not in objective
        ):
            data = {**data, "objective": {**objective, "tis_cap": 2.0}}
        return data

    @model_validator(mode="after")
    def _check_sources(self) -> RunConfig:
        if self.model.lora.dropout > 0:
            # The RL update turns dropout off (rlvr.train.batch.disable_dropout): the policy it
            # optimises is the one that sampled, without dropout. Say so rather than ignore it.
            raise ValueError(
                f"model.lora.dropout={self.model.lora.dropout:g} is not used by RL updates (dropout "
                "is off so the trained policy is the one that sampled); set it to 0"
            )
        components = self.components()
        for c in components:
            names = [r.name or r.fn.rsplit(":", 1)[-1] for r in c.rewards]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"reward names must be unique; repeated: {', '.join(dupes)}")
            # An external agent may score its own rollouts (its returned reward parts).
            if not c.rewards and c.task.source != "env" and self.rollout.mode != "external":
                raise ValueError(
                    f"{'mixture ' + c.name + ': ' if self.mixture else ''}rewards is empty; "
                    "a task without an env needs at least one reward function"
                )
        f = self.filter
        if f.dynamic_sampling and f.group_filter == "none" and not f.drop_zero_std:
            raise ValueError(
                "filter.dynamic_sampling needs something to filter: set filter.drop_zero_std "
                "or filter.group_filter"
            )
        obj = self.objective
        if obj.kl_estimator == "k1" and not obj.kl_in_reward:
            # Checked whatever beta is: a monitor's `mitigate` action may raise it during the run.
            raise ValueError(
                "objective.kl_estimator k1 in the loss has zero expected gradient "
                "(E[grad log pi] = 0), so beta would never pull towards the reference: use k2 "
                "(exact reverse-KL gradient on-policy) or k3 (follows KL(ref || pi)), or set "
                "objective.kl_in_reward: true"
            )
        algorithm = ALGORITHM_REGISTRY.resolve(self.algorithm)
        if algorithm.token_credit == "gae" and obj.credit != "trajectory":
            raise ValueError(
                f"objective.credit is not used by {algorithm.name}: GAE assigns credit per token "
                "from the critic (turn rewards land on each turn's last token)"
            )
        if obj.credit == "turn" and not algorithm.group_relative:
            raise ValueError(
                f"objective.credit turn replaces the outcome advantage with group-relative turn "
                f"returns, so {self.algorithm}'s estimator would be unused: use credit bi-level "
                f"({self.algorithm}'s advantage plus the turn term) or trajectory"
            )
        if obj.credit == "gigpo" and not algorithm.group_relative:
            raise ValueError(
                f"objective.credit gigpo adds group-relative step advantages (anchor states) to a "
                f"group-relative episode advantage; {self.algorithm}'s is not: use grpo, dr_grpo, "
                "dapo, gspo or cispo, or credit bi-level"
            )
        if (
            algorithm.token_credit == "reward_to_go"
            and obj.kl_in_reward
            and obj.credit != "trajectory"
        ):
            raise ValueError(
                f"{algorithm.name} with the KL in the reward assigns credit per token (reward-to-go, "
                "each turn's reward on its last token): objective.credit must be trajectory"
            )
        if algorithm.needs_teacher and self.distill.teacher is None:
            raise ValueError(
                f"algorithm '{algorithm.name}' needs distill.teacher (a model alias or directory)"
            )
        if self.rollout.mode == "external" and (self.external.agent is None) == (
            self.external.command is None
        ):
            raise ValueError(
                "rollout: external needs exactly one of external.agent ('file.py:function') and "
                "external.command (a program)"
            )
        gen = self.generator
        if gen.backend == "server" and (gen.url is None) == (gen.launch is None):
            raise ValueError(
                "generator.backend: server needs exactly one of generator.url, generator.launch"
            )
        if self.rollout.async_rollouts and (
            self.rollout.mode == "external" or gen.backend == "server" or self.distributed.ray
        ):
            raise ValueError(
                "rollout.async_rollouts samples on an in-process copy of the policy: use it with "
                "rollout.mode internal, generator.backend hf and without distributed.ray"
            )
        if self.distributed.ray and (self.rollout.mode == "external" or gen.backend == "server"):
            raise ValueError(
                "distributed.ray plays episodes with in-process generators: use it with "
                "rollout.mode internal and generator.backend hf"
            )
        if self.mixture:
            if {"task", "rewards"} & self.model_fields_set:
                raise ValueError("give either mixture or task/rewards, not both")
            names = [c.name for c in self.mixture]
            if len(set(names)) != len(names):
                raise ValueError("mixture component names must be unique")
        return self

    @model_validator(mode="after")
    def _check_curriculum(self) -> RunConfig:
        c, names = self.curriculum, [m.name for m in self.components()]
        where = "curriculum"
        if len(c.levels) == 1:
            raise ValueError(f"{where}.levels needs at least two levels (one is no curriculum)")
        if c.levels:
            if c.source is None and self.mixture:
                raise ValueError(f"{where}.source: name the mixture component the levels apply to")
            name = c.source or names[0]
            if name not in names:
                raise ValueError(
                    f"{where}.source '{name}' is not a task source ({', '.join(names)})"
                )
            if next(m for m in self.components() if m.name == name).task.source != "env":
                raise ValueError(f"{where}.levels override env options: source '{name}' is no env")
        elif c.source is not None or c.metric is not None:
            raise ValueError(f"{where}.source / metric are read only with curriculum.levels")
        if c.schedule and not self.mixture:
            raise ValueError(f"{where}.schedule sets mixture weights: the run has no mixture")
        steps = [e.step for e in c.schedule]
        if steps != sorted(set(steps)):
            raise ValueError(f"{where}.schedule steps must increase: {steps}")
        for i, e in enumerate(c.schedule):
            unknown = sorted(set(e.weights) - set(names))
            if unknown:
                raise ValueError(
                    f"{where}.schedule.{i}.weights: unknown source {unknown[0]!r} ({', '.join(names)})"
                )
            merged = {m.name: e.weights.get(m.name, m.weight) for m in self.mixture}
            if min(merged.values()) < 0 or sum(merged.values()) <= 0:
                raise ValueError(
                    f"{where}.schedule.{i}.weights: need >= 0 and one > 0, got {merged}"
                )
        if (c.levels or c.schedule) and self.rollout.async_rollouts:
            raise ValueError(
                f"{where} changes the task sources between steps; rollout.async_rollouts samples "
                "ahead of them: turn one off"
            )
        return self

    def components(self) -> list[MixtureComponent]:
        """The run's task sources: the mixture, or the single task + rewards as one component."""
        if self.mixture:
            return list(self.mixture)
        return [MixtureComponent(name="main", task=self.task, rewards=self.rewards)]


# ---------------------------------------------------------------------------------------------- loading
def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    kind = first["type"]
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if kind == "extra_forbidden":
        return f"{source}: unknown key '{where}'{more}"
    msg = first["msg"]
    if kind == "literal_error":
        allowed = first.get("ctx", {}).get("expected", "")
        return f"{source}: '{where}' = {first.get('input')!r} is not allowed; expected {allowed}"
    if not first[
        "loc"
    ]:  # a rule across sections: its message says it all; the input is the whole file
        return f"{source}: {msg.removeprefix('Value error, ')}{more}"
    return f"{source}: '{where}': {msg} (got {first.get('input')!r}){more}"


def _parse_override(item: str, schema: type[BaseModel] | None = None) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set '{item}': expected key=value, e.g. train.steps=10")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if schema is not None:  # `model.bf16=off`: the text, where the field is text (yaml_types.py)
        value = override_value(schema, path, raw, value)
    return path, value


def apply_overrides(
    data: dict[str, Any], overrides: list[str], schema: type[BaseModel] | None = None
) -> dict[str, Any]:
    """Set `a.b.c=value` paths in nested config data; a number indexes a list (`stages.0.name=x`).
    With `schema`, a value YAML read as a bool or number goes in as typed where the field is text."""
    for item in overrides:
        path, value = _parse_override(item, schema)
        node: Any = data
        for part in path[:-1]:
            if isinstance(node, list):
                node = _list_item(node, part, item)
                continue
            child = node.get(part)
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, dict | list):
                raise ConfigError(f"--set '{item}': '{part}' is not a section")
            node = child
        if isinstance(node, list):
            index = int(path[-1]) if path[-1].isdigit() else -1
            _list_item(node, path[-1], item)
            node[index] = value
        else:
            node[path[-1]] = value
    return data


def _list_item(items: list[Any], part: str, item: str) -> Any:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"--set '{item}': '{part}' is not an index of a list of {len(items)}")
    return items[int(part)]


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (or start from defaults when path is None), apply `--set` overrides, validate."""
    source = str(path) if path is not None else "config"
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file '{file}' does not exist")
        try:
            loaded = yaml.safe_load(file.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{source}:{where}: malformed YAML: {problem}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of sections, got {type(loaded).__name__}"
            )
        data = file_booleans(loaded, RunConfig)  # `bf16: off` means "off" (yaml_types.py)
    data = apply_overrides(data, overrides or [], RunConfig)
    # Files a config names (algorithm, trackers) are found from its folder.
    context = {"config_dir": Path(path).parent.resolve()} if path is not None else None
    try:
        return RunConfig.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data that `load_config` reads back (a mixture omits task/rewards)."""
    data = cfg.model_dump(mode="json")
    if cfg.mixture:
        data.pop("task", None)
        data.pop("rewards", None)
    return data
