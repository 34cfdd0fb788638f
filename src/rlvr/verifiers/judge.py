"""An LLM-as-judge reward. NOT a verifier: its scores are a model's opinion, not a checked fact.

A judge asks a model behind any OpenAI-compatible endpoint (vLLM, SGLang, OpenAI, ...) to grade a
completion against a rubric prompt and reads a `SCORE: <number>` line from the reply. It is useful
where no checker exists (style, helpfulness), but a policy trained on it will exploit the judge's
blind spots, so judge rewards carry `__rlvr_verifiable__ = False` (see `is_verifiable`) and should be
logged apart from verifiable rewards.

Two ways to use it in a rubric:
- `rlvr.verifiers.judge:judge` with `options: {base_url, model, rubric_prompt, ...}` in the config;
- `make_judge(...)` in Python, which returns a reward function with the settings bound.

The rubric prompt is formatted with `str.format` using the task fields and `completion` (write
`{{`/`}}` for literal braces); when it has no `{completion}` placeholder the completion is appended.
An unparsable reply raises ValueError, recorded as an error by the rubric and never scored 0.0.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import math
import os
import re
import string
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["is_verifiable", "judge", "make_judge", "mark_not_verifiable", "parse_score"]

_VERIFIABLE_ATTR = "__rlvr_verifiable__"

_SYSTEM_PROMPT = (
    "You are a strict grader. Grade the response as the instructions say. "
    "End your reply with a line of the form 'SCORE: <number>'."
)
_SCORE_RE = re.compile(r"SCORE\s*[:=]\s*\**\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))", re.IGNORECASE)
_MEMORY_CACHE_SIZE = 4096


def mark_not_verifiable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Flag `fn` as a non-verifiable reward (a judge or a learned reward model)."""
    setattr(fn, _VERIFIABLE_ATTR, False)
    setattr(fn, "verifiable", False)  # noqa: B010 - the public spelling of the same flag
    return fn


def is_verifiable(fn: Any) -> bool:
    """False for rewards marked with `mark_not_verifiable` (judges); True for everything else.

    Looks through `functools.partial` and objects wrapping a function in `.fn` (RewardFunction).
    """
    while True:
        if not getattr(fn, _VERIFIABLE_ATTR, True):
            return False
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif callable(getattr(fn, "fn", None)):
            fn = fn.fn
        else:
            return True


def parse_score(reply: str) -> float:
    """The number on the last `SCORE: <number>` line of `reply`; ValueError when there is none."""
    matches = _SCORE_RE.findall(reply)
    if not matches:
        raise ValueError(f"judge: no 'SCORE: <number>' in the reply {reply[-200:]!r}")
    value = float(matches[-1])
    if not math.isfinite(value):  # pragma: no cover - the regex only matches finite numbers
        raise ValueError(f"judge: score {value} is not finite")
    return value


def _format_prompt(rubric_prompt: str, completion: str, fields: dict[str, Any]) -> str:
    try:
        prompt = rubric_prompt.format(**{**fields, "completion": completion})
    except KeyError as exc:
        raise KeyError(
            f"judge: the rubric prompt uses {{{exc.args[0]}}}, not a task field"
        ) from None
    if "completion" not in {name for _, name, _, _ in string.Formatter().parse(rubric_prompt)}:
        prompt += f"\n\nResponse to grade:\n{completion}"
    return prompt


class _Judge:
    """One endpoint and model, with the reply cache (on disk under `cache_dir`, else in memory)."""

    def __init__(
        self, base_url: str, model: str, api_key_env: str, cache_dir: str | None, client: Any
    ) -> None:
        if client is None:
            import openai

            client = openai.OpenAI(base_url=base_url, api_key=os.environ.get(api_key_env, "none"))
        self.client = client
        self.model = model
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._memory: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _key(self, prompt: str) -> str:
        return hashlib.sha256(json.dumps([self.model, prompt]).encode()).hexdigest()

    def _cached(self, key: str) -> str | None:
        if self.cache_dir is not None:
            path = self.cache_dir / f"{key}.json"
            if path.is_file():
                try:
                    return str(json.loads(path.read_text())["reply"])
                except (OSError, ValueError, KeyError, TypeError):
                    return None  # a torn or foreign file: ask again and overwrite it
            return None
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                return self._memory[key]
        return None

    def _store(self, key: str, prompt: str, reply: str) -> None:
        if self.cache_dir is not None:
            path = self.cache_dir / f"{key}.json"
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"model": self.model, "prompt": prompt, "reply": reply}))
            os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
            return
        with self._lock:
            self._memory[key] = reply
            while len(self._memory) > _MEMORY_CACHE_SIZE:
                self._memory.popitem(last=False)

    def score(self, prompt: str) -> float:
        """The raw score for `prompt`; only replies that parse are cached."""
        key = self._key(prompt)
        reply = self._cached(key)
        if reply is not None:
            return parse_score(reply)
        response = self.client.chat.completions.create(
            model=self.model,
            messages=[
                {"role": "system", "content": _SYSTEM_PROMPT},
                {"role": "user", "content": prompt},
            ],
            temperature=0,
        )
        reply = str(response.choices[0].message.content or "")
        score = parse_score(reply)
        self._store(key, prompt, reply)
        return score


def _normalised(raw: float, max_score: float) -> float:
    return min(1.0, max(0.0, raw / max_score))


def _check_max_score(max_score: float) -> None:
    if not (isinstance(max_score, int | float) and math.isfinite(max_score) and max_score > 0):
        raise ValueError(f"judge: max_score must be a positive number, got {max_score!r}")


def make_judge(
    base_url: str,
    model: str,
    rubric_prompt: str,
    api_key_env: str = "OPENAI_API_KEY",
    cache_dir: str | None = None,
    max_score: float = 10.0,
    client: Any = None,
) -> Callable[..., float]:
    """A judge reward function `judge(completion, **fields) -> float` in [0, 1]. NOT verifiable.

    `client` replaces the `openai.OpenAI` client (tests pass a fake). The score is the reply's
    `SCORE:` divided by `max_score`, clipped to [0, 1].
    """
    _check_max_score(max_score)
    grader = _Judge(base_url, model, api_key_env, cache_dir, client)

    def judge(completion: str, **fields: Any) -> float:
        """LLM-judge reward: a model's opinion, NOT a verifier (see rlvr.verifiers.judge)."""
        prompt = _format_prompt(rubric_prompt, completion, fields)
        return _normalised(grader.score(prompt), max_score)

    mark_not_verifiable(judge)
    return judge


_JUDGES: dict[tuple[str, str, str, str | None], _Judge] = {}
_JUDGES_LOCK = threading.Lock()


def judge(
    completion: str,
    base_url: str,
    model: str,
    rubric_prompt: str,
    api_key_env: str = "OPENAI_API_KEY",
    cache_dir: str | None = None,
    max_score: float = 10.0,
    **fields: Any,
) -> float:
    """LLM-judge reward for configs (`rlvr.verifiers.judge:judge` + `options`). NOT a verifier.

    The client and reply cache are built once per (base_url, model, api_key_env, cache_dir) and
    reused for every completion.
    """
    _check_max_score(max_score)
    key = (base_url, model, api_key_env, cache_dir)
    with _JUDGES_LOCK:
        grader = _JUDGES.get(key)
        if grader is None:
            grader = _JUDGES[key] = _Judge(base_url, model, api_key_env, cache_dir, None)
    prompt = _format_prompt(rubric_prompt, completion, fields)
    return _normalised(grader.score(prompt), max_score)


mark_not_verifiable(judge)
