"""Write the small test tokenizers in this folder: llama3/, mistral/, qwen3/ (see README.md).

    .venv/bin/python tests/data/tokenizers/make_tokenizers.py

Each is a byte-level BPE (a few hundred merges, trained here on the templates' own text and a few
tool-call lines) behind the family's real pre-tokenizer split, carrying the family's special tokens
spelled as in the real tokenizer and marked special (or not) as there, with the family's real chat
template. Not the real vocabularies (those are 128k-150k entries): ids differ, token boundaries of
ordinary text differ, but everything the engine relies on is the real thing: a special token is one
id that ordinary text never merges into, the template is byte-for-byte the model's, and a
byte-level BPE decodes what it encodes. Run offline; the output is committed, tests never rebuild it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"

# The pre-tokenizer splits of the real tokenizer.json files (Llama 3's tiktoken pattern, Qwen2's,
# Mistral's Tekken): they decide where BPE merges may not cross, so boundaries behave as there.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Family:
    folder: str
    template: str  # file in templates/, written as the tokenizer's chat template
    split: str
    special: tuple[str, ...]  # special tokens (skipped by decode(skip_special_tokens=True))
    added: tuple[str, ...]  # added tokens that are not special (kept by that decode)
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None = None


FAMILIES = (
    # meta-llama/Llama-3.1-8B-Instruct: tokenizer_config.json's bos/eos; the header, end-of-turn,
    # end-of-message and python tag tokens are special.
    Family(
        folder="llama3",
        template="meta-llama-Llama-3.1-8B-Instruct.jinja",
        split=LLAMA3_SPLIT,
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|finetune_right_pad_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        added=(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
    ),
    # mistralai/Mistral-Nemo-Instruct-2407: Tekken's control tokens, all special.
    Family(
        folder="mistral",
        template="mistralai-Mistral-Nemo-Instruct-2407.jinja",
        split=TEKKEN_SPLIT,
        special=(
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[TOOL_CALLS]",
            "<pad>",
        ),
        added=(),
        bos="<s>",
        eos="</s>",
        pad=None,
        unk="<unk>",
    ),
    # Qwen/Qwen3-0.6B: the ChatML tokens are special; the tool and think tags are added tokens that
    # are *not* special (decode keeps them), as in its tokenizer.json.
    Family(
        folder="qwen3",
        template="Qwen-Qwen3-0.6B.jinja",
        split=QWEN2_SPLIT,
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=(
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
    ),
)

CORPUS_LINES = (
    "What is 2 + 3? Use the tools, then reply with the answer.",
    "The answer is <answer>5</answer>.",
    "I should add the two numbers first, then answer.",
    "Add two integers. The first number. The second number.",
    '{"name": "add", "arguments": {"a": 2, "b": 3}}',
    '{"name": "add", "parameters": {"a": 2, "b": 3}}',
    '{"type": "function", "function": {"name": "add", "description": "Add two integers."}}',
    '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}',
)


def corpus() -> list[str]:
    lines = list(CORPUS_LINES)
    for path in sorted(TEMPLATES.glob("*.jinja")):
        lines += path.read_text().splitlines()
    return lines


def build(family: Family) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(unk_token=family.unk))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(family.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    extra = [t for t in family.special if t not in (family.bos, family.eos, family.pad, family.unk)]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        unk_token=family.unk,
        additional_special_tokens=extra,
    )
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    return tokenizer


def main() -> None:
    for family in FAMILIES:
        target = HERE / family.folder
        if target.exists():
            shutil.rmtree(target)
        build(family).save_pretrained(target)
        sizes = {p.name: p.stat().st_size for p in sorted(target.iterdir())}
        print(family.folder, json.dumps(sizes))


if __name__ == "__main__":
    main()
