"""Where a step's episodes are played, and how the samplers get the new weights after an update.

One object per run, chosen by the config; the loop calls `sample_round()` (one round of
sampling.prompts_per_step tasks x G, scored), `after_update(step)` and `close()`:

    in process (default)     the engine on the run's generator: HF in process, an
                             OpenAI-compatible server (generator.backend: server) or vLLM in
                             this process (vllm_colocate), synced after every update
                             (rlvr.rollout.server, rlvr.rollout.vllm_colocate)
    rollout: external        the user's agent through the in-run endpoint (rlvr.serve.external)
    distributed.ray          Ray actors, each with a copy of the policy (rlvr.scale.ray_rollout)
    rollout.async_rollouts   a background thread samples round k+1 on a copy while round k trains
                             (rlvr.scale.async_rollout)
    under torchrun           each rank plays its share of the round's tasks, then every rank
                             gathers the whole round (rlvr.scale.torch_dist)
"""

from __future__ import annotations

import copy
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rlvr.build import decode_options, use_bf16
from rlvr.config import RunConfig
from rlvr.devices import device_of
from rlvr.errors import ConfigError
from rlvr.models import Policy, eos_token_ids, matmul_weights_to_bf16
from rlvr.records import Group, Task
from rlvr.rollout.engine import RolloutLimits, rollout_groups
from rlvr.rollout.fast_decode import decline_reason
from rlvr.rollout.generator import Generator, SamplingParams
from rlvr.rollout.hf import HFGenerator
from rlvr.tasks import TaskSplits
from rlvr.train.sources import Sources


def torch_dist_context(cfg: RunConfig) -> Any:
    """The torchrun rank context (rlvr.scale.torch_dist), or None in a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if cfg.rollout.mode == "external" or cfg.distributed.ray or cfg.rollout.async_rollouts:
        raise ConfigError(
            "under torchrun, rollouts are played by the ranks themselves: rollout.mode external, "
            "distributed.ray and rollout.async_rollouts are single-learner options"
        )
    from rlvr.scale.torch_dist import DistContext

    return DistContext.from_env(cfg.distributed.strategy)


class RolloutPlan:
    """The run's way of sampling (see the module docstring). `generator` is the one the held-out
    eval uses (the learner's own, or the synced copy under fsdp)."""

    def __init__(
        self,
        cfg: RunConfig,
        policy: Policy,
        sources: Sources,
        sampling: SamplingParams,
        limits: RolloutLimits,
        *,
        config_dir: Path | None = None,
        tasks: TaskSplits | None = None,
        dist: Any = None,
        run_dir: Path | None = None,
    ) -> None:
        self.cfg, self.policy, self.sources = cfg, policy, sources
        self.sampling, self.limits, self.dist = sampling, limits, dist
        self.external: Any = None
        self.ray: Any = None
        self.async_: Any = None
        self.copy_model: Any = None  # fsdp: an unsharded copy that samples
        self.copy_bf16 = False  # its matmul weights in bf16: checkpoints gather fp32 from shards
        self.canary_gaps: list[float] = []  # since the last metrics(): sync/canary_logprob_abs_diff
        seed = cfg.train.seed + (1000 * dist.rank if dist is not None else 0)
        if cfg.generator.backend == "server":
            self.generator: Any = self._server_generator(run_dir or Path(cfg.output_dir), seed)
        elif cfg.generator.backend == "vllm_colocate":
            self.generator = self._colocated_generator(run_dir or Path(cfg.output_dir), seed)
        elif dist is not None and dist.strategy == "fsdp":
            # Sharded weights cannot sample (every forward would be a collective in lock-step across
            # ranks of unequal decode lengths): generate from a full copy refreshed after each update.
            self.copy_model = copy.deepcopy(policy.model).eval().requires_grad_(False)
            options = decode_options(cfg)
            if options["decode"] == "fast" and options["decode_dtype"] == torch.bfloat16:
                matmul_weights_to_bf16(self.copy_model)  # the fast path then reads them as they are
                self.copy_bf16 = True
            self.generator = self._hf(self.copy_model, seed)
        else:
            self.generator = self._hf(policy.model, seed)
        if cfg.rollout.mode == "external":
            from rlvr.serve.external import ExternalRollout

            self.external = ExternalRollout(cfg, policy, self.generator, sources, config_dir)
        elif cfg.distributed.ray:
            from rlvr.scale.ray_rollout import RayRollout

            self.ray = RayRollout(cfg, config_dir, tasks)
        elif cfg.rollout.async_rollouts:
            from rlvr.scale.async_rollout import AsyncRollout

            self.async_ = AsyncRollout(
                policy,
                lambda model: self._hf(model, seed + 1),
                lambda generator: self._play(generator),
                cfg.rollout.max_staleness,
            )

    def _hf(self, model: Any, seed: int) -> HFGenerator:
        return HFGenerator(
            model,
            self.policy.tokenizer,
            eos_token_ids(model, self.policy.tokenizer),
            seed=seed,
            autocast_bf16=False,  # a bf16 sampler is the fast path's weight copy (rlvr.build)
            # LoRA merged into a temporary fp32 weight per layer while sampling: a CPU tuning (one
            # matmul instead of three); on a GPU it would hold fp32 copies of every adapted weight
            # (~26 GB for a 7B model), so peft's own adapter path samples there.
            merge_lora=device_of(model).type == "cpu",
            turn_cache=self.cfg.generator.turn_cache,
            turn_cache_mb=self.cfg.generator.turn_cache_mb,
            cuda_graphs=self.cfg.generator.cuda_graphs,
            **decode_options(self.cfg),
        )

    def _rollout(self, tasks: list[Task], generator: Generator) -> list[Group]:
        return rollout_groups(
            tasks,
            self.sources.make_env,
            generator,
            self.policy.tokenizer,
            self.sampling,
            self.sources.scoring,
            self.limits,
        )

    def _play(self, generator: Generator) -> list[Group]:
        return self._rollout(self.sources.next_batch(self.cfg.sampling.prompts_per_step), generator)

    def sample_round(self) -> list[Group]:
        """One round: prompts_per_step tasks x G trajectories, scored, in task order."""
        if self.async_ is not None:
            return list(self.async_.next_round())
        batch = self.sources.next_batch(self.cfg.sampling.prompts_per_step)
        if self.dist is not None:  # every rank drew the same batch; each plays its share
            batch = self.dist.shard(batch)
        if self.external is not None:
            groups = self.external.rollout(batch, self.sampling.n)
        elif self.ray is not None:
            groups = self.ray.rollout(batch, self.sampling, self.limits)
        else:
            groups = self._rollout(batch, self.generator)
        if self.dist is not None:
            groups = self.dist.all_gather_objects(groups)
        return groups

    def metrics(self) -> dict[str, float]:
        """The samplers' own numbers for the last round (worker balance, staleness, agent errors),
        and the worst weight-sync canary gap since the last call."""
        out: dict[str, float] = {}
        for part in (self.external, self.ray, self.async_):
            if part is not None:
                out = dict(part.last_metrics)
                break
        if self.canary_gaps:
            out["sync/canary_logprob_abs_diff"] = max(self.canary_gaps)
            self.canary_gaps.clear()
        # A server's last sync: its files' bytes and the seconds from writing them to reloaded.
        if getattr(self.generator, "last_sync", None):
            out.update(self.generator.last_sync)
            self.generator.last_sync = {}
        if hasattr(self.generator, "take_decode_stats"):  # the in-process sampler's decode speed
            out.update(self.generator.take_decode_stats())
        return out

    def _server_generator(self, run_dir: Path, seed: int) -> Any:
        """The generation server: launched (or found at generator.url) and synced to step 0 by this
        process, or under torchrun by rank 0 alone, whose URL, key and served name the other ranks
        take: one server per job, each rank sending it its share of the prompts (with request seeds
        of its own)."""
        from rlvr.rollout.server import ServerGenerator, build_server_generator, resolve_weight_sync

        dist, cfg = self.dist, self.cfg
        generator: Any = None
        if dist is None or dist.is_main:
            generator = build_server_generator(self.policy, cfg, run_dir, seed=seed)
        if dist is not None:
            where = None
            if dist.is_main:
                where = (generator.root, generator.api_key, generator.base_model, generator.model)
            root, api_key, base_model, model = dist.broadcast_object(where)
            if not dist.is_main:
                generator = ServerGenerator(
                    root + "/v1",
                    base_model,
                    seed=seed,
                    max_concurrency=cfg.generator.max_concurrency,
                    request_timeout_s=cfg.generator.request_timeout_s,
                    weight_sync=resolve_weight_sync(cfg.generator.weight_sync, self.policy),
                    stop_token_ids=sorted(eos_token_ids(self._base_model(), self.policy.tokenizer)),
                    api_key=api_key,
                )
                generator.model = model
        self.generator = generator
        try:
            self._canary()  # the initial sync (step 0) is checked too
        except BaseException:
            generator.close()  # stops a launched server: nothing else will
            raise
        return generator

    def _colocated_generator(self, run_dir: Path, seed: int) -> Any:
        """vLLM in this process (rlvr.rollout.vllm_colocate), synced to step 0 and checked by the
        canary like a server."""
        from rlvr.models import resolve_model_path
        from rlvr.rollout.vllm_colocate import build_colocated

        path = resolve_model_path(self.cfg.model.name)
        generator = build_colocated(self.policy, self.cfg.generator, path, run_dir, seed=seed)
        self.generator = generator
        try:
            self._canary()
        except BaseException:
            generator.close()
            raise
        return generator

    def _base_model(self) -> Any:
        model = self.policy.model
        return model.get_base_model() if self.policy.lora else model

    def _sync_server(self, step: int) -> None:
        """The server samples from the updated weights: one sync per job (rank 0's; under fsdp from
        the weights gathered on every rank, a collective), then every rank uses the served name it
        announces (a LoRA adapter's changes with each sync)."""
        dist = self.dist
        if dist is None:
            self.generator.sync_weights(self.policy, step)
        else:
            # Only rank 0 writes the sync folder: the others take part in the gather, keep nothing.
            full = dist.full_state_dict(self.policy.model, keep=dist.is_main) if dist.fsdp else None
            if dist.is_main:
                self.generator.sync_weights(self.policy, step, full_state=full)
            del full
            self.generator.model = dist.broadcast_object(self.generator.model)
        self._canary()

    def _canary(self) -> None:
        """After a sync to a server: score the fixed canary on both sides (rlvr.train.canary).
        Under torchrun rank 0 samples it and every rank scores it (an fsdp forward is collective)."""
        from rlvr.rollout.server import resolve_weight_sync
        from rlvr.train.canary import canary_gap, sample_canary

        c = self.cfg.monitors.sampler_mismatch
        if (
            not c.canary
            or resolve_weight_sync(self.cfg.generator.weight_sync, self.policy) == "none"
        ):
            return
        dist, completions = self.dist, None
        if dist is not None:
            drawn = sample_canary(self.generator, self.policy.tokenizer) if dist.is_main else None
            completions = dist.broadcast_object(drawn)
        gap = canary_gap(
            self.generator, self.policy, bf16=use_bf16(self.cfg.model), completions=completions
        )
        if not math.isnan(gap):  # NaN: every canary sample was empty
            self.canary_gaps.append(gap)

    def abandon(self) -> None:
        """The run is being killed (the hang watchdog): stop a launched server at once, since it
        lives in its own process group and would outlive this process."""
        process = getattr(self.generator, "process", None)
        if process is not None:
            from rlvr.rollout.server import stop_process

            stop_process(process, timeout_s=2.0)
        if getattr(self.generator, "owns_sync_dir", False):  # shared memory would outlive it too
            shutil.rmtree(self.generator.sync_dir, ignore_errors=True)

    def after_update(self, step: int) -> None:
        """Send the updated weights to whatever samples."""
        if self.cfg.generator.other_engine():
            self._sync_server(step)
        if self.ray is not None:
            self.ray.sync_weights(self.policy)
        if self.async_ is not None:
            self.async_.publish(self.policy)
        self._refresh_copy()
        self._refresh_decode_weights()

    def store_frozen_base_bf16(self) -> bool:
        """A LoRA policy with a bf16 update that samples from the fast path's bf16 copy: store the
        frozen base's matmul weights in bf16 (`models.matmul_weights_to_bf16`), as the reference
        copy of full fine-tuning is. Every forward of it then runs under bf16 autocast (the update;
        the reference, adapters off) or reads the copy (the sampler), which takes the same values:
        the update is bit-identical (tests/test_lora_bf16_base.py), skips a 270 MB cast per forward
        and the run holds ~300 MB less (SmolLM2-135M on a Xeon with AMX: LoRA update 3.7 -> 3.4 s,
        peak RSS 2.7 -> 2.4 GB). Only for the in-process sampler (a server, Ray, async or torchrun
        sampler loads weights of its own); should HF's fp32 forward be asked of the model later (a
        hook makes the fast path decline), the generator turns them back to fp32 and warns."""
        g, cfg = self.generator, self.cfg
        if not (self.policy.lora and use_bf16(cfg.model)) or not isinstance(g, HFGenerator):
            return False
        elsewhere = (self.external, self.ray, self.async_, self.dist, self.copy_model)
        if any(part is not None for part in elsewhere) or g.autocast_bf16:
            return False
        if g.decode != "fast" or g.decode_dtype != torch.bfloat16:
            return False
        if decline_reason(self.policy.model) is not None:
            return False
        matmul_weights_to_bf16(self.policy.model)
        return True

    def before_update(self) -> None:
        """The rollouts are in: the in-process sampler's bf16 weight copy (269 MB for SmolLM2-135M)
        goes now rather than after the update, so the update's peak memory does not hold it; the
        next `generate` rebuilds it from the new weights, as it would have anyway. (An async
        producer samples with a generator of its own, untouched here.) A colocated vLLM goes to
        sleep: the update gets the GPU memory its weights and KV cache held."""
        self._refresh_decode_weights()
        sleep = getattr(self.generator, "sleep", None)
        if callable(sleep):
            sleep()

    def _refresh_decode_weights(self) -> None:
        """The in-process generator's fast-decode weight copy (generator.decode: fast) is stale."""
        if isinstance(self.generator, HFGenerator):
            self.generator.refresh_weights()

    def _refresh_copy(self) -> None:
        if self.copy_model is not None:  # gathered tensor by tensor on the device (collective)
            self.dist.copy_full_weights(self.policy.model, self.copy_model)

    def before_save(self) -> None:
        """Before a checkpoint: async, wait until the producer is between rounds (the task sampler's
        state is then not moving); fsdp, gather the full weights into the sampling copy (every rank
        calls it: collective)."""
        if self.async_ is not None:
            self.async_.wait_idle()
        self._refresh_copy()

    def after_resume(self, step: int) -> None:
        """The samplers start from the checkpoint's (step's) weights, not the base model's."""
        if self.cfg.generator.other_engine():
            self._sync_server(step)
        if self.ray is not None:
            self.ray.sync_weights(self.policy)
        if self.async_ is not None:  # the copy was taken before the checkpoint was loaded
            self.async_.publish(self.policy)
        self._refresh_copy()  # fsdp: gathered from the shards (collective)
        self._refresh_decode_weights()

    def evaluate(self, default: Any) -> dict[str, float]:
        """Held-out eval: the agent's for an external run, else `default()` (the engine's)."""
        if self.external is not None:
            source = next(iter(self.sources))
            return dict(
                self.external.evaluate(source.splits.heldout[: self.cfg.eval.n], source.metric)
            )
        return dict(default())

    def close(self) -> None:
        for part in (self.external, self.ray, self.async_):
            if part is not None:
                part.close()
        closer = getattr(self.generator, "close", None)
        if self.cfg.generator.other_engine() and callable(closer):
            closer()
