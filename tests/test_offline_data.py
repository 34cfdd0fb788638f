"""Offline data: token-exact assistant masks, row formats, one-line errors, packing == unpacked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr.errors import ConfigError
from rlvr.models import tiny_tokenizer
from rlvr.offline.common import forward_logprobs
from rlvr.offline.config import OfflineDataConfig
from rlvr.offline.data import (
    Example,
    collate,
    conversation_of,
    load_rows,
    pack_examples,
    pair_examples,
    pair_of,
    sft_examples,
    split_heldout,
    tokenize_conversation,
    train_and_heldout,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "And Italy?"},
    {"role": "assistant", "content": "Rome"},
]


def masked_runs(tokenizer, example: Example) -> tuple[list[str], list[str]]:
    """(text of each run of trained tokens, text of each run of untrained tokens)."""
    tokens = tokenizer.convert_ids_to_tokens(list(example.input_ids))
    runs: dict[int, list[str]] = {0: [], 1: []}
    previous = None
    for token, bit in zip(tokens, example.loss_mask, strict=True):
        if bit != previous:
            runs[bit].append("")
            previous = bit
        runs[bit][-1] += token
    return runs[1], runs[0]


def test_assistant_mask_is_token_exact() -> None:
    tokenizer = tiny_tokenizer()
    example = tokenize_conversation(
        tokenizer, CONVERSATION, where="test", max_length=512, truncate=False
    )
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # The char-level tokenizer maps one token to one character (or one special token), so the
    # token sequence spells the rendered text and each mask run can be read as text.
    assert "".join(tokenizer.convert_ids_to_tokens(list(example.input_ids))) == rendered
    trained, untrained = masked_runs(tokenizer, example)
    # Trained: each assistant reply and its end-of-turn, nothing else.
    assert trained == ["Paris<|im_end|>\n", "Rome<|im_end|>\n"]
    # Untrained: system, user turns and the generation prompt opening each assistant turn.
    assert untrained == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>user\nAnd Italy?<|im_end|>\n<|im_start|>assistant\n",
    ]


def test_a_message_marked_training_false_is_context() -> None:
    """`"training": false` on an assistant message: rendered, not trained (env demos' noise turns);
    the template never sees the key."""
    marked = [dict(m) for m in CONVERSATION]
    marked[2]["training"] = False
    tokenizer = tiny_tokenizer()
    (example,) = sft_examples(
        tokenizer, [{"messages": marked}], source="t", max_length=512, truncate=False,
        assistant_only=True,
    )  # fmt: skip
    plain = tokenize_conversation(
        tokenizer, CONVERSATION, where="t", max_length=512, truncate=False
    )
    assert example.input_ids == plain.input_ids
    assert masked_runs(tokenizer, example)[0] == ["Rome<|im_end|>\n"]
    split = {"prompt": marked[:2], "completion": marked[2:]}  # the same mark, prompt + completion
    assert sft_examples(
        tokenizer, [split], source="t", max_length=512, truncate=False, assistant_only=True
    ) == [example]
    marked[4]["training"] = False
    with pytest.raises(ConfigError, match="t row 1: no token left to train on"):
        sft_examples(tokenizer, [{"messages": marked}], source="t", max_length=512,
                     truncate=False, assistant_only=True)  # fmt: skip


def test_full_loss_and_pair_masks() -> None:
    tokenizer = tiny_tokenizer()
    every = tokenize_conversation(
        tokenizer, CONVERSATION, where="t", max_length=512, truncate=False, assistant_only=False
    )
    assert every.loss_mask[0] == 0 and all(every.loss_mask[1:])
    # A pair trains only the completion, not the assistant turns inside the prompt.
    row = {"prompt": CONVERSATION[:4], "chosen": "Rome", "rejected": "Milan"}
    [pair] = pair_examples(tokenizer, [row], source="pairs", max_length=512, truncate=False)
    assert masked_runs(tokenizer, pair.chosen)[0] == ["Rome<|im_end|>\n"]
    assert masked_runs(tokenizer, pair.rejected)[0] == ["Milan<|im_end|>\n"]


def test_row_formats() -> None:
    as_pc = conversation_of({"prompt": "hi", "completion": "hello"}, "row")
    assert as_pc == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    # Implicit prompt: the messages chosen and rejected share.
    chosen = [*CONVERSATION[:4], {"role": "assistant", "content": "Rome"}]
    rejected = [*CONVERSATION[:4], {"role": "assistant", "content": "Milan"}]
    prompt, c, r = pair_of({"chosen": chosen, "rejected": rejected}, "row")
    assert prompt == CONVERSATION[:4] and c[0]["content"] == "Rome" and r[0]["content"] == "Milan"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "hi"}, "data.jsonl row 2: no 'messages'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "data.jsonl row 2: no assistant"),
        ({"messages": [{"role": "user"}]}, "data.jsonl row 2: 'messages' message 1 needs"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b", "training": "no"},
                ]
            },
            "data.jsonl row 2: message 2's 'training' must be true or false",
        ),
    ],
)
def test_bad_sft_rows_name_file_and_row(tmp_path: Path, row: dict, message: str) -> None:
    path = tmp_path / "data.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError) as err:
        sft_examples(
            tiny_tokenizer(),
            load_rows(path),
            source=str(path),
            max_length=512,
            truncate=False,
            assistant_only=True,
        )
    assert message in str(err.value) and "\n" not in str(err.value)


def test_rows_from_files_and_datasets(tmp_path: Path) -> None:
    from datasets import Dataset

    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 2
    (tmp_path / "pairs.json").write_text(json.dumps(rows))
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    assert load_rows(tmp_path / "pairs.json") == rows
    assert load_rows(tmp_path / "pairs.jsonl") == rows  # blank lines are skipped
    assert load_rows(Dataset.from_list(rows)) == rows


def test_bad_files_and_pairs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": []}\n{not json\n')
    with pytest.raises(ConfigError, match=r"broken\.jsonl line 2: invalid JSON"):
        load_rows(broken)
    with pytest.raises(ConfigError, match="pairs row 1: no 'rejected'"):
        pair_examples(
            tiny_tokenizer(),
            [{"prompt": "p", "chosen": "a"}],
            source="pairs",
            max_length=64,
            truncate=False,
        )
    with pytest.raises(ConfigError, match=r"data\.path is not set"):
        train_and_heldout(OfflineDataConfig(), None, 0, lambda rows, source: rows)


def test_too_long_is_an_error_unless_truncating() -> None:
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 50}]
    with pytest.raises(ConfigError, match=r"row 7: \d+ tokens, longer than train.max_length=40"):
        tokenize_conversation(tokenizer, messages, where="row 7", max_length=40, truncate=False)
    cut = tokenize_conversation(tokenizer, messages, where="row 7", max_length=40, truncate=True)
    assert len(cut) == 40 and cut.loss_mask[-1] == 1
    with pytest.raises(ConfigError, match="no token left to train on"):
        tokenize_conversation(tokenizer, messages, where="row 7", max_length=10, truncate=True)


def test_pack_examples_fills_rows_in_order() -> None:
    examples = [Example((1,) * n, (0,) * n) for n in (5, 4, 3, 6, 2)]
    rows = pack_examples(examples, max_length=10)
    assert [[len(e) for e in row] for row in rows] == [[5, 4], [3, 6], [2]]


def test_split_heldout_is_seeded_and_disjoint() -> None:
    train, held = split_heldout(20, 0.25, seed=3)
    assert len(held) == 5 and not set(train) & set(held) and len(train) + len(held) == 20
    assert split_heldout(20, 0.25, seed=3) == (train, held)
    assert split_heldout(20, 0.0, seed=3) == (list(range(20)), [])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batch_equals_unpacked(tiny_model_dir: Path, attn: str) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}" * (i + 1)},
                {"role": "assistant", "content": "a" * (3 + 2 * i)},
            ]
        }
        for i in range(5)
    ]
    examples = sft_examples(
        tokenizer, rows, source="rows", max_length=128, truncate=False, assistant_only=True
    )
    packed_rows = pack_examples(examples, max_length=80)
    assert any(len(row) > 1 for row in packed_rows)  # the test must pack something
    pad = int(tokenizer.pad_token_id)
    with torch.no_grad():
        plain = collate([[e] for e in examples], pad, attn)
        plain_logprobs = forward_logprobs(model, plain, bf16=False)
        packed = collate(packed_rows, pad, attn)
        packed_logprobs = forward_logprobs(model, packed, bf16=False)
    # Same trained tokens, same log-prob on each, read in the same order from both batches.
    plain_values = plain_logprobs[plain.loss_mask_B_T.bool()]
    packed_values = packed_logprobs[packed.loss_mask_B_T.bool()]
    assert plain.num_loss_tokens == packed.num_loss_tokens
    assert torch.allclose(plain_values, packed_values, atol=1e-5, rtol=0)
