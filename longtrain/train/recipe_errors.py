"""A recipe's validation errors in the recipe's words: each names its YAML path (and the `--set` that
wrote it), the bad value and a hint (the close key or choice meant, or the field's description)."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel


def describe_error(err: dict[str, Any], override_paths: dict[tuple[str, ...], str], schema: type[BaseModel], *,
                   example: Path) -> str:
    """One pydantic error of `schema` as a line for the user: where (and which --set), what, and a hint."""
    loc = err["loc"]
    where = _yaml_path(loc) or "(top level)"
    origin = override_paths.get(tuple(str(p) for p in loc))
    source = f" (from --set {origin})" if origin else ""
    if err["type"] == "extra_forbidden":
        known = _known_keys(schema, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?{_fixed_set(origin, len(loc) - 1, close[0])}" if close else "known keys: " + ", ".join(known)
        return f"  - {where}: unknown key{source}\n      hint: {hint}"
    if err["type"] == "missing":
        return f"  - {where}: required key is missing\n      hint: {_field_hint(schema, loc, example)}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("value_error", "assertion_error"):  # our cross-field checks carry their hint
        return f"  - {where}: {msg}{source}" if loc else f"  - {msg}"
    hint = _field_hint(schema, loc, example)
    if err["type"] == "literal_error":
        close = difflib.get_close_matches(str(err["input"]), _literal_choices(schema, loc), n=1, cutoff=0.5)
        if close:
            hint = f"did you mean `{close[0]}`? ({hint})"
    got = f" (got {err['input']!r})"
    return f"  - {where}: {msg}{got}{source}\n      hint: {hint}"


def _fixed_set(origin: str | None, index: int, key: str) -> str:
    """" (--set FIXED)": the --set `origin` (KEY=VALUE) with its key's part `index` as `key`; "" for no --set."""
    if origin is None:
        return ""
    path, _, value = origin.partition("=")
    parts = path.strip().split(".")
    parts[index] = key
    return f" (--set {'.'.join(parts)}={value})"


def _yaml_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _models_at(schema: type[BaseModel], loc: Sequence[Any]) -> list[tuple[type[BaseModel], str | None]]:
    """Walk the schema along a pydantic error location: [(model, field name)] per step."""
    model: type[BaseModel] | None = schema
    steps = []
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return steps
        steps.append((model, part))
        model = _nested_model(model.model_fields[part].annotation)
    if model is not None:
        steps.append((model, None))
    return steps


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _known_keys(schema: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    steps = _models_at(schema, loc)
    if len(steps) == len(loc) + 1:
        return list(steps[-1][0].model_fields)
    return []


def _field_hint(schema: type[BaseModel], loc: Sequence[Any], example: Path) -> str:
    steps = _models_at(schema, loc)
    for model, field in reversed(steps):
        if field is not None and model.model_fields[field].description:
            return model.model_fields[field].description
    return f"see {example} for an example"


def _literal_choices(schema: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    steps = _models_at(schema, loc)
    if not steps or steps[-1][1] is None:
        return []
    model, field = steps[-1]
    return [str(a) for a in typing.get_args(model.model_fields[field].annotation)]
