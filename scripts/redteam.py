"""The red team's findings of issue 25, replayed against a checkout of watchd: what each does to
that checkout's daemon and jobs, found from outside (the outputs, the status file, the
database, the daemon's exit status).

    python scripts/redteam.py                        # this checkout
    python scripts/redteam.py --repo ../old-watchd   # another one (e.g. a worktree of 535e6a6)

Each checkout runs as its own `watchd run` (its code first on PYTHONPATH, this environment's
packages), on a fresh drop root, database and copy of a tiny model, as root. A secret file with
a random token stands for a file only the service may read. The findings:

1. previews: an inference batch whose owner plants ``results/<run>/training/{model.json,
   metrics.csv,previews/index.json}``, the index naming the secret by its absolute path;
2. shard table: ``results/<run>/parts/table-9999.csv``, a link to the secret (batch 2);
3. FIFO: ``results/<run>/parts/table-9998.csv``, a FIFO (batch 3, the last: it may hang);
5. lease: the drop root's ``.watchd-lease.json`` replaced by one naming another host, renewed
   in the far future; then a second start.

Printed: for each finding, the batch's end (or the daemon's) and whether the token appears,
plain or base64, in any output, the status file or a database row. Findings 4 (a spec swapped
in the window before its job reads it) and 7 (a planted sweep winner) need a race or a sweep:
the tests (docs/bad-input.md) hold them.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fault_campaign
import synth
import tomli_w
from replay import manifest_text

from daemon.core.manifest_schema import Kind

HERE = Path(__file__).resolve().parent.parent
LAUNCH = "import sys; from daemon.watchd import watchd_main; sys.argv[0] = 'watchd'; watchd_main()"


def config(base: Path, repo: Path, registry: Path) -> Path:
    daemon = {"state_dir": str(base / "state"), "tick_seconds": 0.1, "heartbeat_seconds": 0.5,
              "rescan_seconds": 2.0, "lease_seconds": 2.0, "shutdown_grace_seconds": 5}  # fmt: skip
    if "spool_dir" in (repo / "daemon" / "site" / "config.py").read_text():
        daemon["spool_dir"] = str(base / "spool")
    document = {
        "daemon": daemon,
        "roots": [{"path": str(base / "drop"), "observer": "inotify"}],
        "intake": {"settle_seconds": 0.3, "timeout_seconds": 120, "check_seconds": 0.2},
        "planner": {"shard_size": 8},
        "executor": {"local": {"max_parallel": 1}},
        "registry": {"path": str(registry)},
        "jobs": {"wandb_mode": "disabled"},
    }
    path = base / "config.toml"
    path.write_text(tomli_w.dumps(document))
    return path


def start(repo: Path, path: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(repo), "WANDB_MODE": "disabled"}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", LAUNCH, "run", "--config", str(path)],
                                cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def rows(database: Path, query: str) -> list[tuple[object, ...]]:
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5) as db:
            return db.execute(query).fetchall()
    except sqlite3.Error:
        return []


def state_of(database: Path, folder: str) -> tuple[str, str] | None:
    found = rows(database, f"SELECT state, reason FROM batches WHERE folder = '{folder}' "
                           "ORDER BY id DESC LIMIT 1")  # fmt: skip
    return (str(found[0][0]), str(found[0][1])) if found else None


def wait(seconds: float, ready: object) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return True
        time.sleep(0.25)
    return False


def held_back_batch(drop: Path, name: str, staging: Path) -> tuple[Path, Path, bytes]:
    """The batch copied in without its last image (it waits; its run folder is made)."""
    folder = drop / name
    shutil.copytree(staging, folder)
    last = sorted((folder / "images").iterdir())[-1]
    data = last.read_bytes()
    last.unlink()
    return folder, last, data


def plant(run: Path, secret: Path, finding: int) -> None:
    if finding in (2, 3):
        (run / "parts").mkdir(exist_ok=True)
    if finding == 2:
        (run / "parts" / "table-9999.csv").symlink_to(secret)
    if finding == 3:
        os.mkfifo(run / "parts" / "table-9998.csv")
    if finding != 1:
        return
    previews = run / "training" / "previews"
    previews.mkdir(parents=True)
    card = {"name": "x", "version": 1, "sha256": "0" * 64, "path": "/x", "aliases": {},
            "metrics": {"val_dice": 0.5, "val_iou": 0.5, "epoch": 1}}  # fmt: skip
    (run / "training" / "model.json").write_text(json.dumps(card))
    (run / "training" / "metrics.csv").write_text(
        "epoch,train_loss,val_loss,val_dice,val_iou\n1,0.5,0.5,0.5,0.5\n"
    )
    (previews / "index.json").write_text(json.dumps({"previews": [{"file": str(secret)}]}))


def forms(token: str) -> list[bytes]:
    """The token as bytes, and as it reads inside base64 at each of the three alignments (the
    red team's report embedded the secret as a base64 "PNG"): the groups of four characters
    that hold only the token's bytes."""
    found = [token.encode()]
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + token.encode())
        found.append(encoded[4 if pad else 0 : -4])
    return found


def leaked(token: str, base: Path, database: Path) -> list[str]:
    """Where the token shows, plain or base64: files under the drop root and the spool,
    database rows."""
    found, shapes = [], forms(token)
    for tree in (base / "drop", base / "spool"):
        for path in tree.rglob("*") if tree.exists() else ():
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                if any(shape in data for shape in shapes):
                    found.append(str(path.relative_to(base)))
    for (table,) in rows(database, "SELECT name FROM sqlite_master WHERE type = 'table'"):
        for row in rows(database, f"SELECT * FROM {table}"):
            if token in json.dumps(row, default=str):
                found.append(f"database table {table}")
                break
    return sorted(set(found))


def findings(repo: Path, base: Path, registry: Path) -> list[str]:
    token = f"SECRET-{secrets.token_hex(8)}"
    secret = base / "service-only" / "secret.txt"
    secret.parent.mkdir(parents=True)
    secret.write_text(f"{token}\n")
    secret.chmod(0o600)
    (base / "drop").mkdir()
    path = config(base, repo, registry)
    database = base / "state" / "watchd.sqlite"
    staging = base / "staging"
    synth.make_batch(staging, "inference", count=3, size=64, seed=7)
    (staging / "manifest.toml").write_bytes(
        manifest_text(staging, Kind.INFERENCE, model="spheroid-unet", version="latest")
    )
    said = []
    daemon = start(repo, path, base / "daemon.log")
    try:
        for finding, what in ((1, "previews index"), (2, "shard table a link"),
                              (3, "shard table a FIFO")):
            name = f"plate-{finding}"
            folder, last, data = held_back_batch(base / "drop", name, staging)
            made = wait(60, lambda f=folder: any((f / "results").glob("*/")))
            run = next((folder / "results").glob("*/")) if made else folder / "results" / "x"
            plant(run, secret, finding)
            last.write_bytes(data)
            ended = wait(180, lambda n=name: (state_of(database, n) or ("",))[0]
                         in ("done", "failed", "cancelled"))  # fmt: skip
            end = state_of(database, name) if ended else ("not ended in 180 s", "")
            said.append(f"finding {finding} ({what}): batch {end[0]}: {end[1][:150]}")
            shown = [p for p in leaked(token, base, database) if name in p or "database" in p]
            said.append(f"  the token in: {shown or 'nothing'}")
        lease = {"host": "gw-forged", "pid": 4242, "start_ticks": 1, "renewed_at": 1e12,
                 "database": "/elsewhere/watchd.sqlite", "root": str(base / "drop")}  # fmt: skip
        (base / "drop" / ".watchd-lease.json").write_text(json.dumps(lease))
        stopped = wait(20, lambda: daemon.poll() is not None)
        code = daemon.poll()
        said.append("finding 5 (forged lease): the daemon "
                    + (f"exited with status {code}" if stopped else "kept running (20 s)"))
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    again = subprocess.run([sys.executable, "-c", LAUNCH, "run", "--config", str(path)],
                           cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                           capture_output=True, text=True, timeout=30)  \
        if stopped else None  # fmt: skip
    if again is not None:
        said.append(f"  started again: exit {again.returncode}: "
                    f"{(again.stderr.strip().splitlines() or [''])[-1][:160]}")
    left = outliving(base)
    said.append(f"jobs still running after the daemon stopped: {len(left) or 'none'}"
                + "".join(f"\n  {line} (killed now)" for line in left))  # fmt: skip
    return said


def outliving(base: Path) -> list[str]:
    """Processes still at work on this run's folders (a job blocked for ever outlives its
    daemon), killed; their command lines."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and str(base) in line:
            found.append(line.strip()[:160])
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="watchd-redteam-"))
    try:
        (base / "seed").mkdir()
        registry = fault_campaign.train_seed_model(base / "seed")
        work = base / "case"
        work.mkdir()
        for line in findings(args.repo.resolve(), work, registry):
            print(line, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
