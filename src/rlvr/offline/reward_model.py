"""A Bradley-Terry reward model trained on preference pairs (InstructGPT, Ouyang et al. 2022).

    L = -log sigmoid(r(x, y_w) - r(x, y_l) [- margin])

The model is `AutoModelForSequenceClassification` with one output, built from a causal-LM directory
(its new `score` head starts random) and saved as such, so any HF code loads it. The score of a
conversation is the head's output at its last real token. That position is found from the attention
mask, not from `pad_token_id` as transformers' own pooling does: where the pad token is the EOS
(common), transformers would skip a real trailing EOS and read the token before it.

The trained model is also a reward function, `reward_model` at the end of this file. In a config
rubric:

    rewards:
      - fn: rlvr.offline.reward_model:reward_model
        options: {path: runs/rm/model}

It is NOT a verifier: its score is a model's guess. A policy optimised against a reward model learns
to exploit it (reward hacking, Gao et al. 2022), so the function carries `mark_not_verifiable` and
its values should be read apart from verified ones. It lives here, beside its trainer, rather than in
verifiers/ (which sees text only, tests/test_layers.py), because it runs a model.

The score depends on the prompt. A rubric passes it as `prompt`: the task's own `prompt` field when
it has one, else the task's prompt messages (see `RewardFunction.keyword_arguments`). Called without
a prompt the function raises rather than score the completion out of context. The model is loaded
once per (path, max_length) and shared by every call and thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from rlvr.algorithms.preference import bradley_terry_loss
from rlvr.build import use_bf16
from rlvr.devices import device_of
from rlvr.errors import ConfigError
from rlvr.models import (
    LoraSettings,
    add_lora,
    load_model_weights,
    load_tokenizer,
    resolve_model_path,
)
from rlvr.offline.common import (
    DONE_FILE,
    MODEL_DIR,
    StageResult,
    begin_stage,
    chunks,
    lora_settings,
    run_stage,
)
from rlvr.offline.config import RewardModelConfig
from rlvr.offline.data import (
    Example,
    Message,
    PairExample,
    as_messages,
    collate,
    collate_pairs,
    pair_examples,
    render_ids,
    train_and_heldout,
)
from rlvr.train.batch import autocast_context
from rlvr.verifiers.judge import mark_not_verifiable


def build_reward_model(
    name: str,
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    device: torch.device | str = "auto",
) -> tuple[Any, Any]:
    """(model, tokenizer): a one-output sequence classifier on the causal LM `name`."""
    path = resolve_model_path(name)
    try:
        tokenizer = load_tokenizer(path)
        model: Any = load_model_weights(
            AutoModelForSequenceClassification, path, device=device, num_labels=1
        )
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"could not load reward model '{name}': {first_line}") from err
    model.config.pad_token_id = tokenizer.pad_token_id
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if lora is not None:
        # SEQ_CLS makes peft train (and save) the new score head in full next to the adapters.
        model = add_lora(model, lora, "SEQ_CLS")
    return model, tokenizer


def sequence_scores(model: Any, batch: Any, bf16: bool = False) -> torch.Tensor:
    """Reward (B,) of each row of a right-padded `TokenBatch`: the head at the last real token."""
    from peft import PeftModel

    base: Any = model.get_base_model() if isinstance(model, PeftModel) else model
    backbone = getattr(base, str(base.base_model_prefix))
    head = getattr(base, "score", None)
    if head is None:
        raise ConfigError(f"{type(base).__name__} has no 'score' head; not a reward model")
    device = device_of(model)
    batch = batch.to(device)
    with autocast_context(bf16, device.type):
        hidden_B_T_H = backbone(
            input_ids=batch.input_ids_B_T,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids_B_T,
            use_cache=False,
        ).last_hidden_state
    last_B = batch.attention_mask.sum(dim=1) - 1
    pooled_B_H = hidden_B_T_H[torch.arange(hidden_B_T_H.shape[0], device=device), last_B]
    return head(pooled_B_H.float()).squeeze(-1).float()


def train_reward_model(
    cfg: RewardModelConfig, *, rows: Any = None, resume: bool = False
) -> StageResult:
    """Train a Bradley-Terry reward model on pairs (`rows` in memory, else `cfg.data.path`).

    Held-out pair accuracy (chosen scored above rejected) is `eval/accuracy`. `resume` as in
    `train_sft`. The model lands in OUTPUT_DIR/model; `load_reward_model` reads it.
    """
    done = begin_stage(cfg, resume)
    if done is not None:
        return done
    model, tokenizer = build_reward_model(
        cfg.model.name, lora_settings(cfg), cfg.model.gradient_checkpointing, cfg.model.device
    )
    train = cfg.train

    def tokenize(source_rows: list[dict[str, Any]], source: str) -> list[PairExample]:
        return pair_examples(
            tokenizer,
            source_rows,
            source=source,
            max_length=train.max_length,
            truncate=train.truncate,
            margin_key=cfg.margin_key,
        )

    pairs, heldout = train_and_heldout(cfg.data, rows, train.seed, tokenize)
    bf16 = use_bf16(cfg.model)
    pad_id = int(tokenizer.pad_token_id)

    def pair_metrics(
        split: list[PairExample], indices: list[int], backward: bool
    ) -> dict[str, float]:
        sums = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        for chunk in chunks(indices, train.micro_batch_size):
            chunk_pairs = [split[i] for i in chunk]
            scores_2B = sequence_scores(model, collate_pairs(chunk_pairs, pad_id), bf16)
            chosen_B, rejected_B = scores_2B[: len(chunk)], scores_2B[len(chunk) :]
            margin_B = (
                torch.tensor([p.margin for p in chunk_pairs], device=chosen_B.device)
                if cfg.margin_key
                else None
            )
            loss = bradley_terry_loss(chosen_B, rejected_B, margin_B)
            share = len(chunk) / len(indices)  # the step's loss is the mean over all its pairs
            if backward:
                (loss * share).backward()
            sums["loss"] += float(loss.detach()) * share
            sums["accuracy"] += float((chosen_B > rejected_B).sum()) / len(indices)
            sums["margin"] += float((chosen_B - rejected_B).detach().sum()) / len(indices)
        return sums

    def train_step(indices: list[int]) -> dict[str, float]:
        return pair_metrics(pairs, indices, backward=True)

    def evaluate() -> dict[str, float]:
        found = pair_metrics(heldout, list(range(len(heldout))), backward=False)
        return {f"eval/{k}": v for k, v in found.items()}

    return run_stage(
        cfg,
        model=model,
        tokenizer=tokenizer,
        lora=cfg.model.lora.enabled,
        num_items=len(pairs),
        train_step=train_step,
        evaluate=evaluate if heldout else None,
        resume=resume,
    )


class RewardScorer:
    """A trained reward model that scores conversations; thread-safe (one forward at a time).

    Conversations longer than `max_length` tokens keep their last `max_length` tokens: the end of
    the completion is what the score is read from.
    """

    def __init__(self, model: Any, tokenizer: Any, max_length: int = 1024, bf16: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.bf16 = bf16
        self._lock = threading.Lock()

    def score_conversations(
        self, conversations: Sequence[list[Message]], batch_size: int = 8
    ) -> list[float]:
        pad_id = int(self.tokenizer.pad_token_id)
        out: list[float] = []
        # The lock covers tokenizing too: a fast tokenizer used from two threads at once can fail
        # with "Already borrowed".
        with self._lock, torch.no_grad():
            examples = []
            for messages in conversations:
                ids = render_ids(self.tokenizer, messages, generation_prompt=False)
                ids = ids[-self.max_length :]
                examples.append(Example(tuple(ids), (0,) * len(ids)))
            for chunk in chunks(list(range(len(examples))), batch_size):
                batch = collate([[examples[i]] for i in chunk], pad_id)
                out.extend(sequence_scores(self.model, batch, self.bf16).tolist())
        return out

    def score(self, prompt: str | list[Message], completion: str) -> float:
        """Reward of `completion` as the assistant's reply to `prompt` (a user string or messages)."""
        messages = as_messages(prompt, "user", "reward model prompt", "prompt")
        messages = [*messages, {"role": "assistant", "content": completion}]
        return self.score_conversations([messages])[0]


def load_reward_model(
    path: str | Path,
    *,
    max_length: int = 1024,
    bf16: bool = False,
    device: torch.device | str = "auto",
) -> RewardScorer:
    """A `RewardScorer` from a reward model directory, or a finished stage's OUTPUT_DIR, on `device`
    (auto: the GPU where there is one, as a run's `model.device: auto`)."""
    directory = Path(path)
    if (directory / DONE_FILE).is_file() and (directory / MODEL_DIR).is_dir():
        directory = directory / MODEL_DIR
    if not (directory / "config.json").is_file():
        raise ConfigError(f"reward model '{path}' is not a model directory (no config.json)")
    tokenizer = load_tokenizer(str(directory))
    try:
        model = load_model_weights(
            AutoModelForSequenceClassification, str(directory), device=device
        )
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"could not load reward model '{path}': {first_line}") from err
    if model.config.num_labels != 1:
        raise ConfigError(
            f"reward model '{path}' has {model.config.num_labels} outputs; a reward model has 1"
        )
    return RewardScorer(model, tokenizer, max_length=max_length, bf16=bf16)


# ---------------------------------------------------------------- the trained model as a reward
_SCORERS: dict[tuple[str, int], Any] = {}
_LOAD_LOCK = threading.Lock()


def _scorer(path: str, max_length: int) -> Any:
    key = (path, max_length)
    with _LOAD_LOCK:
        scorer = _SCORERS.get(key)
        if scorer is None:
            scorer = _SCORERS[key] = load_reward_model(path, max_length=max_length)
    return scorer


def reward_model(
    completion: str,
    path: str,
    prompt: str | list[dict[str, str]] | None = None,
    max_length: int = 1024,
    scale: float = 1.0,
) -> float:
    """`scale` * the reward model's score of `completion` as the assistant's reply to `prompt`.

    `path` is a reward model directory (or the OUTPUT_DIR of `train_reward_model`). Scores are
    unbounded logits; `scale` (or the rubric weight) sets their size next to other rewards.
    """
    if prompt is None:
        raise ValueError("reward_model needs the prompt the completion answers (prompt=...)")
    return scale * float(_scorer(path, max_length).score(prompt, completion))


mark_not_verifiable(reward_model)
