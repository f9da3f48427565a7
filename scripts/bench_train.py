"""Training overhead: the pipeline's seconds per epoch against a plain PyTorch loop's.

The pipeline is :func:`pipelines.fitting.fit`, what the training job runs: Lightning's Trainer
with the per-epoch recorder, early stopping, torchmetrics and the W&B logger (offline). The
plain loop trains the same U-Net with the same loaders, loss and optimiser and validates every
epoch (loss and Dice), with no framework. Both run in this invocation, interleaved,
``--rounds`` times; each figure is wall time (set-up included) divided by epochs. Medians and
their ratio are printed.

    python scripts/bench_train.py [--out /tmp/watchd-bench] [--images 64] [--epochs 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth

from models.unet import UNet, segmentation_loss
from pipelines import fitting
from pipelines.pairs import TrainingData, load_dataset
from pipelines.train import QUIET_WARNINGS

PARAMS = {"epochs": 4, "batch_size": 8, "learning_rate": 0.003, "val_fraction": 0.2, "seed": 0,
          "depth": 3, "width": 16, "patience": 100}  # fmt: skip


def plain(data: TrainingData, params: dict[str, Any]) -> tuple[float, float]:
    """Seconds and CPU-seconds per epoch of a hand-written loop (train, validate loss and Dice)."""
    started, cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(0)
    train, val = fitting.loaders(data, params)
    net = UNet(int(params["depth"]), int(params["width"]))
    optimiser = torch.optim.Adam(net.parameters(), lr=float(params["learning_rate"]))
    epochs = int(params["epochs"])
    for _ in range(epochs):
        net.train()
        for images, masks in train:
            optimiser.zero_grad()
            segmentation_loss(net(images), masks).backward()
            optimiser.step()
        net.eval()
        hits = total = 0.0
        with torch.no_grad():
            for images, masks in val:
                logits = net(images)
                segmentation_loss(logits, masks)
                predicted = logits > 0
                hits += float((predicted & (masks > 0.5)).sum())
                total += float(predicted.sum() + (masks > 0.5).sum())
        _ = 2 * hits / max(total, 1)
    return (time.perf_counter() - started) / epochs, (time.process_time() - cpu) / epochs


def pipeline(data: TrainingData, params: dict[str, Any], folder: Path) -> tuple[float, float]:
    """Seconds and CPU-seconds per epoch of the training job's fit (Trainer, callbacks,
    metrics, W&B offline; the W&B service process's own CPU time is not counted)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started, cpu = time.perf_counter(), time.process_time()
    logger = fitting.wandb_logger(folder, "bench", "bench", params, os.environ)
    _, recorder, _ = fitting.fit(data, params, folder / "metrics.csv", logger)
    if logger is not None:
        logger.experiment.finish()
    epochs = len(recorder.rows)
    return (time.perf_counter() - started) / epochs, (time.process_time() - cpu) / epochs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    torch.set_num_threads(args.cpus)
    batch_dir = args.out / "train-overhead"
    shutil.rmtree(batch_dir, ignore_errors=True)
    files = synth.make_batch(batch_dir, "training", args.images, args.size, seed=400)
    data = load_dataset(batch_dir, jobrun.inputs_of(batch_dir, files))
    params = {**PARAMS, "epochs": args.epochs}
    runs = [plain(data, params)]
    fits = []
    for round_ in range(args.rounds):
        fits.append(pipeline(data, params, batch_dir / f"fit-{round_}"))
        runs.append(plain(data, params))
    loop, lightning = [w for w, _ in runs], [w for w, _ in fits]
    loop_cpu, lightning_cpu = [c for _, c in runs], [c for _, c in fits]
    print(f"{args.images} images {args.size}², batch 8, U-Net depth 3 width 16, "
          f"{args.epochs} epochs per run, {args.cpus} threads")  # fmt: skip
    print("plain loop s/epoch per round: " + " ".join(f"{s:.2f}" for s in loop))
    print("pipeline   s/epoch per round: " + " ".join(f"{s:.2f}" for s in lightning))
    # Each pipeline run is bracketed by two plain runs: its ratio is against their mean.
    ratios = [p / ((a + b) / 2) for p, a, b in zip(lightning, loop, loop[1:], strict=False)]
    print("bracketed ratios per round:   " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"median of bracketed ratios {statistics.median(ratios):.3f} (target <= 1.10)")
    print("plain loop CPU-s/epoch:       " + " ".join(f"{s:.2f}" for s in loop_cpu))
    print("pipeline   CPU-s/epoch:       " + " ".join(f"{s:.2f}" for s in lightning_cpu))
    cpu_ratio = statistics.median(lightning_cpu) / statistics.median(loop_cpu)
    print(f"per CPU-second: ratio of medians {cpu_ratio:.3f}")
    ratio = statistics.median(lightning) / statistics.median(loop)
    print(f"median plain {statistics.median(loop):.2f} s/epoch, pipeline "
          f"{statistics.median(lightning):.2f} s/epoch, ratio {ratio:.3f} "
          "(ratio of medians)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
