"""Shared memory between the job's main process and its workers: slabs, reused for the job's
life.

A slab is an anonymous shared file (``memfd_create``) mapped by the main process and by the one
worker it belongs to (made before the workers are forked, so both hold it; nothing is named,
nothing can leak past the processes). A worker decodes a chunk of images into a free slab, the
main process reads their pixels from it for the net and writes their masks after them, and the
same worker finishes them from there: every image's pixels and mask cross between processes
without a copy through a pipe, and no memory is allocated per chunk. A slab grows (the worker
enlarges the file, the main process maps it again) when a chunk does not fit.

Layout of a chunk in its slab: each image's float32 pixels, then each image's uint8 mask, every
part aligned to :data:`ALIGN` bytes.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from daemon.contract.jobspec import InputFile, Problem

ALIGN = 64
FIRST_BYTES = 2**20

# A worker's read (:mod:`pipelines.inference.source`) stops growing a chunk past this (the image
# that crosses it is read whole): a worker's slabs then hold at most 4 × (16 MiB or one image),
# e.g. 80 MiB for images of 2048² (20 MiB each, pixels and mask), 10 MiB a slab for chunks of 32
# images of 256² (what :func:`pipelines.inference.stages.images_that_fit` gives them).
CHUNK_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Entry:
    """One input of a chunk as its worker left it: where its pixels and mask lie in the slab
    (``shape`` empty: no pixels: problems, or tiled). A worker's reply carries these to the
    main process, pickled: defined here, not with the code that reads them
    (:mod:`pipelines.inference.source`), the main process unpickles them without that code's
    imports (Pillow, tifffile: ~85 ms of the job's start, while the workers wait for it)."""

    index: int
    item: InputFile
    problems: tuple[Problem, ...]
    sha256: str
    tiled: bool
    shape: tuple[int, ...]
    pixel_offset: int
    mask_offset: int


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def layout(shapes: Sequence[tuple[int, ...]]) -> tuple[list[int], list[int], int]:
    """(pixel offsets, mask offsets, bytes in all) of a chunk of images of ``shapes``."""
    pixels, masks, end = [], [], 0
    for shape in shapes:
        pixels.append(end)
        end += aligned(math.prod(shape) * 4)
    for shape in shapes:
        masks.append(end)
        end += aligned(math.prod(shape))
    return pixels, masks, end


class Slab:
    """One shared file and this process's mapping of it."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.map = mmap.mmap(fd, size)

    @classmethod
    def make(cls, size: int = FIRST_BYTES) -> Slab:
        fd = os.memfd_create("watchd-slab", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return cls(fd, size)

    def grow(self, size: int) -> None:
        """At least ``size`` bytes (the file enlarged; the other side maps it again)."""
        if size <= self.size:
            return
        size = max(size, 2 * self.size)
        os.ftruncate(self.fd, size)
        self.follow(size)

    def follow(self, size: int) -> None:
        """Map the file again at ``size`` bytes, as the other side enlarged it."""
        if size == self.size:
            return
        old, self.map, self.size = self.map, mmap.mmap(self.fd, size), size
        with contextlib.suppress(BufferError):  # a view of it still lives: it goes with that
            old.close()

    def pixels(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        return np.frombuffer(self.map, np.float32, count, offset).reshape(shape)

    def mask(self, offset: int, shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        return np.frombuffer(self.map, np.uint8, count, offset).reshape(shape)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)
