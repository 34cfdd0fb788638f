"""YAML's guesses undone where the config says a field is text.

YAML 1.1 reads `off`, `on`, `yes`, `no` as booleans and `1e3` or `0.10` as numbers, so
`--set model.bf16=off` (a choice of "auto", "on", "off") used to arrive as False and be refused.
Where a field cannot take what YAML produced but takes text, the text is meant: `--set` keeps the
raw string as typed; a config file's booleans become the choice spelled like them (`off` -> "off").
A field that does take the YAML value (a bool, a number, `bool | Literal["auto"]`) keeps it.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

# A YAML boolean's possible spellings, in the order a choice is looked for.
_BOOL_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}


def _options(annotation: Any) -> list[Any]:
    """The members of a union (Annotated and Optional unwrapped), else [annotation]."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _options(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [member for arg in get_args(annotation) for member in _options(arg)]
    return [annotation]


def field_annotation(schema: type[BaseModel], path: list[str]) -> Any | None:
    """The type annotation at `path` (keys; digits index lists) in `schema`, None where unknown."""
    annotation: Any = schema
    for part in path:
        annotation = _child(annotation, part)
        if annotation is None:
            return None
    return annotation


def _child(annotation: Any, part: str) -> Any | None:
    for option in _options(annotation):
        if isinstance(option, type) and issubclass(option, BaseModel):
            found = option.model_fields.get(part)
            if found is not None:
                return found.annotation
        origin, args = get_origin(option), get_args(option)
        if origin in (list, tuple) and part.isdigit() and args:
            return args[0]
        if origin is dict and len(args) == 2:
            return args[1]
    return None


def _accepts(annotation: Any, value: Any) -> bool:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    for option in _options(annotation):
        if get_origin(option) is Literal:
            if any(type(choice) is type(value) and choice == value for choice in get_args(option)):
                return True
        elif (
            option is Any
            or (option is bool and isinstance(value, bool))
            or (option is int and is_number and isinstance(value, int))
            or (option is float and is_number)
        ):
            return True
    return False


def _text_choices(annotation: Any) -> tuple[bool, list[str]]:
    """(takes any str, the str choices of its Literals)."""
    any_text, choices = False, []
    for option in _options(annotation):
        if option is str:
            any_text = True
        elif get_origin(option) is Literal:
            choices += [c for c in get_args(option) if isinstance(c, str)]
    return any_text, choices


def override_value(schema: type[BaseModel], path: list[str], raw: str, value: Any) -> Any:
    """`--set path=raw`: the raw text where YAML made a bool/number the field cannot take but text
    it can; else `value` unchanged (validation then says what is wrong)."""
    if not isinstance(value, bool | int | float):
        return value
    annotation = field_annotation(schema, path)
    if annotation is None or _accepts(annotation, value):
        return value
    any_text, choices = _text_choices(annotation)
    text = raw.strip()
    return text if any_text or text in choices else value


def file_booleans(data: Any, schema: type[BaseModel], path: tuple[str, ...] = ()) -> Any:
    """A config file's YAML booleans in fields that are text choices, as the choice spelled like
    them (`bf16: off` -> "off"); everything else as it was. Returns new containers."""
    if isinstance(data, dict):
        return {k: file_booleans(v, schema, (*path, str(k))) for k, v in data.items()}
    if isinstance(data, list):
        return [file_booleans(v, schema, (*path, str(i))) for i, v in enumerate(data)]
    if not isinstance(data, bool):
        return data
    annotation = field_annotation(schema, list(path))
    if annotation is None or _accepts(annotation, data):
        return data
    _, choices = _text_choices(annotation)
    return next((word for word in _BOOL_WORDS[data] if word in choices), data)
