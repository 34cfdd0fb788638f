"""Stop strings: whether a row's text now holds one, decoding only its tail (HFGenerator calls it
after every sampled token)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# `stop_hit`'s margin in characters beyond the longest stop string and the newest token's text: the
# start of a tail can decode differently from the same tokens inside the row (a character whose first
# UTF-8 bytes lie before the tail becomes up to 3 U+FFFD; SentencePiece drops a leading space).
STOP_MARGIN_CHARS = 8


def stop_hit(
    tokenizer: Any, row_tokens: Sequence[int], stops: Sequence[str], piece_chars: dict[int, int]
) -> bool:
    """Whether a stop string occurs in the row's text (decoded skipping special tokens), called after
    every sampled token, so no stop string occurred before the newest one. Any new occurrence then
    ends in the text that token changed: at most the newest token's own text (`piece_chars`: a
    cache of each id's decoded length) plus a few characters a decode can revise (an incomplete
    UTF-8 character completed, a space cleaned up before punctuation). So only a tail is decoded:
    the last k tokens, k doubled from the stop strings' length until the tail's text covers the
    longest stop string, that token's text and STOP_MARGIN_CHARS, or the row ends. Special tokens
    decode to nothing and just make the tail longer, so a stop string split by them is still seen
    (tests/test_stop_strings.py holds this to whole-row decoding, step by step, on byte-level and
    SentencePiece-style tokenizers). A tail that starts inside a multi-byte character decodes it as
    U+FFFD: a stop string holding U+FFFD could match there. Decoding whole rows made stop checks
    quadratic in the row's length."""
    need = max(len(s) for s in stops)
    last = int(row_tokens[-1])
    if last not in piece_chars:
        piece_chars[last] = len(tokenizer.decode([last], skip_special_tokens=True))
    want = need + piece_chars[last] + STOP_MARGIN_CHARS
    k = need + 4
    while True:
        text = tokenizer.decode(row_tokens[-k:], skip_special_tokens=True)
        if any(s in text for s in stops):
            return True
        if k >= len(row_tokens) or len(text) >= want:
            return False
        k *= 2
