"""Replay drop scenarios against the real daemon loop.

A scenario is a list of timed file operations on a real drop root: folders made, images copied
slowly, manifests written last or first, edited, broken, links planted. The driver runs the
real service (watcher, SQLite store, local executor running the real pipelines) in this
process, performs each operation at its time, ticks the loop, and stops when the daemon is
quiet. Tests then assert on the store, the outputs, the status files and the logged events.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from daemon.cli import manifest_writer
from daemon.core.manifest import MANIFEST_NAME
from daemon.core.manifest_schema import Kind
from daemon.executors import Executor, make_executor
from daemon.loop.factory import build_service
from daemon.loop.service import Service
from daemon.site.config import Config


@dataclass(frozen=True, order=True)
class Step:
    """One file operation, ``at`` seconds after the replay starts."""

    at: float
    label: str = field(compare=False)
    do: Callable[[], None] = field(compare=False, repr=False)


def at(seconds: float, label: str, do: Callable[[], None]) -> Step:
    return Step(seconds, label, do)


def copy_slowly(source: Path, target: Path, start: float, pause: float) -> list[Step]:
    """Copy every file of ``source`` into ``target``, one file each ``pause`` seconds, the
    manifest (if any) last, each file written in two halves (a moment where it is short)."""
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    steps = [at(start, f"mkdir {target.name}", lambda: target.mkdir(parents=True, exist_ok=True))]
    for i, path in enumerate(files):
        relative = path.relative_to(source)
        steps += write_in_halves(
            target / relative, path.read_bytes(), start + (i + 1) * pause, pause / 2
        )
    manifest = source / MANIFEST_NAME
    if manifest.exists():
        steps.append(
            write_atomically(
                target / MANIFEST_NAME, manifest.read_bytes(), start + (len(files) + 1) * pause
            )
        )
    return steps


def write_in_halves(path: Path, data: bytes, start: float, gap: float) -> list[Step]:
    half = len(data) // 2

    def first() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[:half])

    def second() -> None:
        with open(path, "ab") as handle:
            handle.write(data[half:])

    return [
        at(start, f"write half of {path.name}", first),
        at(start + gap, f"finish {path.name}", second),
    ]


def write_atomically(path: Path, data: bytes, when: float) -> Step:
    def do() -> None:
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    return at(when, f"rename {path.name} into place", do)


def write_now(path: Path, data: bytes, when: float) -> Step:
    return at(when, f"write {path.name}", lambda: path.write_bytes(data))


def manifest_text(folder: Path, kind: Kind = Kind.INFERENCE, **options: object) -> bytes:
    """A correct manifest for a folder, as ``watchctl manifest`` would write it."""
    request = manifest_writer.ManifestRequest(
        folder=folder,
        kind=kind,
        model=str(options.pop("model", "spheroid-unet")),
        owner=str(options.pop("owner", "Replay Tester")),
        email=options.pop("email", "tester@example.org"),  # type: ignore[arg-type]
        masks="masks" if kind.trains else None,
        **options,  # type: ignore[arg-type]
    )
    return manifest_writer.build(request).encode()


class Replay:
    """Runs the real service in this process while performing a scenario's steps."""

    def __init__(self, config: Config, executor: Executor | None = None) -> None:
        self.config = config
        self.service = build_service(config, executor or make_executor(config, os.environ))
        self.started = False

    def __enter__(self) -> Replay:
        self.service.start()
        self.started = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started:
            self.service.shutdown()

    def run(
        self,
        steps: Iterable[Step] = (),
        *,
        until: Callable[[Service], bool] | None = None,
        timeout: float = 120.0,
        tick: float = 0.05,
        quiet_seconds: float | None = None,
    ) -> float:
        """Perform the steps on time and tick until they are done and ``until`` holds (default:
        the daemon has been idle for ``quiet_seconds``, long enough for the watcher's last
        events to arrive). Returns the seconds it took."""
        pending = sorted(steps)
        start = time.monotonic()
        poll = max(r.poll_seconds for r in self.config.roots)
        quiet = quiet_seconds if quiet_seconds is not None else max(1.0, 3 * poll)
        done = until or (lambda service: service.idle())
        quiet_since: float | None = None
        while True:
            elapsed = time.monotonic() - start
            while pending and pending[0].at <= elapsed:
                pending.pop(0).do()
                quiet_since = None
            self.service.tick(time.time())
            if pending or not done(self.service):
                quiet_since = None
            elif until is not None:
                return elapsed
            elif quiet_since is None:
                quiet_since = elapsed
            elif elapsed - quiet_since >= quiet:
                return elapsed
            if elapsed > timeout:
                raise TimeoutError(
                    f"scenario not finished after {timeout} s; steps left: {pending}"
                )
            time.sleep(tick)


def stage(synth_batch: Callable[[Path], Sequence[Path]], where: Path) -> Path:
    """Generate a batch into a staging folder (outside the drop root) and return it."""
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    synth_batch(where)
    return where
