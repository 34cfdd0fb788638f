"""`rollout:`, `generator:`, `sampling:`, `filter:`, `external:` and `distributed:`: how episodes are sampled and where."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rlvr.config.base import _Section


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
    history: Literal["full", "window"] = Field(
        "full",
        description="What each turn is sampled from (docs/envs.md, History). full: the whole "
        "conversation so far; the episode is one training row. window: the opening (system + first "
        "user message) plus the last history_turns turns (action + observation pairs), and each "
        "turn is its own training sample (verl-agent's memory, SkyRL / prime-rl non-prefix "
        "histories): the update's cost grows linearly with turns, not quadratically.",
    )
    history_turns: int = Field(
        2, ge=1, description="history: window, K: the turns kept after the opening."
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

    @model_validator(mode="after")
    def _window_is_internal(self) -> RolloutConfig:
        if self.mode == "external" and self.history == "window":
            raise ValueError(
                "rollout.history window: rlvr plays the episodes to cut their history, but "
                "rollout.mode external leaves the prompts to your agent (set history: full)"
            )
        return self


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
    sleep: Literal["auto", "on", "off"] = Field(
        "auto",
        description="generator.backend vllm_colocate: put the engine to sleep (vLLM's sleep mode) "
        "while the policy updates, so the update has the GPU memory the engine's weights and KV "
        "cache held, and wake it for the next sync; auto = on a GPU (sleep mode needs CUDA).",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="generator.backend vllm_colocate: more keyword arguments for vllm.LLM, e.g. "
        "{enforce_eager: true, max_num_seqs: 64}; they win over the ones rlvr sets.",
    )


class GeneratorConfig(_Section):
    """Where rollouts are sampled. `hf`: transformers in this process. `server`: an OpenAI-compatible
    server returning token ids and log-probs (vLLM's `vllm serve`, or `rlvr serve` speaking the same
    protocol), weights pushed to it after every update. `vllm_colocate`: a vLLM engine in the
    trainer's own process and GPU (TRL's `vllm_mode="colocate"`), asleep during the update, the
    weights handed to it in memory (rollout/vllm_colocate.py). With either engine truncated
    importance sampling is on (its numerics differ from the trainer's)."""

    backend: Literal["hf", "server", "vllm_colocate"] = "hf"
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
        description="Where synced weights are written (a path the server can read). Default: for a "
        "launched server, a folder in shared memory (/dev/shm, removed at close) when it has room "
        "for two copies of the weights, so a sync never touches the disk; else RUN_DIR/weight_sync.",
    )
    sync_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="dtype of a full-weight sync's files. auto = the dtype the server computes in: "
        "a launched vLLM's generator.vllm.dtype (or a --dtype in launch_args), float32 for rlvr "
        "serve and for vLLM's own `auto` rule; for a server at generator.url, float32 unless "
        "generator.vllm.dtype is set (rlvr cannot ask a vLLM its dtype). A bf16 server gets half "
        "the bytes of an fp32 sync and loses nothing it would have kept.",
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

    def other_engine(self) -> bool:
        """Whether an engine other than the trainer's forward samples (a server, or vLLM in
        process): its numerics differ, its weights are synced after each update."""
        return self.backend in ("server", "vllm_colocate")

    def served_dtype(self) -> str:
        """The dtype the server runs, as the config says it: `--dtype` in launch_args (as in argv,
        it wins), else generator.vllm.dtype; float32 for rlvr serve. vLLM's names ("auto",
        "float", "half" too) are returned as given. A colocated engine: generator.vllm.dtype."""
        if self.backend == "vllm_colocate":  # engine_args win, as in vllm.LLM's keywords
            return str(self.vllm.engine_args.get("dtype", self.vllm.dtype))
        if self.launch == "rlvr":
            return "float32"
        for i, arg in enumerate(self.launch_args):
            if arg == "--dtype" and i + 1 < len(self.launch_args):
                return self.launch_args[i + 1]
            if arg.startswith("--dtype="):
                return arg.split("=", 1)[1]
        return self.vllm.dtype

    def resolved_sync_dtype(self) -> str:
        """generator.sync_dtype with auto resolved: bfloat16, float16 or float32."""
        if self.sync_dtype != "auto":
            return self.sync_dtype
        at_url = self.launch is None and self.backend == "server"
        if at_url and "dtype" not in self.vllm.model_fields_set:
            return "float32"  # a server rlvr did not launch: its dtype is unknown
        served = self.served_dtype()
        return {"bfloat16": "bfloat16", "float16": "float16", "half": "float16"}.get(
            served, "float32"
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
    cuda_graphs: bool = Field(
        False,
        description="decode: fast on a CUDA device: run each decode step as a CUDA graph "
        "replayed per row bucket (fixed shapes, one launch instead of ~2,000 small kernels; "
        "rollout/decode_graphs.py). Off until a GPU run has measured it; ignored on a CPU.",
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


class SamplingConfig(_Section):
    group_size: int = Field(8, ge=2, description="G completions per prompt.")
    prompts_per_step: int = Field(2, ge=1, description="P distinct prompts per step (batch = P*G).")
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list)
