"""Memory per batch folder: does the daemon's RSS grow with the folders on the share?

The real service (in a child process, local executor, inotify, a catch-up scan every 2 s)
takes in --folders batch folders, --step at a time; each manifest is refused at once, so the
batches end at once and nothing but intake, the store and the watches costs memory. After each
step: the child's RSS and the number of batch folders it watches with inotify. Run twice, in
the same session: with ``intake.watch_ended_seconds`` so long that every folder stays watched
(the baseline: what watching every folder ever dropped costs) and with 0 (folders let go once
their batch ended). Printed: RSS growth per 1,000 folders after warm-up (the first --warmup
folders) in each, and their ratio.

    python scripts/bench_memory.py                    # 8,000 folders, 1,000 a step
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from replay import Replay
from soak import read_proc
from soak import write_config as soak_config

REFUSED = 'watchd = 1\nkind = "guess"\n'


def child(folders: int, step: int, linger: float) -> None:
    """Drop the folders and print one JSON line per step."""
    base = Path(tempfile.mkdtemp(prefix="watchd-mem-"))
    root = base / "drop"
    root.mkdir()
    config = soak_config(
        base, root, base / "registry", rescan_seconds=2.0, watch_ended_seconds=linger
    )
    with Replay(config) as replay:
        for start in range(0, folders, step):
            for i in range(start, start + step):
                folder = root / f"b{i:05d}"
                folder.mkdir()
                (folder / "manifest.toml").write_text(REFUSED)
            replay.run(timeout=600, tick=0.05)
            rss, _ = read_proc(os.getpid())
            watched = len(replay.service.watcher.watched_folders(root))
            print(json.dumps({"folders": start + step, "rss_mb": rss, "watched": watched}),
                  flush=True)  # fmt: skip


def measure(folders: int, step: int, linger: float) -> list[dict[str, float]]:
    command = [sys.executable, __file__, "--child", "--folders", str(folders),
               "--step", str(step), "--linger", str(linger)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), "."])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def growth_per_1000(rows: list[dict[str, float]], warmup: int) -> float:
    after = [r for r in rows if r["folders"] >= warmup]
    first, last = after[0], after[-1]
    return 1000 * (last["rss_mb"] - first["rss_mb"]) / (last["folders"] - first["folders"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--folders", type=int, default=8000)
    parser.add_argument("--step", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--linger", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.folders, args.step, args.linger)
        return
    started = time.monotonic()
    runs = {"every folder watched": 30 * 86400.0, "ended folders let go": 0.0}
    results = {name: measure(args.folders, args.step, linger) for name, linger in runs.items()}
    for name, rows in results.items():
        print(f"{name}:")
        for r in rows:
            print(f"  {r['folders']:6,.0f} folders  RSS {r['rss_mb']:6.1f} MB"
                  f"  watched {r['watched']:6,.0f}")  # fmt: skip
    base, now = (growth_per_1000(rows, args.warmup) for rows in results.values())
    print(
        f"RSS growth per 1,000 folders after {args.warmup:,}: every folder watched "
        f"{base:.2f} MB, ended folders let go {now:.2f} MB "
        f"(ratio {now / base if base else float('nan'):.2f}); {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
