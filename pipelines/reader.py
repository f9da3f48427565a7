"""Reading a shard's images ahead of the net, in DataLoader worker processes.

One or two worker processes open, read, verify (sha256) and decode the images while the main
process runs the net: the share's latency and the decoding are hidden behind the forward pass.
Images come back in order, in chunks of :data:`CHUNK`: the pixels of a chunk travel in one
tensor, which the loader hands over in shared memory. Every hand-over costs the main process a
file descriptor received, a mapping made and a queue read, and wakes the worker, which takes a
core from the net's threads; per chunk rather than per image, that cost is a quarter (measured
in docs/benchmarks.md, "Inference efficiency"). Pickled as arrays through the pipe instead, a
256² float32 image goes in 64 KiB pieces, waking the worker several times per image.

An input that cannot be read comes back with its problems instead of pixels; one too large to
decode whole comes back marked ``tiled`` (the main process segments it window by window) or,
when the windowed reader cannot take it, with the problem that says so
(:func:`pipelines.images.read_bounded`: one open, one read per image, bounded in memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from daemon.contract.jobspec import InputFile, Problem
from daemon.contract.safeopen import Folder
from pipelines.images import check_suffix, read_bounded
from pipelines.job import InputError

CHUNK = 4


@dataclass(frozen=True)
class Loaded:
    """One input as read by a loader worker: pixels, or the problems that prevented it, or
    ``tiled`` (too large to decode whole: the main process segments it window by window)."""

    item: InputFile
    pixels: np.ndarray | None
    problems: tuple[Problem, ...]
    sha256: str = ""
    tiled: bool = False


class ShardImages(TorchDataset[Loaded]):
    """Reads and verifies the shard's images (in DataLoader workers, overlapping the net)."""

    def __init__(
        self, batch_dir: Folder, items: list[InputFile], max_pixels: int, channel: Any = None
    ) -> None:
        self.batch_dir, self.items, self.max_pixels = batch_dir, items, max_pixels
        self.channel = channel  # the plane of a multi-channel TIFF (pipelines.channels)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Loaded:
        item = self.items[index]
        problem = check_suffix(item)
        if problem is not None:
            return Loaded(item, None, (problem,))
        try:
            found = read_bounded(self.batch_dir, item, self.max_pixels, self.channel)
        except InputError as exc:
            return Loaded(item, None, exc.problems)
        if found is None:
            return Loaded(item, None, (), tiled=True)
        pixels, digest = found
        return Loaded(item, pixels, (), digest)


Packed = tuple[list[tuple[Loaded, tuple[int, ...]]], torch.Tensor]


def pack(chunk: list[Loaded]) -> Packed:
    """In a worker: the chunk without its pixels, each with its image's shape, and all the
    pixels, flat, in one tensor (which the loader hands over in shared memory)."""
    arrays = [loaded.pixels.ravel() for loaded in chunk if loaded.pixels is not None]
    flat = torch.from_numpy(np.concatenate(arrays) if arrays else np.empty(0, np.float32))
    entries = [
        (replace(loaded, pixels=None), () if loaded.pixels is None else loaded.pixels.shape)
        for loaded in chunk
    ]
    return entries, flat


def unpack(packed: Packed) -> Iterator[Loaded]:
    """In the main process: the chunk's inputs again, pixels as views of the one tensor."""
    entries, flat = packed
    pixels, offset = flat.numpy(), 0
    for loaded, shape in entries:
        if not shape:
            yield loaded
            continue
        size = int(np.prod(shape))
        yield replace(loaded, pixels=pixels[offset : offset + size].reshape(shape))
        offset += size


def read_ahead(
    batch_dir: Folder, items: list[InputFile], max_pixels: int, cpus: int, channel: Any = None
) -> Iterator[Loaded]:
    """The shard's inputs, read and decoded ahead by worker processes, in order."""
    # One or two reader processes hide the share's latency; the rest of the cores run the net.
    workers = min(2, max(0, cpus - 1))
    loader = DataLoader(
        ShardImages(batch_dir, items, max_pixels, channel),
        batch_size=CHUNK,
        num_workers=workers,
        collate_fn=pack,
        prefetch_factor=1 if workers else None,  # a chunk ahead per worker
    )
    for packed in loader:
        yield from unpack(packed)
