"""Sweeps: the ``[sweep]`` section of a manifest and its expansion into trials. Pure.

A ``kind = "sweep"`` batch trains one model per trial, each with the manifest's ``[params]``
overridden by one point of the search space, and registers only the best trial (by ``metric``
on its validation set). ``[sweep.space]`` names bounded training parameters:

- a list of values: a grid axis (``method = "grid"``), or a set to draw from (``"random"``);
- a range ``{min = …, max = …, log = true|false}``: ``"random"`` only, drawn uniformly (or
  log-uniformly), rounded for whole-number parameters.

Grid trials are the Cartesian product in the order written (the first ``trials`` of it when
``trials`` is given); random trials are drawn from a generator seeded with ``seed``, so the same
manifest always means the same trials. Every value is checked against the parameter's bounds.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from daemon.contract.jobspec import Problem

MAX_TRIALS = 256
DEFAULT_RANDOM_TRIALS = 8
WHERE = "manifest.toml, sweep"


class RangeModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    min: float
    max: float
    log: bool = False


class SweepModel(pydantic.BaseModel):
    """The ``[sweep]`` section as written."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    method: Literal["grid", "random"] = "random"
    trials: Annotated[int, Field(ge=1, le=MAX_TRIALS)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    metric: Literal["val_dice", "val_iou", "val_object_f1"] = "val_dice"
    space: dict[str, list[bool | int | float | str] | RangeModel]


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    log: bool


@dataclass(frozen=True)
class SweepPlan:
    """A valid sweep: ``trials`` parameter overrides, in order (trial 0 first)."""

    method: str
    seed: int
    metric: str
    space: tuple[tuple[str, tuple[Any, ...] | Range], ...]
    trials: tuple[Mapping[str, Any], ...]

    def describe(self) -> dict[str, Any]:
        """The sweep as the sweep job and the report see it (JSON)."""
        space = {
            name: list(axis)
            if isinstance(axis, tuple)
            else {"min": axis.low, "max": axis.high, "log": axis.log}
            for name, axis in self.space
        }
        return {"method": self.method, "seed": self.seed, "metric": self.metric,
                "space": space, "trials": len(self.trials)}  # fmt: skip


def check_space(
    sweep: SweepModel, validate: Any, fields: Mapping[str, Any]
) -> tuple[list[Problem], dict[str, bool]]:
    """Problems with the space; and which parameters are whole numbers.

    ``validate(name, value)`` returns an error text or None (the training parameters' bounds).
    """
    found: list[Problem] = []
    integer: dict[str, bool] = {}
    if not sweep.space:
        found.append(Problem(f"{WHERE}.space", "is empty", "name at least one parameter"))
    for name, axis in sweep.space.items():
        where = f"{WHERE}.space.{name}"
        if name not in fields:
            known = ", ".join(sorted(fields))
            found.append(Problem(where, "is not a training parameter", f"use one of: {known}"))
            continue
        integer[name] = fields[name] is int
        found += _check_axis(where, name, axis, sweep.method, validate)
    return found, integer


def _check_axis(
    where: str, name: str, axis: list[Any] | RangeModel, method: str, validate: Any
) -> list[Problem]:
    if isinstance(axis, RangeModel):
        if method == "grid":
            return [Problem(where, 'a range needs method = "random"', "list the values instead")]
        values: list[Any] = [axis.min, axis.max]
        if axis.min >= axis.max:
            return [Problem(where, f"min {axis.min} is not below max {axis.max}")]
        if axis.log and axis.min <= 0:
            return [Problem(where, "a log range needs min > 0")]
    else:
        values = axis
        if not values:
            return [Problem(where, "lists no values")]
    found = []
    for value in values:
        error = validate(name, value)
        if error:
            found.append(Problem(where, f"{value!r}: {error}"))
    return found


def expand(sweep: SweepModel, integer: Mapping[str, bool]) -> SweepPlan:
    """The trials of a checked sweep (see the module docstring)."""
    space: list[tuple[str, tuple[Any, ...] | Range]] = []
    for name, axis in sweep.space.items():
        if isinstance(axis, RangeModel):
            space.append((name, Range(axis.min, axis.max, axis.log)))
        else:
            space.append((name, tuple(axis)))
    if sweep.method == "grid":
        axes = [(name, axis) for name, axis in space if isinstance(axis, tuple)]
        grid = itertools.product(*(axis for _, axis in axes))
        points = [dict(zip([n for n, _ in axes], p, strict=True)) for p in grid]
        trials = points[: sweep.trials or MAX_TRIALS]
    else:
        rng = random.Random(sweep.seed)
        count = sweep.trials or DEFAULT_RANDOM_TRIALS
        trials = [{n: _draw(rng, a, integer.get(n, False)) for n, a in space} for _ in range(count)]
    return SweepPlan(sweep.method, sweep.seed, sweep.metric, tuple(space), tuple(trials))


def _draw(rng: random.Random, axis: tuple[Any, ...] | Range, whole: bool) -> Any:
    if isinstance(axis, tuple):
        return axis[rng.randrange(len(axis))]
    if axis.log:
        value = math.exp(rng.uniform(math.log(axis.low), math.log(axis.high)))
    else:
        value = rng.uniform(axis.low, axis.high)
    return round(value) if whole else float(f"{value:.6g}")


def grid_size(plan: SweepPlan) -> int:
    return math.prod(len(axis) for _, axis in plan.space if isinstance(axis, tuple))


def trial_params(plan: SweepPlan) -> Sequence[dict[str, Any]]:
    """Per-job parameters of each trial: the overrides plus the trial's number."""
    return [{**overrides, "trial": i} for i, overrides in enumerate(plan.trials)]
