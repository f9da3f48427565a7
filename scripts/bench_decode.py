"""Benchmark: an input's decode (:func:`pipelines.images.decode`: PNG or TIFF bytes to float32
grey in [0, 1]), a job worker's largest cost per image, alone, in CPU-ms per image, the old
code's against this tree's, in one process, on synthetic images as the benchmarks' batches hold
them (``scripts/synth.py``: 8-bit and 16-bit grey PNGs, 8-bit RGB PNGs).

    .venv/bin/python scripts/bench_decode.py --old ../wt-base/pipelines/images.py \\
        [--images 300] [--size 256] [--rounds 7]

Each round decodes every image with the old module and then the new. Printed: the medians
over the rounds, their ratio, and whether the two codes' pixels are equal bit for bit on every
image (they must be: a mask depends on them).
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth
from bench_objects import old_against_new

from pipelines import images

KINDS: dict[str, Callable[[np.ndarray], np.ndarray]] = {  # a row's name → the file's pixels
    "PNG 8-bit grey": lambda pixels: synth.to_integer(pixels, 8),
    "PNG 16-bit grey": lambda pixels: synth.to_integer(pixels, 16),
    "PNG 8-bit RGB": lambda pixels: np.stack([synth.to_integer(pixels, 8)] * 3, axis=-1),
}


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def cpu_ms(module: ModuleType, files: list[bytes]) -> float:
    started = time.process_time()
    for data in files:
        module.decode(data)
    return 1000 * (time.process_time() - started) / len(files)


def compare(name: str, files: list[bytes], old: ModuleType, rounds: int) -> None:
    times: dict[str, list[float]] = {"old": [], "new": []}
    for _ in range(rounds):
        times["old"].append(cpu_ms(old, files))
        times["new"].append(cpu_ms(images, files))
    before, after = statistics.median(times["old"]), statistics.median(times["new"])
    equal = sum(np.array_equal(old.decode(d).view(np.uint32), images.decode(d).view(np.uint32))
                for d in files)  # fmt: skip
    size = sum(map(len, files)) / len(files) / 1024
    print(f"| {name} | {len(files)} | {size:.0f} kB | {before:.3f} | {after:.3f} | "
          f"{before / after:.2f} | {equal} of {len(files)} |", flush=True)  # fmt: skip


def main() -> int:
    args, old = old_against_new(__doc__, "images", rounds=7)
    drawn = [synth.sample(11, index, args.size).image for index in range(args.images)]
    print(f"old: {args.old.resolve()}; new: {images.__file__}; {args.images} images "
          f"{args.size}²; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    print()
    print("| file | images | size | decode, old (CPU-ms/image) | decode, new | old / new "
          "| pixels equal |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, stored in KINDS.items():
        compare(name, [png(stored(pixels)) for pixels in drawn], old, args.rounds)
    print()
    print(f"medians of {args.rounds} rounds; load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
