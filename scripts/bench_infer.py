"""Inference efficiency: the real inference job's images/s against the bare model's forward pass.

End to end is the job's own per-image time (read and verify, decode, infer, threshold and
label, write the mask, statistics, ledger), measured inside ``python -m pipelines.infer`` on
the shard. The baseline is the same model's forward pass (channels-last, inference_mode, the
same batch size and threads) over the same images already decoded in memory. Both run in
this invocation, interleaved (each job run between two bare runs), ``--rounds`` times; the
median of the per-round ratios and the ratio of the medians are printed. Also
printed: forward-pass variants (memory layout, batch size) that decided the job's defaults.

    python scripts/bench_infer.py [--out /tmp/watchd-bench] [--images 96] [--size 256]

Uses the model bench_accuracy.py left in OUT/registry when there is one (else an untrained
net of the same shape: the timing is the same, the masks are noise).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jobrun
import synth

from daemon.contract.jobspec import ModelRef, Pipeline
from models import registry
from models.unet import UNet
from pipelines.images import decode
from pipelines.job import keep_freed_memory

MODEL = "bench-unet"


def model(out: Path) -> tuple[Path, UNet, str]:
    root = out / "registry"
    if not registry.list_versions(root, MODEL):
        root = out / "untrained-registry"
        shutil.rmtree(root, ignore_errors=True)
        torch.manual_seed(0)
        registry.register(root, MODEL, UNet(depth=3, width=16).state_dict(),
                          {"architecture": UNet(depth=3, width=16).architecture()})  # fmt: skip
        note = "untrained net (run bench_accuracy.py first for a trained one)"
    else:
        note = "trained by bench_accuracy.py"
    version = registry.resolve(root, MODEL, "latest")
    net = UNet(**version.architecture)
    net.load_state_dict(registry.load(version))
    return root, net.eval(), note


@torch.inference_mode()
def forward_rates(
    net: UNet, images: list[np.ndarray], batch: int, channels_last: bool
) -> tuple[float, float]:
    """Images per second and per CPU-second of the bare forward pass (plus sigmoid)."""
    layout = torch.channels_last if channels_last else torch.contiguous_format
    net = net.to(memory_format=layout)
    started, cpu = time.perf_counter(), time.process_time()
    for first in range(0, len(images), batch):
        stack = torch.from_numpy(np.stack(images[first : first + batch]))[:, None]
        torch.sigmoid(net(stack.contiguous(memory_format=layout)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return len(images) / wall, len(images) / cpu


def forward_rate(net: UNet, images: list[np.ndarray], batch: int, channels_last: bool) -> float:
    return forward_rates(net, images, batch, channels_last)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/watchd-bench"))
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.cpus)
    kept = keep_freed_memory()  # as the job does: a baseline not slowed by page faults
    root, net, note = model(args.out)
    batch_dir = args.out / "infer-efficiency"
    shutil.rmtree(batch_dir, ignore_errors=True)
    files = synth.make_batch(batch_dir, "inference", args.images, args.size, seed=300)
    images = [decode(p.read_bytes()) for p in files]
    inputs = jobrun.inputs_of(batch_dir, files, checksums=True)
    params = {"threshold": 0.5, "min_object_area": 16, "batch_size": 1}
    forward_rate(net, images[:4], 1, True)  # warm-up: the first calls allocate
    first = forward_rates(net, images, 1, True)
    bare, pipeline, walls = [first[0]], [], []
    bare_cpu, pipeline_cpu = [first[1]], []
    for _ in range(args.rounds):
        shutil.rmtree(batch_dir / "results", ignore_errors=True)  # else the ledger skips all
        job = jobrun.run(batch_dir, Pipeline.INFER, inputs, root, ModelRef(MODEL), params,
                         name="infer", kind="inference", cpus=args.cpus)  # fmt: skip
        assert job.returncode == 0, "inference failed"
        pipeline.append(1 / job.summary["seconds_per_image"])
        pipeline_cpu.append(1 / job.summary["cpu_seconds_per_image"])
        walls.append(job.wall_s)
        wall_rate, cpu_rate = forward_rates(net, images, 1, True)
        bare.append(wall_rate)
        bare_cpu.append(cpu_rate)
    print(
        f"model: {note}; {args.images} PNG images {args.size}², {args.cpus} threads; "
        f"freed memory kept (job and baseline): {'yes' if kept else 'no (not glibc)'}"
    )
    print("bare forward img/s per round:  " + " ".join(f"{r:.2f}" for r in bare))
    print("end-to-end img/s per round:    " + " ".join(f"{r:.2f}" for r in pipeline))
    print(f"job wall time incl. start-up (s): {' '.join(f'{w:.1f}' for w in walls)}")
    # Each job run is bracketed by two bare runs: its ratio is against their mean, so a load
    # change on this shared machine hits both sides of a ratio alike.
    ratios = [p / ((a + b) / 2) for p, a, b in zip(pipeline, bare, bare[1:], strict=False)]
    print("bracketed ratios per round:    " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"median of bracketed ratios {statistics.median(ratios):.3f} (target >= 0.90)")
    cpu_ratio = statistics.median(pipeline_cpu) / statistics.median(bare_cpu)
    print("bare forward img/CPU-s:        " + " ".join(f"{r:.2f}" for r in bare_cpu))
    print("end-to-end img/CPU-s:          " + " ".join(f"{r:.2f}" for r in pipeline_cpu))
    print(f"per CPU-second (job process and its loader worker): ratio of medians {cpu_ratio:.3f}")
    ratio = statistics.median(pipeline) / statistics.median(bare)
    print(f"median bare {statistics.median(bare):.2f} img/s, end-to-end "
          f"{statistics.median(pipeline):.2f} img/s, ratio {ratio:.3f} "
          "(ratio of medians)")  # fmt: skip
    print("forward variants (img/s, median of 3, interleaved):")
    variants: dict[tuple[int, bool], list[float]] = {(b, c): [] for b in (1, 4) for c in (0, 1)}
    for _ in range(3):
        for (b, cl), rates in variants.items():
            rates.append(forward_rate(net, images[:32], b, cl))
    for (b, cl), rates in variants.items():
        layout = "channels_last" if cl else "contiguous (NCHW)"
        print(f"  batch {b}, {layout}: {statistics.median(rates):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
