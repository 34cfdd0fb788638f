"""Reading the harness's result channel on the host: every byte of it may have been written by the
candidate (it holds the channel's file descriptor), so parsing it must never raise.

The harness writes one JSON object per line: `{"i": test index, "out": canonical JSON text}` or
`{"i": index, "error": text}`, `i = -1` for a failure to load the code. Anything else (not JSON,
nested deeper than the parser's recursion limit, a huge line, wrong field types) is skipped, so the
test it was meant for is judged on an honest record or, if none, is "missing": a failed test, never
an exception in the trainer. The first well-formed record per test counts.
"""

from __future__ import annotations

import json
from typing import Any

# The whole channel is capped at runner.MAX_OUTPUT_BYTES already; one record longer than this is not
# something the harness writes for a function-writing task (an output this big fails the test).
MAX_RECORD_CHARS = 256 * 1024
MAX_ERROR_CHARS = 300


def parse_record(line: str) -> dict[str, Any] | None:
    """One line of the channel as {"i": int, "out": str} or {"i": int, "error": str}; None when it
    is not exactly that. json can raise ValueError (bad syntax, a number too long to convert),
    RecursionError (`[[[[...`) or MemoryError on hostile text; anything it raises means the same
    thing, a record that does not count, so all of it is caught."""
    if len(line) > MAX_RECORD_CHARS:
        return None
    try:
        record = json.loads(line)
    except Exception:
        return None
    if not isinstance(record, dict):
        return None
    index = record.get("i")
    if not isinstance(index, int) or isinstance(index, bool) or index < -1:
        return None
    out, error = record.get("out"), record.get("error")
    if isinstance(error, str):
        return {"i": index, "error": error[:MAX_ERROR_CHARS]}
    if isinstance(out, str) and error is None:
        return {"i": index, "out": out}
    return None


def parse_records(raw: bytes) -> tuple[dict[int, dict[str, Any]], str | None]:
    """(the first well-formed record per test index, the load error if one was reported)."""
    seen: dict[int, dict[str, Any]] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        record = parse_record(line)
        if record is not None:
            seen.setdefault(record["i"], record)
    load = seen.get(-1)
    load_error = load.get("error", "load failed") if load is not None else None
    return seen, load_error
