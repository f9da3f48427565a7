"""Tiled inference: peak memory on a 20,000² image, and tiled against whole-image masks.

Writes a synthetic slide, a grid of DMA droplets (scripts/synth.py, 128² each), as a tiled,
deflate-compressed TIFF, streamed tile by tile. The real inference job segments it window by
window (it is larger than ``max_whole_pixels``); the job process's peak resident set size
(``wait4`` rusage) is printed. Then an image small enough for whole-image inference is
segmented twice by the job, whole and tiled (``max_whole_pixels = 1``), and the masks compared
pixel by pixel.

    python scripts/bench_tiled.py [--out /tmp/watchd-bench] [--size 20000] [--small 2048]

Uses the model bench_accuracy.py left in OUT/registry (run that first).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tifffile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth

from daemon.contract.jobspec import InputFile, ModelRef, Pipeline

MODEL = "bench-unet"
CELL = 128  # one droplet
TILE = 256


def slide_tiles(size: int, seed: int) -> Iterator[np.ndarray]:
    """The slide's 256² tiles in row-major order, each 2×2 droplets (the last ones cropped)."""
    across = -(-size // CELL)
    for top in range(0, size, TILE):
        for left in range(0, size, TILE):
            tile = np.zeros((TILE, TILE), dtype=np.uint8)
            for dy in (0, CELL):
                for dx in (0, CELL):
                    index = ((top + dy) // CELL) * across + (left + dx) // CELL
                    drawn = synth.sample(seed, index, CELL).image
                    tile[dy : dy + CELL, dx : dx + CELL] = synth.to_integer(drawn, 8)
            yield tile[: min(TILE, size - top), : min(TILE, size - left)]


def write_slide(path: Path, size: int, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tifffile.TiffWriter(path, bigtiff=size * size > 2**31) as tif:
        tif.write(slide_tiles(size, seed), shape=(size, size), dtype=np.uint8, tile=(TILE, TILE),
                  compression="zlib", photometric="minisblack")  # fmt: skip


def segment(batch_dir: Path, registry: Path, name: str, max_pixels: int) -> jobrun.Finished:
    image = batch_dir / "images" / "slide.tif"
    inputs = (InputFile("images/slide.tif", image.stat().st_size),)
    params = {"threshold": 0.5, "min_object_area": 16, "max_whole_pixels": max_pixels,
              "tile_size": 512, "tile_overlap": 64, "batch_size": 1}  # fmt: skip
    job = jobrun.run(batch_dir, Pipeline.INFER, inputs, registry, ModelRef(MODEL), params,
                     name=name, kind="inference")  # fmt: skip
    assert job.returncode == 0, f"{name} failed"
    return job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--size", type=int, default=20000)
    parser.add_argument("--small", type=int, default=2048)
    args = parser.parse_args()
    registry = args.out / "registry"
    big, small = args.out / "tiled-big", args.out / "tiled-small"
    for folder in (big, small):
        shutil.rmtree(folder, ignore_errors=True)
    started = time.perf_counter()
    write_slide(big / "images" / "slide.tif", args.size, seed=500)
    megabytes = (big / "images" / "slide.tif").stat().st_size / 2**20
    print(f"slide {args.size}×{args.size} written in {time.perf_counter() - started:.0f} s "
          f"({megabytes:.0f} MB tiled TIFF)")  # fmt: skip
    job = segment(big, registry, "infer", 4096 * 4096)
    row = (big / "results" / "parts" / "table-0000.csv").read_text().splitlines()[1]
    print(f"tiled inference of {args.size}²: {job.summary['seconds_per_image']:.0f} s, "
          f"peak RSS of the job {job.peak_rss_mb:.0f} MB (target <= 2048 MB)")  # fmt: skip
    print(f"  table row: {row}")
    write_slide(small / "images" / "slide.tif", args.small, seed=600)
    whole = segment(small, registry, "whole", 4096 * 4096)
    whole_mask = tifffile.imread(small / "results" / "masks" / "images" / "slide.tif") > 0
    shutil.rmtree(small / "results" / "ledger")  # the same image again, now window by window
    tiled = segment(small, registry, "tiled", 1)
    tiled_mask = tifffile.imread(small / "results" / "masks" / "images" / "slide.tif") > 0
    agreement = float((whole_mask == tiled_mask).mean())
    overlap = 2 * (whole_mask & tiled_mask).sum() / max(whole_mask.sum() + tiled_mask.sum(), 1)
    print(f"{args.small}² whole ({whole.summary['seconds_per_image']:.1f} s, "
          f"{whole.peak_rss_mb:.0f} MB) vs tiled ({tiled.summary['seconds_per_image']:.1f} s, "
          f"{tiled.peak_rss_mb:.0f} MB): pixel agreement "
          f"{agreement:.5f}, Dice {overlap:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
