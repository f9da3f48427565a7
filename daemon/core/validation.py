"""Turn pydantic's validation errors into located, plain-language problems.

Config and manifest are validated all at once; each problem names where it is
(``roots[0].observer``) and, for an unknown key, lists the keys that are valid there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic


def location(loc: Sequence[str | int]) -> str:
    """``("roots", 0, "path")`` → ``roots[0].path``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _model_at(model: type[pydantic.BaseModel], loc: Sequence[str | int]) -> Any:
    """The model class that owns the last key of ``loc``, following fields and list items."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, pydantic.BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = _inner_model(field.annotation)
    return current


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside ``X``, ``list[X]``, ``tuple[X, ...]`` or ``X | None``."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def problems(
    exc: pydantic.ValidationError, model: type[pydantic.BaseModel]
) -> list[tuple[str, str]]:
    """Every error as ``(where, message)``; unknown keys list the valid ones."""
    found = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        where = location(loc)
        if err["type"] == "extra_forbidden":
            owner = _model_at(model, loc)
            valid = ", ".join(sorted(_keys(owner))) if owner is not None else ""
            message = f"unknown key '{loc[-1]}'" + (f" (valid keys: {valid})" if valid else "")
        elif err["type"] == "missing":
            message = "required key is missing"
        else:
            message = err["msg"].removeprefix("Value error, ")
            if "input" in err and err["type"] not in ("model_type", "dict_type"):
                message += f" (got {_short(err['input'])})"
        found.append((where, message))
    return found


def _keys(model: type[pydantic.BaseModel]) -> list[str]:
    """The keys as written in the file: a field's alias where it has one (``from``)."""
    return [field.alias or name for name, field in model.model_fields.items()]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
