"""Reading a config: YAML, `--set a.b=value` overrides, one-line errors, and writing it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from rlvr.config.run import RunConfig
from rlvr.errors import ConfigError
from rlvr.yaml_types import file_booleans, override_value


# ---------------------------------------------------------------------------------------------- loading
def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    kind = first["type"]
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if kind == "extra_forbidden":
        return f"{source}: unknown key '{where}'{more}"
    msg = first["msg"]
    if kind == "literal_error":
        allowed = first.get("ctx", {}).get("expected", "")
        return f"{source}: '{where}' = {first.get('input')!r} is not allowed; expected {allowed}"
    if not first[
        "loc"
    ]:  # a rule across sections: its message says it all; the input is the whole file
        return f"{source}: {msg.removeprefix('Value error, ')}{more}"
    return f"{source}: '{where}': {msg} (got {first.get('input')!r}){more}"


def _parse_override(item: str, schema: type[BaseModel] | None = None) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set '{item}': expected key=value, e.g. train.steps=10")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if schema is not None:  # `model.bf16=off`: the text, where the field is text (yaml_types.py)
        value = override_value(schema, path, raw, value)
    return path, value


def apply_overrides(
    data: dict[str, Any], overrides: list[str], schema: type[BaseModel] | None = None
) -> dict[str, Any]:
    """Set `a.b.c=value` paths in nested config data; a number indexes a list (`stages.0.name=x`).
    With `schema`, a value YAML read as a bool or number goes in as typed where the field is text."""
    for item in overrides:
        path, value = _parse_override(item, schema)
        node: Any = data
        for part in path[:-1]:
            if isinstance(node, list):
                node = _list_item(node, part, item)
                continue
            child = node.get(part)
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, dict | list):
                raise ConfigError(f"--set '{item}': '{part}' is not a section")
            node = child
        if isinstance(node, list):
            index = int(path[-1]) if path[-1].isdigit() else -1
            _list_item(node, path[-1], item)
            node[index] = value
        else:
            node[path[-1]] = value
    return data


def _list_item(items: list[Any], part: str, item: str) -> Any:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"--set '{item}': '{part}' is not an index of a list of {len(items)}")
    return items[int(part)]


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (or start from defaults when path is None), apply `--set` overrides, validate."""
    source = str(path) if path is not None else "config"
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file '{file}' does not exist")
        try:
            loaded = yaml.safe_load(file.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{source}:{where}: malformed YAML: {problem}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of sections, got {type(loaded).__name__}"
            )
        data = file_booleans(loaded, RunConfig)  # `bf16: off` means "off" (yaml_types.py)
    data = apply_overrides(data, overrides or [], RunConfig)
    # Files a config names (algorithm, trackers) are found from its folder.
    context = {"config_dir": Path(path).parent.resolve()} if path is not None else None
    try:
        return RunConfig.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data that `load_config` reads back (a mixture omits task/rewards)."""
    data = cfg.model_dump(mode="json")
    if cfg.mixture:
        data.pop("task", None)
        data.pop("rewards", None)
    return data
