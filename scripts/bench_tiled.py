"""Tiled inference: peak memory on a 20,000² image, and tiled against whole-image masks.

Writes a synthetic slide, a grid of DMA droplets (scripts/synth.py, 128² each), as a tiled,
deflate-compressed TIFF, streamed tile by tile. The real inference job segments it window by
window (it is larger than ``max_whole_pixels``); the job process's peak resident set size
(its own VmHWM, in its result.json) is printed. Then an image small enough for whole-image
inference is segmented twice by the job, whole and tiled (``max_whole_pixels`` = one 256²
tile), and the masks compared pixel by pixel. The tiled masks are OME-Zarr label images
(pipelines/omezarr.py); for the large slide its levels, files, size on disk and object table
are printed.

    python scripts/bench_tiled.py [--out /tmp/watchd-bench] [--size 20000] [--small 2048]

Uses the model bench_accuracy.py left in OUT/registry (run that first).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import tifffile
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth

from daemon.contract.jobspec import InputFile, ModelRef, Pipeline

MODEL = "bench-unet"


def label_image(batch_dir: Path) -> list[np.ndarray]:
    """The levels of the job's OME-Zarr label image of images/slide.tif (the whole level 0
    of a 20,000² slide is 1.6 GB of uint32: only the coarser levels are read for it)."""
    group = zarr.open_group(
        str(batch_dir / "results" / "masks" / "images" / "slide.tif.ome.zarr"), mode="r"
    )["labels/segmentation"]
    paths = [d["path"] for d in group.attrs["multiscales"][0]["datasets"]]
    small = [p for p in paths if group[p].size <= 2**26]
    return [group[p][:] for p in small]


def disk_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


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
    synth.write_slide(big / "images" / "slide.tif", args.size, seed=500, levels=0)
    megabytes = (big / "images" / "slide.tif").stat().st_size / 2**20
    print(f"slide {args.size}×{args.size} written in {time.perf_counter() - started:.0f} s "
          f"({megabytes:.0f} MB tiled TIFF)")  # fmt: skip
    job = segment(big, registry, "infer", 4096 * 4096)
    row = (big / "results" / "parts" / "table-0000.csv").read_text().splitlines()[1]
    print(f"tiled inference of {args.size}²: {job.summary['seconds_per_image']:.0f} s, "
          f"peak RSS of the job {job.peak_rss_mb:.0f} MB (target <= 2048 MB)")  # fmt: skip
    print(f"  table row: {row}")
    levels = label_image(big)
    objects = (big / "results" / "objects" / "images" / "slide.tif.csv").read_text().count("\n") - 1
    stored = sum(1 for p in (big / "results" / "masks" / "images").rglob("*") if p.is_file())
    print(f"  label image: {len(levels)} levels {[lv.shape[0] for lv in levels]}, {stored} files, "
          f"{disk_mb(big / 'results' / 'masks'):.0f} MB; object table {objects} rows, "
          f"largest id at the coarsest level {int(levels[-1].max()) if levels else 0}")  # fmt: skip
    synth.write_slide(small / "images" / "slide.tif", args.small, seed=600, levels=0)
    whole = segment(small, registry, "whole", 4096 * 4096)
    whole_mask = tifffile.imread(small / "results" / "masks" / "images" / "slide.tif") > 0
    shutil.rmtree(small / "results" / "ledger")  # the same image again, now window by window
    tiled = segment(small, registry, "tiled", 256 * 256)  # one tile of the TIFF may be decoded
    tiled_mask = label_image(small)[0] > 0
    agreement = float((whole_mask == tiled_mask).mean())
    overlap = 2 * (whole_mask & tiled_mask).sum() / max(whole_mask.sum() + tiled_mask.sum(), 1)
    print(f"{args.small}² whole ({whole.summary['seconds_per_image']:.1f} s, "
          f"{whole.peak_rss_mb:.0f} MB) vs tiled ({tiled.summary['seconds_per_image']:.1f} s, "
          f"{tiled.peak_rss_mb:.0f} MB): pixel agreement "
          f"{agreement:.5f}, Dice {overlap:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
