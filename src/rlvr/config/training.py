"""`train:`, `eval:`, `checkpoint:`, `tracking:`, `sandbox:` and `watchdog:`: the optimiser loop and what it records."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from rlvr.config.base import _Section

FULL_FINETUNE_LR = 1e-6  # TRL GRPOConfig, verl actor, RAGEN, verl-agent: train.learning_rate's doc
LORA_LR = 1e-5  # ~10x full fine-tuning's (Schulman et al. 2025, "LoRA Without Regret")


class TrainConfig(_Section):
    steps: int = Field(100, ge=1)
    learning_rate: float = Field(
        FULL_FINETUNE_LR,
        gt=0.0,
        description="1e-6 for full fine-tuning, as TRL's GRPOConfig, verl's actor, RAGEN and "
        "verl-agent (GiGPO): Adam moves each weight by about lr per step whatever the gradient, "
        "and 1e-5 walked warm-started policies off their clone (docs/efficacy_notes.md). With "
        "model.lora.enabled and no value given, 1e-5: LoRA's best rate is ~10x full fine-"
        "tuning's (Schulman et al. 2025, 'LoRA Without Regret').",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="constant (verl's and verl-agent's default), or linear / cosine to 0 after "
        "warmup_steps. With train.time_limit_minutes the decay spans the steps that fit in the "
        "limit (re-estimated after each step from the mean step time), not train.steps, which a "
        "time-limited run never reaches.",
    )
    warmup_steps: int = Field(0, ge=0)
    step_without_signal: bool = Field(
        False,
        description="Take an optimizer step when no row has a non-zero advantage (every kept "
        "group all-equal) and no KL or entropy term adds a gradient. false (the default): skip it "
        "and count it (`update/no_signal`): Adam's momentum would otherwise keep moving the "
        "weights along earlier batches' directions on a step that carried nothing.",
    )
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
