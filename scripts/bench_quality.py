"""Object-level quality benchmark: the old training and post-processing against the new.

One run trains two models with the real training job on the same synthetic batch (the
generator's defaults, ``scripts/synth.py``; ground-truth masks with each spheroid's id):

- old: today's training before this work (random flips only) and objects = the mask's
  connected components (``split_neck = 0``);
- new: the default augmentations (flips and quarter turns, intensity, gamma, blur, noise,
  vignetting) and touching objects cut apart (``split_neck`` at its default).

Each model then segments three held-out inference batches with the real inference job (objects
of fewer than 20 pixels dropped, ``min_object_area``, for both), and the real report job scores
its objects against the ground truth (masks beside the images: the report's "Against the
ground truth"):

- in distribution: the generator's defaults, another seed;
- shifted: the same scenes under another microscope (``--illumination``, ``--noise``,
  ``--contrast`` of the generator);
- touching: every image's spheroids two in contact (``--touching 1``).

Printed per model and set: F1 at IoU 0.5, count error (Σ|found − true| / true), mean matched
IoU and pixel Dice (from the report's summary.json), and on the touching set the share of
touching pairs found as two objects (each matched by one of its own; :mod:`pipelines.quality`).

    python scripts/bench_quality.py [--out /tmp/watchd-bench] [--train 160] [--test 64]
        [--size 96] [--epochs 25] [--width 8] [--models EARLIER/quality/registry]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth
from microscope import Look

from daemon.contract.jobspec import ModelRef, Pipeline
from daemon.contract.names import AUGMENT, INFERENCE
from models.catalog import resolve
from pipelines.images import decode
from pipelines.instances import components, label_objects
from pipelines.quality import pairs_apart, truth_objects

BASE = {"batch_size": 8, "learning_rate": 0.003, "val_fraction": 0.15, "seed": 0, "depth": 3,
        "width": 8, "patience": 8}  # fmt: skip
# today's training before this work: random flips, nothing else
OLD_AUGMENT = {name: (name == "augment_flips") if isinstance(value, bool) else 0.0
               for name, value in vars(AUGMENT).items()}  # fmt: skip
MODELS = {
    "old": ({**BASE, **OLD_AUGMENT}, {"split_neck": 0.0}),
    "new": (dict(BASE), {"split_neck": INFERENCE.split_neck}),
}
MIN_AREA = 20  # pixels: specks the net leaves under noise are not spheroids (old and new alike)
SHIFT = Look(illumination=0.35, noise=0.04, contrast=0.6)
SETS = {"in distribution": (200, Look()), "shifted": (200, SHIFT),
        "touching": (300, Look(touching=1.0))}  # fmt: skip
TARGETS = ("in distribution: F1 >= 0.95, count error <= 3 %; shifted: Dice >= 0.90, F1 >= 0.90; "
           "touching pairs split >= 90 %")  # fmt: skip


def train(out: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Both models, trained on one batch (the generator's defaults), each in a copy of it with
    its report; their model cards."""
    source = out / "training"
    synth.make_batch(source, "training", args.train, args.size, seed=100, labels=True)
    cards = {}
    for name, (params, _) in MODELS.items():
        batch = out / f"training-{name}"
        shutil.copytree(source, batch)
        inputs = jobrun.inputs_of(batch, sorted(batch.rglob("*.png")))
        model = ModelRef(f"quality-{name}")
        params = {**params, "epochs": args.epochs, "width": args.width}
        done = jobrun.run(batch, Pipeline.TRAIN, inputs, out / "registry", model, params,
                          name=f"train-{name}", kind="training")  # fmt: skip
        assert done.returncode == 0, f"training {name} failed"
        reported = jobrun.run(batch, Pipeline.REPORT, inputs, out / "registry", model, params,
                              name="report", kind="training")  # fmt: skip
        assert reported.returncode == 0, f"the report of training {name} failed"
        cards[name] = {**done.summary["model"], "wall_s": done.wall_s,
                       "epochs_run": done.summary["epochs_run"]}  # fmt: skip
        print(f"trained {name}: {cards[name]['epochs_run']} epochs in {done.wall_s:.0f} s; "
              f"validation Dice {cards[name]['metrics']['val_dice']:.4f}, objects F1 "
              f"{cards[name]['metrics']['val_object_f1']:.4f}", flush=True)  # fmt: skip
    return cards


def earlier(out: Path, registry: Path) -> dict[str, dict[str, Any]]:
    """The models an earlier run trained (``--models``: its registry, copied), not trained
    again: training is seeded, so the same arguments train the same weights."""
    shutil.copytree(registry, out / "registry")
    cards = {}
    for name in MODELS:
        found = resolve(out / "registry", f"quality-{name}", "latest")
        cards[name] = {"version": found.version, "sha256": found.sha256}
        print(f"{name}: version {found.version} of {registry} (sha256 {found.sha256[:12]}), "
              "not trained again", flush=True)  # fmt: skip
    return cards


def held_out(out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The three inference sets, images and masks (ids), each written once."""
    sets = {}
    for name, (seed, look) in SETS.items():
        folder = out / "sets" / name.replace(" ", "-")
        synth.make_batch(folder, "inference", args.test, args.size, seed=seed,
                         truth_dir=folder / "masks", look=look, labels=True)  # fmt: skip
        sets[name] = folder
    return sets


def on_the_truth(sets: dict[str, Path]) -> str:
    """The object step alone, on the true masks (as if the net were perfect): touching pairs
    it finds as two, lone spheroids it cuts."""
    pairs = apart = lone = cut = images = 0
    seconds = 0.0
    for name, folder in sets.items():
        for mask in sorted((folder / "masks").glob("*.png")):
            truth = truth_objects(decode(mask.read_bytes()))
            drawn = (truth > 0).astype("float32")
            started = time.perf_counter()
            found = label_objects(drawn, 0.5, MIN_AREA, INFERENCE.split_neck)
            seconds += time.perf_counter() - started
            images += 1
            if name == "touching":
                counted = pairs_apart(truth, found)
                pairs, apart = pairs + counted[0], apart + counted[1]
            elif name == "in distribution":
                lone += int(truth.max())
                cut += max(int(found.max()) - int(truth.max()), 0)
    return (f"the object step alone on the true masks: {apart}/{pairs} touching pairs found as "
            f"two; {cut} extra objects cut from {lone} spheroids not in contact; "
            f"{1000 * seconds / max(images, 1):.1f} ms an image")  # fmt: skip


def evaluate(out: Path, source: Path, model: str, infer: dict[str, Any]) -> dict[str, Any]:
    """One model on one set: the real inference and report jobs, in a copy of the set."""
    batch = out / "runs" / f"{source.name}-{model}"
    shutil.rmtree(batch, ignore_errors=True)
    shutil.copytree(source, batch)
    files = sorted(p for p in batch.rglob("*.png"))
    inputs = jobrun.inputs_of(batch, files)
    params = {"threshold": 0.5, "min_object_area": MIN_AREA, **infer}
    started = time.perf_counter()
    for pipeline, name in ((Pipeline.INFER, "infer"), (Pipeline.REPORT, "report")):
        done = jobrun.run(batch, pipeline, inputs, out / "registry",
                          ModelRef(f"quality-{model}", "latest"), params, name=name,
                          kind="inference")  # fmt: skip
        assert done.returncode == 0, f"{pipeline.value} of {model} on {source.name} failed"
    summary = json.loads((batch / "results" / "summary.json").read_text())
    figures = dict(summary["inference"]["ground_truth"])
    figures["seconds"] = time.perf_counter() - started
    pairs = apart = 0
    for image in sorted((batch / "images").glob("*.png")):
        truth = truth_objects(decode((batch / "masks" / image.name).read_bytes()))
        found = components(decode((batch / "results" / "masks" / "images" /
                                   image.name).read_bytes()) > 0.5, 0)  # fmt: skip
        counted = pairs_apart(truth, found)
        pairs, apart = pairs + counted[0], apart + counted[1]
    figures["pairs"], figures["apart"] = pairs, apart
    return figures


def row(set_name: str, model: str, f: dict[str, Any]) -> str:
    split = f"{f['apart']}/{f['pairs']} = {f['apart'] / f['pairs']:.1%}" if f["pairs"] else "–"
    iou = "–" if f["mean_matched_iou"] is None else f"{f['mean_matched_iou']:.4f}"
    return (f"{set_name:<16} {model:<4} {f['f1_50']:>7.4f} {f['count_error']:>10.1%} "
            f"{iou:>8} {f['dice']:>7.4f} {f['objects_true']:>5} {f['objects_found']:>6}  "
            f"{split}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--train", type=int, default=160, help="training images")
    parser.add_argument("--test", type=int, default=64, help="images of each held-out set")
    parser.add_argument("--size", type=int, default=96, help="image side, pixels")
    parser.add_argument("--epochs", type=int, default=25, help="at most (early stopping)")
    parser.add_argument("--width", type=int, default=BASE["width"], help="U-Net's first level")
    parser.add_argument("--models", type=Path, help="an earlier run's OUT/quality/registry: "
                        "evaluate its two models instead of training them")  # fmt: skip
    args = parser.parse_args()
    out = args.out / "quality"
    shutil.rmtree(out, ignore_errors=True)
    print(f"load before: {os.getloadavg()[0]:.2f} (1 min); {os.cpu_count()} cores", flush=True)
    print(f"training: {args.train} images {args.size}² of the generator's defaults (seed 100), "
          f"U-Net depth {BASE['depth']} width {args.width}, batch {BASE['batch_size']}, "
          f"up to {args.epochs} epochs (patience {BASE['patience']})", flush=True)  # fmt: skip
    started = time.perf_counter()
    cards = earlier(out, args.models) if args.models else train(out, args)
    sets = held_out(out, args)
    print(f"held out: {args.test} images {args.size}² per set; shifted = {SHIFT}", flush=True)
    print(on_the_truth(sets), flush=True)
    results = {(s, m): evaluate(out, folder, m, MODELS[m][1])
               for s, folder in sets.items() for m in MODELS}  # fmt: skip
    print(f"{'set':<16} {'':<4} {'F1@0.5':>7} {'count err':>10} {'mIoU':>8} {'Dice':>7} "
          f"{'true':>5} {'found':>6}  touching pairs split")  # fmt: skip
    for (set_name, model), figures in results.items():
        print(row(set_name, model, figures))
    print(f"targets (new): {TARGETS}")
    new = {s: results[(s, "new")] for s in SETS}
    met = (new["in distribution"]["f1_50"] >= 0.95
           and new["in distribution"]["count_error"] <= 0.03
           and new["shifted"]["dice"] >= 0.90 and new["shifted"]["f1_50"] >= 0.90
           and new["touching"]["apart"] >= 0.9 * new["touching"]["pairs"])  # fmt: skip
    print(f"new meets every target: {'yes' if met else 'no'}")
    made = ", ".join(f"{k} v{c['version']} sha256 {c['sha256'][:12]}" for k, c in cards.items())
    print(f"models: {made}")
    print(f"whole run {time.perf_counter() - started:.0f} s; load after: "
          f"{os.getloadavg()[0]:.2f} (1 min)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
