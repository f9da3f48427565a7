"""Benchmark: the object step (:mod:`pipelines.instances`, touching objects cut apart) alone,
in CPU-ms per image, the old code's against this tree's, in one process, on the masks that
``scripts/bench_host.py``'s stand-in job makes (a synthetic image's pixels brighter than
mid-grey: the droplet's bright rim, arcs and specks, the hard case), on the true masks of
the same images (what a trained net draws), and on the true masks of touching spheroids (the
case the step is for).

    .venv/bin/python scripts/bench_objects.py --old ../wt-base/pipelines/instances.py \\
        [--images 300] [--rounds 5]

Each round times every image through the old module and then the new, with ``split_neck`` at
its default and at 0 (connected components only); the object step's cost is the difference.
Printed: the medians over the rounds, their ratio, and whether the two codes' labels are
equal on every image (they must be: the step's output is fixed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synth
from microscope import Look
from standin_job import THRESHOLD

from daemon.contract.names import INFERENCE
from pipelines import instances

MIN_AREA = 16  # bench_host's min_object_area


def standin_masks(count: int, size: int) -> list[np.ndarray]:
    """The masks of bench_host's stand-in job: sigmoid(the 8-bit image in [0, 1]) > threshold."""
    masks = []
    for index in range(count):
        pixels = synth.to_integer(synth.sample(11, index, size).image, 8)
        logits = torch.from_numpy(pixels.astype(np.float32) / 255)
        masks.append((torch.sigmoid(logits) > THRESHOLD).numpy())
    return masks


def true_masks(count: int, size: int) -> list[np.ndarray]:
    """The true masks of bench_host's images: spheroids as a trained net outlines them."""
    return [synth.sample(11, index, size).mask for index in range(count)]


def touching_masks(count: int, size: int) -> list[np.ndarray]:
    """The true masks of synthetic images where two spheroids touch."""
    return [synth.sample(11, index, size, Look(touching=1.0)).mask for index in range(count)]


def load(path: Path, name: str) -> ModuleType:
    """The old code's module from its file, under a name of its own."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_ms(step: Callable[[np.ndarray, int, float], np.ndarray], masks: list[np.ndarray],
           split_neck: float) -> float:  # fmt: skip
    """CPU-ms per image of ``step`` over ``masks``."""
    started = time.process_time()
    for mask in masks:
        step(mask, MIN_AREA, split_neck)
    return 1000 * (time.process_time() - started) / len(masks)


def compare(name: str, masks: list[np.ndarray], old: ModuleType, rounds: int) -> None:
    """Time both codes on ``masks`` and print one table row each, and their agreement."""
    neck = INFERENCE.split_neck
    times: dict[str, list[float]] = {"old": [], "new": [], "components": []}
    for _ in range(rounds):
        times["old"].append(cpu_ms(old.mask_objects, masks, neck))
        times["new"].append(cpu_ms(instances.mask_objects, masks, neck))
        times["components"].append(cpu_ms(instances.mask_objects, masks, 0.0))
    base = statistics.median(times["components"])
    before, after = statistics.median(times["old"]) - base, statistics.median(times["new"]) - base
    new = instances.mask_objects
    equal = sum(np.array_equal(old.mask_objects(m, MIN_AREA, neck), new(m, MIN_AREA, neck))
                for m in masks)  # fmt: skip
    print(f"| {name} | {len(masks)} | {base:.2f} | {before:.2f} | {after:.2f} | "
          f"{before / after:.1f} | {equal} of {len(masks)} |", flush=True)  # fmt: skip


def old_against_new(doc: str, module: str, rounds: int) -> tuple[argparse.Namespace, ModuleType]:
    """The arguments of a benchmark of one module, old against new (``--old`` its file,
    ``--images``, ``--size``, ``--rounds``), and the old module loaded."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True,
                        help=f"the old code's pipelines/{module}.py")  # fmt: skip
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    return args, load(args.old, f"old_{module}")


def main() -> int:
    args, old = old_against_new(__doc__, "instances", rounds=5)
    print(
        f"old: {args.old.resolve()}; new: {instances.__file__}; split_neck "
        f"{INFERENCE.split_neck}, min_area {MIN_AREA}; load {os.getloadavg()[0]:.2f}"
    )
    print()
    print("| masks | images | components only, CPU-ms/image | object step, old | object step, "
          "new | old / new | labels equal |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    compare(f"stand-in {args.size}²", standin_masks(args.images, args.size), old, args.rounds)
    compare(f"true masks {args.size}²", true_masks(args.images, args.size), old, args.rounds)
    compare("touching spheroids 96²", touching_masks(args.images, 96), old, args.rounds)
    print()
    print(f"medians of {args.rounds} rounds; load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
