"""Offline distillation data: a teacher model answers prompts, and its answers become SFT rows.

Sequence-level knowledge distillation (Kim & Rush 2016): the student is fine-tuned on the teacher's
sampled text, not on its token distributions, so teacher and student need not share a tokenizer.
Sampling uses rlvr's `HFGenerator` (one prefill per prompt shared by its samples). With `reward`
set, only samples that reward scores >= `min_reward` are kept: rejection sampling, as in RAFT
(Dong et al. 2023) and STaR (Zelikman et al. 2022), so a verifier can filter the teacher's mistakes.

The output is chat-format JSONL (`{"messages": [...prompt, assistant]}`, plus `reward` when scored)
that `train_sft` reads; OUTPUT.stats.json next to it counts what was kept and dropped and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlvr.build import build_rubric
from rlvr.errors import ConfigError
from rlvr.models import eos_token_ids, load_policy
from rlvr.offline.common import seed_everything
from rlvr.offline.config import DistillDataConfig
from rlvr.offline.data import Message, as_messages, load_rows, render_ids, source_name
from rlvr.precision import bf16_setting_on
from rlvr.records import Task, Trajectory
from rlvr.rollout.generator import Completion, SamplingParams
from rlvr.rollout.hf import HFGenerator


def prompt_messages(row: dict[str, Any], where: str, cfg: DistillDataConfig) -> list[Message]:
    """The prompt of a row: `cfg.prompt_column` (a user string or messages), else `messages`."""
    if cfg.prompt_column in row:
        messages = as_messages(row[cfg.prompt_column], "user", where, cfg.prompt_column)
    elif "messages" in row:
        messages = as_messages(row["messages"], "user", where, "messages")
    else:
        raise ConfigError(f"{where}: no '{cfg.prompt_column}' or 'messages' field")
    if messages[-1]["role"] == "assistant":
        raise ConfigError(f"{where}: the prompt ends with an assistant message; nothing to answer")
    if cfg.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    return messages


def _trajectory(task_id: str, prompt_ids: list[int], sample: Completion, text: str) -> Trajectory:
    """The minimal record a rubric scores (it reads the text, or the tokens for trajectory rewards)."""
    n_prompt, n_sample = len(prompt_ids), len(sample.token_ids)
    return Trajectory(
        task_id=task_id,
        token_ids=(*prompt_ids, *sample.token_ids),
        policy_mask=(0,) * n_prompt + (1,) * n_sample,
        logprobs=(0.0,) * n_prompt + tuple(sample.logprobs),
        prompt_length=n_prompt,
        completion_text=text,
        finish_reason=sample.finish_reason,
    )


def generate_teacher_data(
    cfg: DistillDataConfig, *, rows: Any = None, resume: bool = False
) -> Path:
    """Sample `samples_per_prompt` teacher answers per prompt and write them to `cfg.output_path`.

    `rows` (in memory) replaces `cfg.prompts_path`. With `resume`, an existing output is returned
    as it is. The file is written under a temporary name and renamed when complete.
    """
    output = Path(cfg.output_path)
    if resume and output.is_file():
        return output
    seed_everything(cfg.seed)
    source = rows if rows is not None else cfg.prompts_path
    prompt_rows = load_rows(source)
    name = source_name(source)
    prompts = [
        prompt_messages(row, f"{name} row {i + 1}", cfg) for i, row in enumerate(prompt_rows)
    ]
    rubric = build_rubric([cfg.reward]) if cfg.reward is not None else None

    teacher = load_policy(cfg.teacher)
    tokenizer = teacher.tokenizer
    bf16 = bf16_setting_on(cfg.bf16)
    generator = HFGenerator(
        teacher.model,
        tokenizer,
        eos_token_ids(teacher.model, tokenizer),
        seed=cfg.seed,
        autocast_bf16=bf16,
    )
    sampling = SamplingParams(
        n=cfg.samples_per_prompt,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
    )
    stats = dict.fromkeys(("kept", "truncated", "below_min_reward", "reward_errors"), 0)
    stats["prompts"] = len(prompts)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    with tmp.open("w") as out:
        for start in range(0, len(prompts), cfg.batch_size):
            batch = list(range(start, min(start + cfg.batch_size, len(prompts))))
            prompt_ids = [render_ids(tokenizer, prompts[i], generation_prompt=True) for i in batch]
            for i, ids, samples in zip(
                batch, prompt_ids, generator.generate(prompt_ids, sampling), strict=True
            ):
                for sample in samples:
                    if cfg.drop_truncated and sample.finish_reason == "length":
                        stats["truncated"] += 1
                        continue
                    text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
                    record: dict[str, Any] = {
                        "messages": [*prompts[i], {"role": "assistant", "content": text}]
                    }
                    if rubric is not None:
                        fields = {
                            k: v
                            for k, v in prompt_rows[i].items()
                            if k not in (cfg.prompt_column, "messages")
                        }
                        task = Task(id=f"{name}:{i}", messages=tuple(prompts[i]), fields=fields)
                        score = rubric.score(_trajectory(task.id, ids, sample, text), task)
                        if score.errors:
                            stats["reward_errors"] += 1
                            continue
                        value = score.rewards[rubric.names[0]]
                        if value < cfg.min_reward:
                            stats["below_min_reward"] += 1
                            continue
                        record["reward"] = value
                    out.write(json.dumps(record) + "\n")
                    stats["kept"] += 1
    output.with_name(output.name + ".stats.json").write_text(json.dumps(stats, indent=1))
    if not stats["kept"]:
        tmp.unlink()
        raise ConfigError(
            f"teacher data: no sample kept from {len(prompts)} prompts "
            f"({stats['truncated']} truncated, {stats['below_min_reward']} below min_reward, "
            f"{stats['reward_errors']} reward errors)"
        )
    tmp.rename(output)
    return output
