"""Offline data: chat rows and preference pairs, tokenized with the chat template, masked, packed.

Row formats (a .jsonl/.json file, a `datasets.Dataset`, or a list of dicts; other keys are ignored):
- chat (SFT): `{"messages": [{"role": ..., "content": ...}, ...]}`, or `{"prompt", "completion"}`
  where each is a string (a user / an assistant message) or a list of messages; a `messages` row
  may say `"train_from": k`: assistant messages before index k are context, not trained (an
  opening that carries a worked example, as `rlvr env demos` writes for the calculator env); in
  either form an assistant message given as a dict may say `"training": false`: it stays in the
  context, untrained (a turn another policy played, as `rlvr env demos --noise` writes);
- pair (DPO, reward model): `{"prompt", "chosen", "rejected"}`, each a string or messages; without
  `prompt`, chosen and rejected are whole conversations and their common leading messages are it.

The assistant mask is token-exact without the template's `{% generation %}` support: the conversation
is rendered and tokenized once, and each assistant message's span is found by tokenizing the rendered
prefix before it (with the generation prompt) and through it. Both must be token prefixes of the whole
conversation, else the template cannot be masked this way and the row is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlvr.errors import ConfigError
from rlvr.offline.config import OfflineDataConfig
from rlvr.tasks import read_json_rows

Message = dict[str, str]
T = TypeVar("T")


@dataclass(frozen=True)
class Example:
    """One tokenized conversation. `loss_mask[t]` = 1 when token t is trained on (predicted from
    the tokens before it); the first token never is."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class PairExample:
    chosen: Example
    rejected: Example
    margin: float = 0.0


# ---------------------------------------------------------------------------------------------- rows
def source_name(source: Any) -> str:
    return str(source) if isinstance(source, str | Path) else "in-memory data"


def load_rows(source: Any) -> list[dict[str, Any]]:
    """Rows from a .jsonl/.json path, a `datasets.Dataset` or any sequence of dicts."""
    if isinstance(source, str | Path):
        return _read_file(Path(source))
    rows = [dict(row) if isinstance(row, Mapping) else row for row in source]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{source_name(source)} row {i + 1}: not a mapping of fields")
    if not rows:
        raise ConfigError("the in-memory data has no rows")
    return rows


def train_and_heldout(
    data: OfflineDataConfig,
    rows: Any,
    seed: int,
    tokenize: Callable[[list[dict[str, Any]], str], list[T]],
) -> tuple[list[T], list[T]]:
    """Tokenized (train, held-out) examples: `rows` (in memory) or data.path, and data.heldout_path
    or a seeded data.heldout_fraction carved off. Rows are tokenized before the split, so an error
    names the row's number in its file."""
    source = rows if rows is not None else data.path
    if source is None:
        raise ConfigError("data.path is not set and no rows were given")
    examples = tokenize(load_rows(source), source_name(source))
    if data.heldout_path is not None:
        return examples, tokenize(load_rows(data.heldout_path), data.heldout_path)
    train_idx, held_idx = split_heldout(len(examples), data.heldout_fraction, seed)
    return [examples[i] for i in train_idx], [examples[i] for i in held_idx]


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix not in (".jsonl", ".json"):
        raise ConfigError(f"data file '{path}': expected a .jsonl or .json file")
    return read_json_rows(path)


def as_messages(value: Any, role: str, where: str, key: str) -> list[Message]:
    """A string becomes one message with `role`; a list must already be chat messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: '{key}' must be a string or a non-empty list of messages")
    out = []
    for j, message in enumerate(value):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ConfigError(
                f"{where}: '{key}' message {j + 1} needs string 'role' and 'content' fields"
            )
        out.append({"role": message["role"], "content": message["content"]})
    return out


def conversation_of(row: Mapping[str, Any], where: str) -> list[Message]:
    """The chat messages of an SFT row; it must hold at least one assistant message."""
    if "messages" in row:
        messages = as_messages(row["messages"], "user", where, "messages")
    elif "prompt" in row and "completion" in row:
        messages = as_messages(row["prompt"], "user", where, "prompt") + as_messages(
            row["completion"], "assistant", where, "completion"
        )
    else:
        raise ConfigError(f"{where}: no 'messages' (or 'prompt' + 'completion') field")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: no assistant message, so nothing to train on")
    return messages


def pair_of(
    row: Mapping[str, Any], where: str
) -> tuple[list[Message], list[Message], list[Message]]:
    """(prompt, chosen, rejected) messages of a preference row."""
    for key in ("chosen", "rejected"):
        if key not in row:
            raise ConfigError(f"{where}: no '{key}' field (a pair needs prompt, chosen, rejected)")
    if "prompt" in row:
        prompt = as_messages(row["prompt"], "user", where, "prompt")
        chosen = as_messages(row["chosen"], "assistant", where, "chosen")
        rejected = as_messages(row["rejected"], "assistant", where, "rejected")
    else:
        if not (isinstance(row["chosen"], list) and isinstance(row["rejected"], list)):
            raise ConfigError(f"{where}: no 'prompt' field (needed when chosen is a string)")
        full_chosen = as_messages(row["chosen"], "assistant", where, "chosen")
        full_rejected = as_messages(row["rejected"], "assistant", where, "rejected")
        shared = 0
        limit = min(len(full_chosen), len(full_rejected)) - 1
        while shared < limit and full_chosen[shared] == full_rejected[shared]:
            shared += 1
        prompt = full_chosen[:shared]
        chosen, rejected = full_chosen[shared:], full_rejected[shared:]
    for key, part in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in part):
            raise ConfigError(f"{where}: '{key}' has no assistant message")
    return prompt, chosen, rejected


# ---------------------------------------------------------------------------------------------- tokens
def render_ids(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    # The template writes any BOS itself; add_special_tokens would add a second one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(
    tokenizer: Any,
    messages: list[Message],
    *,
    where: str,
    max_length: int,
    truncate: bool,
    train_from: int = 0,
    untrained: frozenset[int] = frozenset(),
    assistant_only: bool = True,
) -> Example:
    """Token ids of `messages` and the mask of the tokens trained on.

    With `assistant_only`, the mask covers the assistant messages at index >= `train_from` and not
    in `untrained` (their content and end-of-turn tokens, not the generation prompt that opens
    them); else every token but the first. Longer than `max_length`: cut on the right when
    `truncate`, else an error.
    """
    ids = render_ids(tokenizer, messages, generation_prompt=False)
    mask = [0] * len(ids)
    if assistant_only:
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < train_from or i in untrained:
                continue
            before = render_ids(tokenizer, messages[:i], generation_prompt=True) if i else []
            through = render_ids(tokenizer, messages[: i + 1], generation_prompt=False)
            if ids[: len(before)] != before or ids[: len(through)] != through:
                raise ConfigError(
                    f"{where}: the chat template does not render a prefix of the conversation as a "
                    f"token prefix (message {i + 1}), so the assistant mask cannot be built"
                )
            mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    else:
        mask = [0] + [1] * (len(ids) - 1)
    if len(ids) > max_length:
        if not truncate:
            raise ConfigError(
                f"{where}: {len(ids)} tokens, longer than train.max_length={max_length} "
                "(raise it, or set train.truncate=true to cut)"
            )
        ids, mask = ids[:max_length], mask[:max_length]
    mask[0] = 0  # nothing predicts the first token
    if not any(mask):
        raise ConfigError(
            f"{where}: no token left to train on (assistant part cut by max_length, or marked "
            "'training': false)"
        )
    return Example(tuple(ids), tuple(mask))


def sft_examples(
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    source: str,
    max_length: int,
    truncate: bool,
    assistant_only: bool,
) -> list[Example]:
    return [
        tokenize_conversation(
            tokenizer,
            conversation_of(row, f"{source} row {i + 1}"),
            where=f"{source} row {i + 1}",
            max_length=max_length,
            truncate=truncate,
            train_from=_train_from(row, f"{source} row {i + 1}"),
            untrained=_untrained(row, f"{source} row {i + 1}"),
            assistant_only=assistant_only,
        )
        for i, row in enumerate(rows)
    ]


def _train_from(row: Mapping[str, Any], where: str) -> int:
    """A row's `train_from` (0 when absent): the first message whose assistant turns are trained."""
    value = row.get("train_from", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: 'train_from' must be a message index >= 0, not {value!r}")
    return value


def _untrained(row: Mapping[str, Any], where: str) -> frozenset[int]:
    """Indices, in `conversation_of`'s order, of the messages marked `"training": false` (context,
    not trained); a string prompt or completion is one message and carries no mark."""
    keys = ("messages",) if "messages" in row else ("prompt", "completion")
    parts = [row.get(key) for key in keys]
    messages = [m for part in parts for m in (part if isinstance(part, list) else [part])]
    out = set()
    for j, message in enumerate(messages):
        flag = message.get("training", True) if isinstance(message, Mapping) else True
        if not isinstance(flag, bool):
            raise ConfigError(f"{where}: message {j + 1}'s 'training' must be true or false")
        if not flag:
            out.add(j)
    return frozenset(out)


def pair_examples(
    tokenizer: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    source: str,
    max_length: int,
    truncate: bool,
    margin_key: str | None = None,
) -> list[PairExample]:
    out = []
    for i, row in enumerate(rows):
        where = f"{source} row {i + 1}"
        prompt, chosen, rejected = pair_of(row, where)
        sides = [
            tokenize_conversation(
                tokenizer,
                prompt + completion,
                where=f"{where} ({key})",
                max_length=max_length,
                truncate=truncate,
                train_from=len(prompt),
            )
            for key, completion in (("chosen", chosen), ("rejected", rejected))
        ]
        margin = 0.0
        if margin_key is not None:
            value = row.get(margin_key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"{where}: margin field '{margin_key}' missing or not a number")
            margin = float(value)
        out.append(PairExample(sides[0], sides[1], margin))
    return out


# ---------------------------------------------------------------------------------------------- batches
def pack_examples(examples: Sequence[Example], max_length: int) -> list[list[Example]]:
    """Greedy, in order: each row takes examples until the next would pass max_length."""
    rows: list[list[Example]] = []
    used = max_length + 1
    for example in examples:
        if used + len(example) > max_length:
            rows.append([])
            used = 0
        rows[-1].append(example)
        used += len(example)
    return rows


@dataclass(frozen=True)
class TokenBatch:
    """Model inputs plus the shifted targets: `targets_B_T[:, t]` = `input_ids_B_T[:, t + 1]`, so the
    target axis is one shorter than the input axis. `attention_mask` is (B, T) padding for plain
    rows, or a (B, 1, T, T) block-diagonal causal mask for packed rows (None: positions alone)."""

    input_ids_B_T: torch.Tensor
    position_ids_B_T: torch.Tensor
    attention_mask: torch.Tensor | None
    targets_B_T: torch.Tensor
    loss_mask_B_T: torch.Tensor

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask_B_T.sum())

    def to(self, device: torch.device) -> TokenBatch:
        """The batch on `device`: collated on the host (cheap row writes), moved in one copy each."""
        if self.input_ids_B_T.device == device:
            return self
        mask = self.attention_mask
        return TokenBatch(
            self.input_ids_B_T.to(device, non_blocking=True),
            self.position_ids_B_T.to(device, non_blocking=True),
            mask.to(device, non_blocking=True) if mask is not None else None,
            self.targets_B_T.to(device, non_blocking=True),
            self.loss_mask_B_T.to(device, non_blocking=True),
        )


def collate(
    rows: Sequence[Sequence[Example]], pad_id: int, attn_implementation: str = "sdpa"
) -> TokenBatch:
    """Right-padded batch of rows, each a list of examples (one, unless packed)."""
    width = max(sum(len(e) for e in row) for row in rows)
    batch = len(rows)
    # Staged on the host on purpose (row writes), one copy per tensor later (TokenBatch.to).
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long, device="cpu")
    positions = torch.zeros((batch, width), dtype=torch.long, device="cpu")
    loss_mask = torch.zeros((batch, width), dtype=torch.float32, device="cpu")
    # -1 marks padding; packed examples get 0, 1, 2, ... within their row.
    segments = torch.full((batch, width), -1, dtype=torch.long, device="cpu")
    for b, row in enumerate(rows):
        start = 0
        for s, example in enumerate(row):
            end = start + len(example)
            input_ids[b, start:end] = torch.tensor(example.input_ids, device="cpu")
            loss_mask[b, start:end] = torch.tensor(
                example.loss_mask, dtype=torch.float32, device="cpu"
            )
            positions[b, start:end] = torch.arange(len(example), device="cpu")
            segments[b, start:end] = s
            start = end
        positions[b, start:] = torch.arange(width - start, device="cpu")  # padding: own segment
    packed = any(len(row) > 1 for row in rows)
    attention = (
        _block_causal_mask(segments, attn_implementation) if packed else (segments >= 0).long()
    )
    return TokenBatch(input_ids, positions, attention, input_ids[:, 1:], loss_mask[:, 1:])


def _block_causal_mask(segments_B_T: torch.Tensor, attn_implementation: str) -> torch.Tensor | None:
    """Token q sees token k iff both are in the same example (or both padding) and k <= q.

    transformers passes a 4D mask to the attention kernel as it is, and the kernels disagree on its
    form: SDPA wants True = attend, eager adds it to the scores (0 / -inf). Flash kernels take no
    mask at all; given restarting position ids and no mask, transformers derives the sequence
    boundaries from the positions itself, so None is returned for them.
    """
    if attn_implementation.startswith(("flash", "kernels")):
        return None
    width = segments_B_T.shape[1]
    causal_T_T = torch.ones((width, width), dtype=torch.bool, device=segments_B_T.device).tril()
    allowed_B_T_T = (segments_B_T[:, :, None] == segments_B_T[:, None, :]) & causal_T_T
    if attn_implementation == "eager":
        blocked = torch.finfo(torch.float32).min
        zeros = torch.zeros(allowed_B_T_T.shape, device=segments_B_T.device)
        return zeros.masked_fill(~allowed_B_T_T, blocked)[:, None]
    return allowed_B_T_T[:, None]


def collate_pairs(pairs: Sequence[PairExample], pad_id: int) -> TokenBatch:
    """Chosen rows first, then rejected rows: one forward scores both sides."""
    rows = [[p.chosen] for p in pairs] + [[p.rejected] for p in pairs]
    return collate(rows, pad_id)


def split_heldout(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): a seeded shuffle, at least one row each when fraction > 0."""
    if fraction <= 0 or n < 2:
        return list(range(n)), []
    shuffle = torch.Generator(device="cpu").manual_seed(seed)  # host indices, not model inputs
    order = torch.randperm(n, generator=shuffle, device="cpu").tolist()
    k = min(n - 1, max(1, round(n * fraction)))
    return sorted(order[k:]), sorted(order[:k])
