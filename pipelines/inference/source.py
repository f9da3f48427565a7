"""The source stage: a shard's images read, verified (sha256) and decoded by the job's workers,
ahead of the net, into shared slabs (:mod:`pipelines.inference.slabs`).

A read task is a run of the shard's inputs; its worker reads them in order into the slab it is
given and stops early once the slab holds :data:`~pipelines.inference.slabs.CHUNK_BYTES` (the
main process asks for the rest again): however large the images, a chunk in flight stays
bounded. An input that cannot be read comes back with its problems instead of pixels; one too
large to decode whole comes back marked ``tiled`` (the main process segments it window by
window) or, when the windowed reader cannot take it, with the problem that says so
(:func:`pipelines.images.read_bounded`: one open, one read per image, bounded in memory).

Only the workers import this module (its code needs Pillow and libpng): the process that forks
them, once, before it does (:mod:`pipelines.inference.pool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.contract.jobspec import InputFile, Problem
from daemon.contract.safeopen import Folder
from pipelines.images import check_suffix, read_bounded
from pipelines.inference.slabs import CHUNK_BYTES, Entry, Slab, layout
from pipelines.job import InputError


@dataclass(frozen=True)
class Loaded:
    """One input as read: its pixels, or the problems that prevented it, or ``tiled`` (too
    large to decode whole: the main process segments it window by window)."""

    item: InputFile
    pixels: np.ndarray | None
    problems: tuple[Problem, ...]
    sha256: str = ""
    tiled: bool = False


def load(batch_dir: Folder, item: InputFile, max_pixels: int, channel: Any = None) -> Loaded:
    """Read, verify and decode one input (in a worker)."""
    problem = check_suffix(item)
    if problem is not None:
        return Loaded(item, None, (problem,))
    try:
        found = read_bounded(batch_dir, item, max_pixels, channel)
    except InputError as exc:
        return Loaded(item, None, exc.problems)
    if found is None:
        return Loaded(item, None, (), tiled=True)
    pixels, digest = found
    return Loaded(item, pixels, (), digest)


def read_chunk(
    batch_dir: Folder, items: Sequence[tuple[int, InputFile]], slab: Slab, max_pixels: int,
    channel: Any = None, budget: int = CHUNK_BYTES,
) -> list[Entry]:  # fmt: skip
    """Read ``items`` (index, input) in order into ``slab`` (grown as needed); stop after the
    one that brings the chunk to ``budget`` bytes: the entries of those read."""
    loaded: list[tuple[int, Loaded]] = []
    for index, item in items:
        found = load(batch_dir, item, max_pixels, channel)
        loaded.append((index, found))
        if layout(_shapes(loaded))[2] >= budget:
            break
    shapes = _shapes(loaded)
    pixel_at, mask_at, size = layout(shapes)
    slab.grow(size)
    entries, k = [], 0
    for index, found in loaded:
        shape: tuple[int, ...] = ()
        pixel_offset = mask_offset = 0
        if found.pixels is not None:
            shape, pixel_offset, mask_offset = found.pixels.shape, pixel_at[k], mask_at[k]
            slab.pixels(pixel_offset, shape)[...] = found.pixels
            k += 1
        entries.append(Entry(index, found.item, found.problems, found.sha256, found.tiled,
                             shape, pixel_offset, mask_offset))  # fmt: skip
    return entries


def _shapes(loaded: Sequence[tuple[int, Loaded]]) -> list[tuple[int, ...]]:
    return [found.pixels.shape for _, found in loaded if found.pixels is not None]
