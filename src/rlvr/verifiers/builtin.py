"""Built-in reward functions: format checks and answer checks that need no model.

A reward function is a plain callable `fn(completion: str, **task_fields) -> float`. Task fields
(such as `answer`) and the options written in the config (such as `tag` or `pattern`) both arrive by
keyword, and every built-in takes `**_` so it ignores the fields it has no use for.

The split between returning 0.0 and raising matters: a completion that has no answer in it is a
*wrong answer* (0.0, the policy should learn from it), while a task whose `answer` field cannot be
used is *broken data* (raise, so the rubric records an error and the trajectory is left out of the
update instead of teaching the policy that every answer to that task is wrong).
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from rlvr.errors import ConfigError

__all__ = [
    "BUILTIN_REWARDS",
    "answer_tag_format",
    "exact_match",
    "extract_last_number",
    "extract_tagged",
    "json_schema_format",
    "math_equiv",
    "numeric_match",
    "regex_format",
    "think_answer_format_with_success",
    "think_answer_parts",
]

# A number as people write it: an optional sign (ASCII hyphen or the Unicode minus models sometimes
# emit), then digits grouped by thousands commas or plain digits, then an optional decimal part; or
# a bare decimal such as ".5". The lookbehinds stop a match from starting inside another number
# ("3.14" must not also yield "14", "12,345" must not also yield "2,345") and stop "3-5" from
# reading as "-5". The `(?!\d)` after comma groups rejects "1,2345", not a thousands number.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w.,)\]])[-−])?"
    r"(?<![\d.])"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
)

_EXTRACT_MODES = ("tag", "tag_or_text", "text")


@functools.lru_cache(maxsize=64)
def _tag_pattern(tag: str) -> re.Pattern[str]:
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)


def extract_tagged(text: str, tag: str = "answer") -> str | None:
    """Content of the last `<tag>...</tag>` pair, stripped; None when there is none.

    The last pair wins because models often restate a draft answer before the final one.
    """
    matches = _tag_pattern(tag).findall(text)
    if not matches:
        return None
    return str(matches[-1]).strip()


def extract_last_number(text: str) -> str | None:
    """The last number in `text`, normalised so `float()` accepts it; None when there is none.

    Thousands separators are dropped ("1,234" -> "1234"), a Unicode minus becomes "-", and a full
    stop that ends the sentence is not part of the number ("is 5." -> "5"). The last number is taken
    because chain-of-thought completions end with their conclusion.
    """
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    number = str(matches[-1]).replace(",", "").replace("−", "-").rstrip(".")
    return number or None


def answer_tag_format(completion: str, tag: str = "answer", **_: Any) -> float:
    """1.0 iff the completion has exactly one non-empty `<tag>...</tag>` and ends right after it.

    Exactness is the point of a format reward: a second tag or text after the closing tag means the
    policy has not learned where to stop, and rewarding it would teach it to ramble.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    if completion.count(opening) != 1 or completion.count(closing) != 1:
        return 0.0
    start = completion.index(opening) + len(opening)
    end = completion.index(closing)
    if end < start or not completion[start:end].strip():
        return 0.0
    return 1.0 if not completion[end + len(closing) :].strip() else 0.0


@functools.lru_cache(maxsize=256)
def _compile_pattern(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ConfigError(f"regex_format: invalid pattern {pattern!r}: {exc}") from None


def regex_format(completion: str, pattern: str, mode: str = "search", **_: Any) -> float:
    """1.0 if `pattern` matches the completion: anywhere ("search") or as a whole ("fullmatch").

    The pattern is compiled with DOTALL in both modes, because completions span many lines and a
    format pattern such as `<think>.*</think>` is meant to cross them. Compiled patterns are
    cached: the same pattern is applied to every completion of a run. A bad pattern or mode is a
    config mistake and raises `ConfigError`.
    """
    compiled = _compile_pattern(pattern)
    if mode == "search":
        return 1.0 if compiled.search(completion) else 0.0
    if mode == "fullmatch":
        return 1.0 if compiled.fullmatch(completion) else 0.0
    raise ConfigError(f"regex_format: mode must be 'search' or 'fullmatch', got {mode!r}")


def _check_extract(name: str, extract: str, allowed: tuple[str, ...]) -> None:
    if extract not in allowed:
        raise ConfigError(f"{name}: extract must be one of {', '.join(allowed)}; got {extract!r}")


def _normalise_text(text: str, case_sensitive: bool) -> str:
    collapsed = " ".join(text.split())
    return collapsed if case_sensitive else collapsed.casefold()


def exact_match(
    completion: str,
    answer: Any,
    extract: str = "tag_or_text",
    tag: str = "answer",
    case_sensitive: bool = False,
    **_: Any,
) -> float:
    """1.0 if the candidate answer equals `str(answer)` up to whitespace (and case, by default).

    `extract` picks the candidate: "tag" requires a tagged answer (no tag scores 0.0, so the format
    is enforced), "tag_or_text" falls back to the whole completion (lenient for models that skip
    tags), "text" always uses the whole completion.
    """
    _check_extract("exact_match", extract, _EXTRACT_MODES)
    candidate: str | None
    if extract == "text":
        candidate = completion.strip()
    else:
        candidate = extract_tagged(completion, tag)
        if candidate is None and extract == "tag_or_text":
            candidate = completion.strip()
    if candidate is None:
        return 0.0
    expected = _normalise_text(str(answer), case_sensitive)
    return 1.0 if _normalise_text(candidate, case_sensitive) == expected else 0.0


def _gold_number(answer: Any) -> float:
    """The answer as a float; ValueError when it is not a number, since that is broken data."""
    if isinstance(answer, bool):
        raise ValueError(f"numeric_match: answer {answer!r} is a bool, not a number")
    if isinstance(answer, int | float):
        value = float(answer)
    else:
        text = str(answer).strip().replace("−", "-")
        # Accept the same thousands separators completions are allowed to use.
        if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
            text = text.replace(",", "")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"numeric_match: answer {answer!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"numeric_match: answer {answer!r} is not a finite number")
    return value


def numeric_match(
    completion: str,
    answer: Any,
    extract: str = "last_number",
    tag: str = "answer",
    tolerance: float = 1e-6,
    **_: Any,
) -> float:
    """1.0 if the completion's number is within `tolerance` (relative, floor 1) of the answer.

    The tolerance is scaled by `max(1, |answer|)` so it is absolute near zero and relative for large
    answers, where float rounding of "1234567.0000001" should not cost the reward. `extract` is
    "last_number" (anywhere in the completion) or "tag" (the last number inside `<tag>`); no number
    found is a wrong answer (0.0), a non-numeric `answer` field raises ValueError.
    """
    _check_extract("numeric_match", extract, ("last_number", "tag"))
    gold = _gold_number(answer)
    if extract == "tag":
        tagged = extract_tagged(completion, tag)
        candidate = None if tagged is None else extract_last_number(tagged)
    else:
        candidate = extract_last_number(completion)
    if candidate is None:
        return 0.0
    try:
        value = float(candidate)
    except ValueError:  # pragma: no cover - extract_last_number only yields float-parsable text
        return 0.0
    return 1.0 if abs(value - gold) <= tolerance * max(1.0, abs(gold)) else 0.0


def _math_verify_timeout(timeout_seconds: int | None) -> int | None:
    """The timeout to hand math_verify, which enforces it with `signal.alarm`.

    `signal.alarm` only works in the main thread; elsewhere math_verify raises a ValueError on
    every call when a timeout is set. So off the main thread the timeout is disabled (None) and
    bounding the time is the caller's job (e.g. a worker process with its own deadline).
    """
    if not timeout_seconds or timeout_seconds <= 0:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(timeout_seconds))


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> tuple[Any, ...]:
    """Parse the gold answer once per task rather than once per sampled completion (G per task)."""
    from math_verify import parse

    # A bare "1/2" or "x+1" is only read as maths inside a math environment; an answer that already
    # carries its own delimiters or \boxed{} is parsed as written.
    text = answer.strip()
    wrapped = text if ("$" in text or "\\boxed" in text or "\\(" in text) else f"${text}$"
    parsed = parse(wrapped, parsing_timeout=timeout, raise_on_error=True)
    if not parsed and wrapped != text:
        parsed = parse(text, parsing_timeout=timeout, raise_on_error=True)
    return tuple(parsed)


def math_equiv(
    completion: str,
    answer: Any,
    timeout_seconds: int | None = 5,
    tag: str | None = "answer",
    **_: Any,
) -> float:
    """1.0 if the completion's final answer is mathematically equal to `answer` (via math_verify).

    When the completion has a `<tag>...</tag>` (default `answer`; None to disable), only the last
    tag's content is read, as the other built-ins do.

    The completion may use \\boxed{}, LaTeX or plain numbers; "0.5" equals "\\frac{1}{2}". Outcomes:
    no parsable answer in the completion is 0.0; a gold answer that math_verify cannot parse
    raises ValueError (broken data); running past `timeout_seconds` raises TimeoutError, so the
    rubric records it rather than scoring a possibly-correct answer 0.0. (math_verify signals a
    timeout with a `TimeoutException` derived from BaseException, which would slip past
    `except Exception`; it is converted here.) The timeout only applies in the main thread, see
    `_math_verify_timeout`.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    timeout = _math_verify_timeout(timeout_seconds)
    try:
        gold = _parse_gold(str(answer), timeout)
        if not gold:
            raise ValueError(f"math_equiv: math_verify cannot parse the answer {answer!r}")
        try:
            # raise_on_error=True so a timeout is not swallowed; extraction failures inside the text
            # are already handled by math_verify, so what escapes here is a genuine parser fault.
            tagged = extract_tagged(completion, tag) if tag else None
            text = tagged if tagged is not None else completion
            pred = parse(text, parsing_timeout=timeout, raise_on_error=True)
        except Exception:
            return 0.0
        for g in gold:
            for p in pred:
                try:
                    if verify(g, p, timeout_seconds=timeout, raise_on_error=True):
                        return 1.0
                except Exception:
                    # A comparison sympy cannot carry out does not show equality; the other parsed
                    # forms (math_verify keeps both a sympy object and the source string) still run.
                    continue
    except TimeoutException:
        raise TimeoutError(f"math_equiv: math_verify ran past {timeout}s") from None
    return 0.0


# A fenced code block, optionally labelled json: ```json\n{...}\n```
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)


@functools.lru_cache(maxsize=64)
def _schema_validator(schema_key: str) -> Any:
    """A Draft 2020-12 validator for the schema serialised as `schema_key`, checked once."""
    import jsonschema

    schema = json.loads(schema_key)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"json_schema_format: invalid schema: {exc.message}") from None
    return jsonschema.Draft202012Validator(schema)


def _parse_json_candidate(text: str) -> tuple[bool, Any]:
    """(True, value) when `text`, or failing that its last fenced block, is JSON; else (False, None)."""
    candidates = [text.strip()]
    fenced = _FENCE_RE.findall(text)
    if fenced:
        candidates.append(str(fenced[-1]).strip())
    for candidate in candidates:
        try:
            return True, json.loads(candidate)
        except (ValueError, RecursionError):
            continue
    return False, None


def json_schema_format(
    completion: str, schema: dict[str, Any], tag: str | None = "answer", **_: Any
) -> float:
    """1.0 iff the answer is JSON that validates against `schema` (JSON Schema Draft 2020-12).

    The answer is the `<tag>...</tag>` when there is one (`tag=None` disables this), else the
    whole completion; several tags are a format violation (0.0: answering twice is a hedge, as in
    answer_tag_format); inside it, either the text itself or its last fenced block (```json ... ```) is
    parsed. Unparsable JSON or a schema violation is 0.0; an invalid `schema` (or one that is not a
    JSON object) is a broken config and raises ValueError. Validators are cached per schema.
    """
    if not isinstance(schema, dict):
        raise ValueError(
            f"json_schema_format: schema must be a mapping, got {type(schema).__name__}"
        )
    try:
        schema_key = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema_format: schema is not JSON-serialisable: {exc}") from None
    validator = _schema_validator(schema_key)
    if tag and len(_tag_pattern(tag).findall(completion)) > 1:
        return 0.0
    tagged = extract_tagged(completion, tag) if tag else None
    ok, value = _parse_json_candidate(tagged if tagged is not None else completion)
    if not ok:
        return 0.0
    return 1.0 if validator.is_valid(value) else 0.0


_THINK_ANSWER_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_THINK_ANSWER_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_answer_parts(text: str) -> tuple[str, str] | None:
    """(reasoning, answer) when `text` is exactly `<think>R</think><answer>A</answer>`, else None.

    Exactly one of each tag, in that order, with only whitespace around and between them; R and A
    not empty and holding no tag of the two (nested or repeated tags are not the structure).
    """
    if any(text.count(tag) != 1 for tag in _THINK_ANSWER_TAGS):
        return None
    match = _THINK_ANSWER_RE.fullmatch(text)
    if match is None:
        return None
    think, answer = match.group(1).strip(), match.group(2).strip()
    return (think, answer) if think and answer else None


# The answer checks `think_answer_format_with_success` may gate on.
_SUCCESS_CHECKS = ("numeric_match", "exact_match", "math_equiv")


def think_answer_format_with_success(
    completion: str,
    answer: Any,
    check: str = "numeric_match",
    bonus: float = 1.0,
    **options: Any,
) -> float:
    """Reasoning-aware format shaping that cannot be farmed alone: `bonus` when the completion is
    exactly `<think>...</think><answer>...</answer>` (see `think_answer_parts`) AND the answer is
    right, else 0.0.

    Correctness is the built-in answer check named by `check` (numeric_match, exact_match or
    math_equiv), the same one an accuracy component uses, run on the `<answer>` content alone (so
    a right number inside <think> earns nothing); other options (tolerance, case_sensitive, ...)
    go to that check. A plain format reward (answer_tag_format, regex_format) pays a well-formed
    wrong answer, so a policy can farm it without solving anything; this one pays only the solving
    completions, for the format they used. The check's own errors (a non-numeric `answer` field)
    raise as they would in the accuracy component.
    """
    if check not in _SUCCESS_CHECKS:
        raise ConfigError(
            "think_answer_format_with_success: check must be one of "
            f"{', '.join(_SUCCESS_CHECKS)}; got {check!r}"
        )
    if not math.isfinite(bonus) or bonus <= 0:
        raise ConfigError(f"think_answer_format_with_success: bonus must be > 0, got {bonus!r}")
    correct = BUILTIN_REWARDS[check]
    options = {k: v for k, v in options.items() if k not in ("extract", "tag")}
    parts = think_answer_parts(completion)
    if parts is None:
        _ = correct("", answer=answer, **options)  # broken data raises even when the format fails
        return 0.0
    return bonus if correct(parts[1], answer=answer, **options) == 1.0 else 0.0


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "answer_tag_format": answer_tag_format,
    "regex_format": regex_format,
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math_equiv": math_equiv,
    "json_schema_format": json_schema_format,
    "think_answer_format_with_success": think_answer_format_with_success,
    # "tool_trace" (rlvr.verifiers.trace) is added by rlvr/verifiers/__init__.py: it needs the
    # @trajectory_reward marker from rubric.py, which itself imports this module.
}
