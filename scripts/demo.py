"""The demo: watchd end to end on the embedded default (local executor, SQLite, config.toml).

Starts `watchd run --config config.toml`, drops a synthetic training batch (DMA-like images
with ground-truth masks) into the drop root the way an expert would (images first, then
`watchctl manifest`), waits for the model to be trained and registered, drops an inference
batch that uses it, and prints where the masks, table, report and status file are, how good
the masks are against the generator's ground truth, and `watchctl status`. Exits 0 when both
batches succeeded.
"""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import synth
from PIL import Image

from daemon.core.records import Batch
from daemon.core.states import BatchState
from daemon.site.config import Config, load_config
from daemon.store import Store

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TRAINING = ["--param", "epochs=25", "--param", "patience=6", "--param", "learning_rate=0.003"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "config.toml")
    parser.add_argument("--images", type=int, default=64, help="training images (128 x 128)")
    args = parser.parse_args()
    config = load_config(args.config)
    root = config.roots[0].path
    root.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    log = config.daemon.state_dir / f"demo-{stamp}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"watchd demo: drop root {root}, daemon log {log}")
    daemon = start_daemon(config, log)
    clock = time.monotonic()
    try:
        training = drop(root / f"demo-training {stamp}", "training", args.images, 11)
        trained = follow(config, training, clock, daemon)
        if trained is None or trained.state is not BatchState.DONE:
            return finish(config, daemon, [trained], log)
        truth = config.daemon.state_dir / f"demo-truth-{stamp}"
        inference = drop(root / f"demo-inference {stamp}", "inference", 32, 12, truth)
        inferred = follow(config, inference, clock, daemon)
        batches = [trained, inferred]
        if inferred is not None and inferred.state is BatchState.DONE:
            print_outputs(trained, inferred, truth)
        return finish(config, daemon, batches, log)
    except KeyboardInterrupt:
        return finish(config, daemon, [], log)


def start_daemon(config: Config, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [str(BIN / "watchd"), "run", "--config", str(config.source)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def drop(folder: Path, kind: str, count: int, seed: int, truth: Path | None = None) -> Path:
    """Copy images in, then write the manifest last with the expert's helper."""
    synth.make_batch(folder, kind, count=count, size=128, seed=seed, truth_dir=truth)
    command = [str(BIN / "watchctl"), "manifest", str(folder), "--kind", kind,
               "--model", "spheroid-unet", "--owner", "Demo Expert", "--email", "demo@example.org",
               "--title", f"demo {kind}"]  # fmt: skip
    command += TRAINING if kind == "training" else ["--version", "latest"]
    subprocess.run(command, check=True, capture_output=True)
    print(f"dropped {kind} batch: {folder.name!r} ({count} images, manifest written last)")
    return folder


def follow(
    config: Config, folder: Path, clock: float, daemon: subprocess.Popen[bytes]
) -> Batch | None:
    """Print each state change of the folder's batch until it ends; the batch at its end."""
    shown = ""
    while daemon.poll() is None:
        batch = newest(config, folder)
        if batch is not None:
            line = progress(config, batch)
            if line != shown:
                print(f"  [{time.monotonic() - clock:6.1f} s] {line}", flush=True)
                shown = line
            if batch.state.terminal:
                return batch
        time.sleep(0.5)
    print(f"the daemon exited unexpectedly (status {daemon.returncode})")
    return None


def newest(config: Config, folder: Path) -> Batch | None:
    if not config.daemon.database.exists():
        return None
    store = Store(config.daemon.database)
    try:
        return store.latest_revision(str(folder.parent), folder.name)
    except Exception:  # the daemon may still be creating the schema
        return None
    finally:
        store.close()


def progress(config: Config, batch: Batch) -> str:
    store = Store(config.daemon.database)
    try:
        jobs = store.jobs([batch.id])
    finally:
        store.close()
    done = sum(1 for j in jobs if j.state.value == "succeeded")
    running = [j.name.split("-", 1)[1] for j in jobs if j.state.live]
    text = f"batch #{batch.id} {batch.kind.value}: {batch.state.value}"
    if jobs:
        text += f", {done}/{len(jobs)} jobs done" + (
            f", running {', '.join(running)}" if running else ""
        )
    return text + (f" ({batch.reason})" if batch.state.terminal else "")


def print_outputs(trained: Batch, inferred: Batch, truth: Path) -> None:
    run = Path(inferred.run_dir)
    print("\nOutputs of the inference batch (next to its inputs):")
    print(f"  masks:       {run / 'masks'}")
    print(f"  table:       {run / 'table.csv'}")
    print(f"  report:      {run / 'report.html'}")
    print(f"  summary:     {run / 'summary.json'}")
    print(f"  status file: {inferred.path / 'watchd-status.txt'}")
    print(f"  training report: {Path(trained.run_dir) / 'report.html'}")
    scores = [
        dice(mask, truth / mask.name) for mask in sorted((run / "masks" / "images").iterdir())
    ]
    print(f"  mask quality: mean Dice {np.mean(scores):.3f} against the generator's ground truth "
          f"({len(scores)} images)")  # fmt: skip


def dice(predicted: Path, expected: Path) -> float:
    a = np.asarray(Image.open(predicted)) > 0
    b = np.asarray(Image.open(expected)) > 0
    total = a.sum() + b.sum()
    return 1.0 if total == 0 else float(2 * (a & b).sum() / total)


def finish(
    config: Config, daemon: subprocess.Popen[bytes], batches: list[Batch | None], log: Path
) -> int:
    print("\n$ watchctl status")
    subprocess.run([str(BIN / "watchctl"), "status", "--config", str(config.source)], check=False)
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
    ok = len(batches) == 2 and all(b is not None and b.state is BatchState.DONE for b in batches)
    for batch in batches:
        if batch is not None and batch.state is not BatchState.DONE:
            print(f"\n{batch.path / 'watchd-status.txt'}:")
            print((batch.path / "watchd-status.txt").read_text())
    print("\ndemo " + ("succeeded: both batches done" if ok else f"FAILED: see {log}"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
