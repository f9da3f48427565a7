"""Forged files and leases (scripts/intruder.py makes them as the expert, the fuzz campaign as
the service): each names the canary wherever a reader would take a path, the trap folder
wherever it would take a folder, and carries MARKER, so that a forged file read anywhere shows
(scripts/invariants.py); a forged lease is none a daemon may honour.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import hostile

from daemon.contract.jobspec import InputFile, JobResult, JobSpec, ModelRef, Pipeline

MARKER = "watchd-fuzz-forged"  # in every forged file: found anywhere else, it was read
OLD_LEASE = ".watchd-lease.json"  # where a drop root's lease was before issue 25


def forged(name: str, outside: hostile.Outside, work: Path, job: str) -> bytes:
    """A file for ``name`` (its last part decides) that names the canary wherever a job would
    read a path and the trap folder wherever it would read a folder; MARKER in every one."""
    canary, trap, base = str(outside.canary), outside.trap, Path(name).name
    if base == "spec.json":
        return forged_spec(outside, work, job).encode()
    if base == "result.json":
        summary = {"note": MARKER, "file": canary, "elapsed_s": 1e308, "rows": [canary]}
        return (
            JobResult(ok=True, pipeline="infer", finished_at=MARKER, summary=summary)
            .to_json()
            .encode()
        )
    documents: dict[str, Any] = {
        "progress.json": {"done": 10**18, "total": -1, "note": MARKER},
        "launch.json": {"handle": "local:1:0", "pid": 1, "command": [MARKER, canary]},
        "candidate.json": {"metrics": {"val_dice": 1.0, "val_iou": 1.0, "val_loss": 0.0},
                           "params": {"trial": 0}, "training": {}, "sha256": "0" * 64,
                           "weights": canary, "note": MARKER},
        "index.json": {"previews": [{"file": canary, "dice": 1.0, "note": MARKER},
                                    {"file": f"../../../../{canary}", "dice": 0.5}]},
        "model.json": {"name": MARKER, "version": 99, "sha256": "0" * 64, "weights": canary,
                       "metrics": {"val_dice": 1.0}, "card": canary},
        "sweep.json": {"wandb_sweep_config": {}, "winner": MARKER, "trials": [canary]},
    }  # fmt: skip
    if base in documents:
        return json.dumps(documents[base]).encode()
    if base.endswith(".csv"):
        return f'"path","note"\n"{canary}","{MARKER}"\n'.encode()
    if base.endswith(".pt"):
        return b"PK\x03\x04" + MARKER.encode() + canary.encode()
    return f"{MARKER}: {canary} {trap}\n".encode()


def forged_spec(outside: hostile.Outside, work: Path, job: str) -> str:
    """The red team's spec: the batch folder "/", the run folder in the trap, the canary as
    the input; its work folder the real one, so that it names the job folder it would lie in."""
    trap = outside.trap
    return JobSpec(
        job_id=1, job_name=job, pipeline=Pipeline.INFER, attempt=1, batch_id=1,
        batch_revision=1, batch_kind="inference", batch_dir="/", run_dir=str(trap / "run"),
        work_dir=str(work), manifest_sha256="0" * 64,
        inputs=(InputFile(str(outside.canary).lstrip("/")),),
        model=ModelRef(MARKER), registry_dir=str(trap / "registry"), title=MARKER,
    ).to_json()  # fmt: skip


def lease_bytes(kind: str, root: str) -> bytes:
    """A forged lease of ``kind`` (hostile.LEASE_KINDS, but folder, link and FIFO): none is a
    lease a daemon may honour (a stale one it takes over)."""
    now = time.time()
    lease: dict[str, Any] = {"host": "elsewhere.example.org", "pid": 4242, "start_ticks": 1,
                             "database": "/var/lib/watchd/watchd.sqlite", "renewed_at": now,
                             "root": root}  # fmt: skip
    changes: dict[str, dict[str, Any]] = {
        "future": {"renewed_at": 1e12},
        "string": {"renewed_at": "soon"},
        "nan": {"renewed_at": float("nan")},
        "infinity": {"renewed_at": float("inf")},
        "negative-pid": {"pid": -5},
        "bool-pid": {"pid": True},
        "huge-pid-here": {"host": socket.gethostname(), "pid": 2**70},
        "other-root": {"root": root + " elsewhere"},
        "stale": {"renewed_at": now - 10**6},
    }
    if kind in changes:
        return json.dumps({**lease, **changes[kind]}).encode()
    others = {"list": json.dumps([lease]).encode(), "empty-object": b"{}",
              "not-json": bytes(range(256)), "nested": b"[" * 200_000,
              "huge": b" " * (8 << 20) + json.dumps(lease).encode()}  # fmt: skip
    return others[kind]


def forge_lease(path: Path, kind: str, root: str, canary: Path) -> None:
    """Put a forged lease of ``kind`` at ``path`` (renamed over what is there)."""
    fresh = path.with_name(".forged-" + path.name)
    clear(fresh)
    if kind == "folder":
        fresh.mkdir()
        (fresh / "lease.json").write_bytes(lease_bytes("future", root))
    elif kind == "link":
        os.symlink(canary, fresh)
    elif kind == "fifo":
        os.mkfifo(fresh)
    else:
        fresh.write_bytes(lease_bytes(kind, root))
    for _ in range(100):  # the daemon may renew its lease between the clear and the rename
        if kind == "folder" or is_folder(path):
            clear(path)  # a folder and a file do not rename over each other
        try:
            os.replace(fresh, path)
            return
        except OSError as error:
            if error.errno not in (errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise
    raise RuntimeError(f"could not forge {path}: something keeps writing there")


def clear(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if is_folder(path):
            shutil.rmtree(path)
        else:
            path.unlink()


def is_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()
