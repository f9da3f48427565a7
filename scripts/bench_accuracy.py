"""Accuracy benchmark: the U-Net trained by the real training job against Otsu thresholding.

Trains on a synthetic DMA-like batch (scripts/synth.py), then segments a held-out set drawn
from another seed with the registered model (through the real inference job) and with Otsu's
threshold on the same images. Otsu gets both polarities (spheroids darker or brighter than the
threshold), and the better one is its figure. Prints pixel Dice over the whole held-out set and
the mean per-image Dice. Leaves the registry in OUT/registry for the other benchmarks.

    python scripts/bench_accuracy.py [--out /tmp/watchd-bench] [--train 192] [--test 64]
"""

from __future__ import annotations

import argparse
import csv
import shutil
import sys
from pathlib import Path

import numpy as np
from skimage.filters import threshold_otsu

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth

from daemon.contract.jobspec import ModelRef, Pipeline
from pipelines.images import decode

MODEL = "bench-unet"
PARAMS = {"epochs": 60, "batch_size": 8, "learning_rate": 0.003, "val_fraction": 0.15, "seed": 0,
          "depth": 3, "width": 16, "patience": 10}  # fmt: skip


def dice(prediction: np.ndarray, truth: np.ndarray) -> float:
    total = int(prediction.sum()) + int(truth.sum())
    return 1.0 if total == 0 else 2 * int((prediction & truth).sum()) / total


def scores(predictions: list[np.ndarray], truths: list[np.ndarray]) -> tuple[float, float]:
    """(pixel Dice over the whole set, mean per-image Dice)."""
    pooled = dice(np.concatenate([p.ravel() for p in predictions]),
                  np.concatenate([t.ravel() for t in truths]))  # fmt: skip
    return pooled, float(np.mean([dice(p, t) for p, t in zip(predictions, truths, strict=True)]))


def otsu(images: list[np.ndarray], truths: list[np.ndarray]) -> tuple[str, float, float]:
    dark = [image < threshold_otsu(image) for image in images]
    bright = [~mask for mask in dark]
    candidates = {"dark": scores(dark, truths), "bright": scores(bright, truths)}
    side = max(candidates, key=lambda k: candidates[k][0])
    return side, *candidates[side]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--train", type=int, default=192)
    parser.add_argument("--test", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=PARAMS["epochs"])
    args = parser.parse_args()
    out = args.out
    shutil.rmtree(out / "accuracy", ignore_errors=True)
    shutil.rmtree(out / "registry", ignore_errors=True)
    training = out / "accuracy" / "training"
    files = synth.make_batch(training, "training", args.train, args.size, seed=100)
    params = {**PARAMS, "epochs": args.epochs}
    trained = jobrun.run(training, Pipeline.TRAIN, jobrun.inputs_of(training, files),
                         out / "registry", ModelRef(MODEL), params, name="train",
                         kind="training")  # fmt: skip
    assert trained.returncode == 0, "training failed"
    model = trained.summary["model"]
    held_out, truth_dir = out / "accuracy" / "held-out", out / "accuracy" / "truth"
    images = synth.make_batch(held_out, "inference", args.test, args.size, seed=200,
                              truth_dir=truth_dir)  # fmt: skip
    inferred = jobrun.run(held_out, Pipeline.INFER, jobrun.inputs_of(held_out, images),
                          out / "registry", ModelRef(MODEL, "latest"),
                          {"threshold": 0.5, "min_object_area": 0}, name="infer",
                          kind="inference")  # fmt: skip
    assert inferred.returncode == 0, "inference failed"
    truths = [decode((truth_dir / p.name).read_bytes()) > 0.5 for p in images]
    pictures = [decode(p.read_bytes()) for p in images]
    masks = [decode((held_out / "results" / "masks" / "images" / p.name).read_bytes()) > 0.5
             for p in images]  # fmt: skip
    unet = scores(masks, truths)
    side, *baseline = otsu(pictures, truths)
    with open(training / "results" / "training" / "metrics.csv", newline="") as handle:
        epochs = len(list(csv.DictReader(handle)))
    print(f"training: {args.train} images {args.size}², {epochs} epochs, "
          f"{trained.summary['wall_time_s']:.0f} s; model {model['name']} v{model['version']} "
          f"val_dice {model['metrics']['val_dice']:.4f}")  # fmt: skip
    print(f"held-out set: {args.test} images {args.size}² (seed 200)")
    print(f"U-Net  pixel Dice {unet[0]:.4f}   mean per-image Dice {unet[1]:.4f}")
    print(f"Otsu ({side} side) pixel Dice {baseline[0]:.4f}   "
          f"mean per-image Dice {baseline[1]:.4f}")  # fmt: skip
    print(f"U-Net minus Otsu (pixel Dice): {unet[0] - baseline[0]:+.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
