"""Stop strings on a decoded tail (rlvr.rollout.hf.stop_hit) agree with decoding the whole row.

HFGenerator checks stop strings after every sampled token by decoding only the row's last tokens
(enough for the longest stop string, the newest token's text and a margin), not the whole row. These
tests hold it to the old rule, "a stop string occurs in the row decoded with skip_special_tokens",
at every step up to the first hit: on byte-level BPE (multi-byte characters split over tokens) and
SentencePiece-style (leading-space) tokenizers built here, runs of special tokens inside stop
strings, and through the generator on the tiny model with long rows.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.models import eos_token_ids, load_policy
from rlvr.rollout.generator import SamplingParams
from rlvr.rollout.hf import HFGenerator, stop_hit

TEXTS = [
    "héllo wörld ✓ 日本語 the answer is 42. </answer> Done! ... ' n't it's",
    "naïve café 🙂 <tool> x=1; y = 2 ; Final answer: 7 , ok ?",
] * 20


def _byte_level(cleanup: bool = False) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>", "<|sep|>"],
    )
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|sep|>"],
        clean_up_tokenization_spaces=cleanup,
    )


def _metaspace(cleanup: bool = False) -> Any:
    """SentencePiece-like: '▁' for spaces, the first token's leading space dropped on decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|sep|>"]
    )
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|sep|>"],
        clean_up_tokenization_spaces=cleanup,
    )


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet's tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    out = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _first_hit(tok: Any, row: Sequence[int], stops: Sequence[str]) -> int | None:
    """The old rule: the first step whose whole decoded row contains a stop string."""
    for t in range(1, len(row) + 1):
        if any(s in tok.decode(row[:t], skip_special_tokens=True) for s in stops):
            return t
    return None


@pytest.mark.parametrize(
    "make",
    [_byte_level, _metaspace, lambda: _byte_level(True), lambda: _metaspace(True)],
    ids=["byte-level", "metaspace", "byte-level-cleanup", "metaspace-cleanup"],
)
def test_the_tail_agrees_with_the_whole_row_at_every_step(make: Any) -> None:
    tok = make()
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    ordinary = [i for i in range(len(tok)) if i not in special]
    # Byte-level tokenizers: one token per UTF-8 byte of a text (multi-byte characters split up).
    vocab = tok.get_vocab()
    byte_char = _byte_chars()
    singles = {b: vocab[byte_char[b]] for b in range(256) if byte_char[b] in vocab}
    checked = hits = 0
    for _ in range(300):
        # Text pieces re-encoded (realistic merges), single byte tokens of multi-byte characters,
        # random ids, and runs of special tokens anywhere.
        row: list[int] = []
        while len(row) < 40:
            kind = rng.random()
            if kind < 0.5 and len(singles) == 256:
                text = rng.choice(["日本語", "✓🙂", "é", "naïve café", "🙂🙂", " .", " ,", "n't"])
                row += [singles[b] for b in text.encode()]
            elif kind < 0.7:
                row.append(rng.choice(ordinary))
            elif kind < 0.85:
                text = rng.choice(TEXTS)
                start = rng.randrange(len(text))
                row += tok.encode(text[start : start + rng.randint(1, 6)], add_special_tokens=False)
            else:
                row += [rng.choice(special)] * rng.choice([1, 3, 20])
        full = tok.decode(row, skip_special_tokens=True)
        # Stop strings that do occur (some spanning special-token runs), and some that may not.
        # (Not U+FFFD, the text of a broken UTF-8 sequence: no stop string holds one.)
        stops = []
        for _ in range(3):
            start = rng.randrange(max(1, len(full) - 1))
            stops.append(full[start : start + rng.randint(1, 8)].replace("\ufffd", "") or "x")
        if rng.random() < 0.3:
            stops.append(rng.choice(["</answer>", "日本", " ?", "é", "🙂", "zzz", "語✓", "本語"]))
        first = _first_hit(tok, row, stops)
        cache: dict[int, int] = {}
        for t in range(1, (first or len(row)) + 1):
            assert stop_hit(tok, row[:t], stops, cache) == (t == first), (row[:t], stops, t, first)
            checked += 1
        hits += first is not None
    assert hits > 100 and checked > 2000  # the stops really were hit, often mid-row


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    policy = load_policy(str(tiny_model_dir))
    policy.model.eval()
    return policy.model, policy.tokenizer


@contextlib.contextmanager
def scripted(model: Any, script: Sequence[int]) -> Iterator[None]:
    """The generator emits `script` token by token (+50 on script[k] at the k-th lm_head call)."""
    calls = [0]

    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        add = torch.zeros(output.shape[-1])
        add[script[min(calls[0], len(script) - 1)]] = 50.0
        calls[0] += 1
        return output + add

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _generate(
    tiny: tuple[Any, Any], script: list[int], stop: tuple[str, ...], decoded: list[int]
) -> Any:
    """One scripted row; `decoded` collects the length of every id list the tokenizer decodes."""
    model, tok = tiny
    generator = HFGenerator(model, tok, eos_token_ids(model, tok), autocast_bf16=False)
    real = tok.decode

    def counting(ids: Sequence[int], *args: Any, **kwargs: Any) -> str:
        decoded.append(len(ids))
        return real(ids, *args, **kwargs)

    prompt = tok.encode("hi", add_special_tokens=False)
    with scripted(model, script), pytest.MonkeyPatch.context() as patch:
        patch.setattr(tok, "decode", counting)
        (group,) = generator.generate(
            [prompt], SamplingParams(max_new_tokens=len(script), stop=stop)
        )
    return group[0]


def test_a_stop_string_split_across_tokens_late_in_a_long_row(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    script = tok.encode("ab" * 30 + "</ans" + "wer>tail", add_special_tokens=False)
    decoded: list[int] = []
    completion = _generate(tiny, script, ("</answer>",), decoded)
    assert tok.decode(completion.token_ids) == "ab" * 30 + "</answer>"
    assert completion.finish_reason == "stop"
    # Each check decoded a tail, never the whole row (69 tokens at the end).
    assert max(decoded) <= 2 * (len("</answer>") + 4) < len(completion.token_ids)


def test_a_stop_string_with_40_special_tokens_inside_it(tiny: tuple[Any, Any]) -> None:
    _, tok = tiny
    x, y, z = tok.encode("xyz", add_special_tokens=False)
    im_start, unk = tok.convert_tokens_to_ids(["<|im_start|>", "<unk>"])
    a = tok.encode("a", add_special_tokens=False)
    script = a * 20 + [x] + [im_start, unk] * 20 + [y, z] + a * 5
    decoded: list[int] = []
    completion = _generate(tiny, script, ("xyz",), decoded)
    # The text skipping special tokens reads "...axyz" at the 63rd token: the stop is seen there.
    assert list(completion.token_ids) == script[:63]
    assert completion.finish_reason == "stop"
    assert max(decoded) < 63 + 1  # the tail grew over the special tokens, and no further
