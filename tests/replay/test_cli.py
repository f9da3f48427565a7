"""watchd and watchctl as operators and experts run them: real subprocesses on a real database.
Expected errors are one `Error: …` line with exit status 1 and no traceback."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import synth

# At import, while "conftest" is this folder's (see test_badinput.py).
from conftest import MODEL, write_config
from replay import Replay

from daemon.contract.jobspec import Pipeline, Problem, Role
from daemon.core.manifest import parse_manifest
from daemon.core.manifest_schema import Kind
from daemon.core.records import NewBatch, NewJob
from daemon.core.states import BatchState
from daemon.site.config import Config
from daemon.store import Store

BIN = Path(sys.executable).parent


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=60
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def finished(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> Config:
    """A database holding one done batch and one failed batch; the daemon has stopped."""
    config = config_for()
    shutil.copytree(staged("ok", count=2), drop_root / "plate ok")
    (drop_root / "plate bad").mkdir()
    (drop_root / "plate bad" / "manifest.toml").write_text('watchd = 1\nkind = "guess"\n')
    with Replay(config) as replay:
        replay.run()
    return config


def test_status_reads_the_database_while_the_daemon_is_down(finished: Config) -> None:
    out = cli("watchctl", "status", "--config", str(finished.source)).stdout
    assert out.startswith("watchd: stopped at ")
    assert "batches: 0 waiting, 0 queued, 0 running, 1 done, 1 failed, 0 cancelled" in out
    assert "Last failures" in out and "plate bad" in out and "manifest refused" in out
    data = json.loads(cli("watchctl", "status", "--json", "--config", str(finished.source)).stdout)
    assert data["daemon"]["alive"] is False
    assert data["counts"] == {
        "waiting": 0,
        "queued": 0,
        "running": 0,
        "done": 1,
        "failed": 1,
        "cancelled": 0,
    }
    assert data["recent_failures"][0]["problems"][0].startswith(
        "manifest.toml, kind: Input should be"
    )


def test_status_says_running_from_a_fresh_heartbeat(config_for: Callable[..., Config]) -> None:
    config = config_for()
    with Replay(config):
        data = json.loads(
            cli("watchctl", "status", "--json", "--config", str(config.source)).stdout
        )
    assert data["daemon"]["alive"] is True and data["daemon"]["state"] == "running"
    assert data["daemon"]["info"]["roots"] == {str(config.roots[0].path): "inotify"}


def test_show_gives_one_batch_with_jobs_problems_and_history(finished: Config) -> None:
    store = Store(finished.daemon.database)
    done = next(b for b in store.batches() if b.state is BatchState.DONE)
    store.close()
    out = cli("watchctl", "show", str(done.id), "--config", str(finished.source)).stdout
    assert f"batch {done.id} " in out and "plate ok" in out and "all jobs succeeded" in out
    data = json.loads(
        cli("watchctl", "show", str(done.id), "--json", "--config", str(finished.source)).stdout
    )
    assert [j["state"] for j in data["jobs"]] == ["succeeded", "succeeded"]
    assert [h["to"] for h in data["history"] if h["job_id"] is None] == [
        "waiting",
        "queued",
        "running",
        "done",
    ]


HUGE = str(10**30)  # beyond SQLite's integers: no batch, not an OverflowError


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("show", "999"), "Error: no batch 999"),
        (("retry", "999"), "Error: no batch 999"),
        (("show", HUGE), f"Error: no batch {HUGE}"),
        (("retry", HUGE), f"Error: no batch {HUGE}"),
        (("cancel", HUGE), f"Error: no batch {HUGE}"),
        (("requeue", HUGE), f"Error: no batch {HUGE}"),
        (("jobs", HUGE), f"Error: no batch {HUGE}"),
        (("logs", HUGE), f"Error: no job {HUGE}"),
    ],
    ids=lambda v: "-".join(v)[:20] if isinstance(v, tuple) else "",
)
def test_expected_errors_are_one_line_and_exit_1(
    hostile: Config, args: tuple[str, ...], message: str
) -> None:
    done = cli("watchctl", *args, "--config", str(hostile.source), check=False)
    assert (done.returncode, done.stderr.strip(), done.stdout) == (1, message, "")


def test_a_missing_config_or_database_is_a_clear_error(tmp_path: Path) -> None:
    done = cli("watchctl", "status", "--config", str(tmp_path / "nope.toml"), check=False)
    assert done.returncode == 1
    assert (
        done.stderr.strip()
        == f"Error: {tmp_path / 'nope.toml'}: 1 problem(s)\n  - file not found".strip()
    )
    config = tmp_path / "c.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path}/state"\n[[roots]]\npath = "{tmp_path}/drop"\n')
    done = cli("watchctl", "status", "--config", str(config), check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"Error: no database at {tmp_path}/state/watchd.sqlite: has the daemon ever run with this config?"
    )
    # the file the daemon's first start has made, before its tables (or after it failed)
    (tmp_path / "state").mkdir()
    made = sqlite3.connect(tmp_path / "state" / "watchd.sqlite")
    made.execute("PRAGMA user_version = 0")
    made.close()
    done = cli("watchctl", "status", "--config", str(config), check=False)
    assert (done.returncode, done.stderr.strip()) == (1, (
        f"Error: the database at {tmp_path}/state/watchd.sqlite has no tables yet: the daemon "
        "is making them, or its first start failed (its log says why)"))  # fmt: skip


def test_an_invalid_config_lists_every_problem(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[daemon]\ntick_seconds = 0\nfoo = 1\n[[roots]]\npath = "d"\n')
    done = cli("watchd", "run", "--config", str(config), check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"Error: {config}: 2 problem(s)"
    assert lines[1] == "  - daemon.tick_seconds: Input should be greater than 0 (got 0)"
    assert lines[2].startswith("  - daemon.foo: unknown key 'foo' (valid keys: heartbeat_seconds,")


def test_cancel_and_retry_are_intents_the_daemon_applies(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for(intake={"settle_seconds": 30})  # the batch stays waiting
    shutil.copytree(staged(count=2), drop_root / "to cancel")
    with Replay(config) as replay:
        replay.run(until=lambda s: bool(s.store.active_batches()))
        out = cli("watchctl", "cancel", "1", "--config", str(config.source)).stdout
        assert out.strip().startswith("cancel of batch 1 recorded (intent 1)")
        replay.run(until=lambda s: s.store.batch(1).state is BatchState.CANCELLED)
        cli("watchctl", "retry", "1", "--config", str(config.source))
        replay.run(until=lambda s: s.store.batch(1).state is BatchState.WAITING)
        store = Store(config.daemon.database)
        intents = [(i.action.value, i.outcome) for i in [store.intent(1), store.intent(2)]]
        store.close()
    assert intents == [("cancel", "cancelled"), ("retry", "retry: waiting for inputs again")]


def test_manifest_writes_a_valid_manifest_atomically_and_never_overwrites_silently(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "annotated ä"
    synth.make_batch(folder, "training", count=3, size=32, seed=1)
    out = cli(
        "watchctl",
        "manifest",
        str(folder),
        "--kind",
        "training",
        "--model",
        "m1",
        "--owner",
        "Anna",
        "--email",
        "anna@example.org",
        "--param",
        "epochs=3",
    ).stdout
    assert out.strip() == f"wrote {folder / 'manifest.toml'}"
    manifest = parse_manifest((folder / "manifest.toml").read_bytes())
    assert manifest.params["epochs"] == 3 and len(manifest.files) == 6
    assert sum(f.role is Role.MASK for f in manifest.files) == 3
    assert all(f.sha256 and f.size for f in manifest.files)
    again = cli("watchctl", "manifest", str(folder), check=False)
    assert again.returncode == 1
    assert (
        again.stderr.strip()
        == f"Error: {folder / 'manifest.toml'} exists; pass --force to replace it (a new revision)"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = cli("watchctl", "manifest", str(empty), check=False)
    assert nothing.stderr.strip() == f"Error: {empty} holds no PNG or TIFF images"
    bad = cli("watchctl", "manifest", str(folder), "--force", "--param", "threshold=7", check=False)
    assert bad.returncode == 1
    assert bad.stderr.startswith(
        "Error: the manifest would not be valid: manifest.toml, params.threshold"
    )


def test_manifest_keeps_within_the_configured_limit_and_says_when_it_counts_instead(
    tmp_path: Path,
) -> None:
    """With --config, the daemon's intake.max_manifest_bytes bounds the manifest: a folder too
    large to list within it gets counted [[patterns]], with a note; without a configuration
    (none found from here), the daemon's default limit applies, said in a note, and every file
    is listed."""
    folder = tmp_path / "plate"
    synth.make_batch(folder, "inference", count=24, size=16, seed=1)
    config = tmp_path / "config.toml"
    config.write_text(f'[[roots]]\npath = "{tmp_path}/drop"\n\n[intake]\nmax_manifest_bytes = 2048\n')
    done = cli("watchctl", "manifest", str(folder), "--config", str(config))
    assert done.stdout.strip() == f"wrote {folder / 'manifest.toml'}"
    assert done.stderr.startswith("note: listing all 24 files would make the manifest larger")
    manifest = parse_manifest((folder / "manifest.toml").read_bytes(), max_bytes=2048)
    assert [(p.glob, p.count) for p in manifest.patterns] == [("images/[!.]*.png", 24)]
    elsewhere = {k: v for k, v in os.environ.items() if k != "WATCHD_CONFIG"}
    listed = subprocess.run(
        [str(BIN / "watchctl"), "manifest", str(folder), "--force"],
        capture_output=True, text=True, timeout=60, cwd=folder, env=elsewhere, check=True,
    )  # fmt: skip
    assert listed.stderr.startswith("note: no site configuration used (no config.toml here")
    assert len(parse_manifest((folder / "manifest.toml").read_bytes()).files) == 24


def test_manifest_notes_an_inference_model_the_registry_does_not_hold(
    config_for: Callable[..., Config], tmp_path: Path
) -> None:
    """The batch would fail at its first job; the expert hears it while writing the manifest.
    A note, not a refusal: the model may still be trained before the files are complete."""
    config = config_for()
    folder = tmp_path / "plate"
    synth.make_batch(folder, "inference", count=2, size=32, seed=1)
    ask = (
        "watchctl",
        "manifest",
        str(folder),
        "--kind",
        "inference",
        "--config",
        str(config.source),
    )
    unknown = cli(*ask, "--model", "no-such-model")
    assert unknown.stdout.strip() == f"wrote {folder / 'manifest.toml'}"
    assert unknown.stderr.startswith(
        f"note: no model named 'no-such-model' in the registry {config.registry.path} "
        f"(models there: {MODEL})"
    )
    known = cli(*ask, "--model", MODEL, "--force")
    assert known.stderr == ""


# -- owner-controlled text on the operator's screen ---------------------------------------------

# What an owner can put in a folder name or (before the manifest refused control characters) in
# a title or owner name: rich markup, emoji codes, terminal escapes, a forged line.
HOSTILE = "[/] [bold]x :warning: \x1b]0;owned\x07\x1b[2J\nState: DONE\u202e"


@pytest.fixture
def hostile(tmp_path: Path, drop_root: Path) -> Config:
    """A database holding one failed batch whose every owner-controlled value is hostile, with
    one job; written through the store as an older watchd could have."""
    config = write_config(tmp_path, drop_root, tmp_path / "registry")
    store = Store.open(config.daemon.database)
    new = NewBatch(
        root=str(config.roots[0].path), folder=f"plate {HOSTILE}", manifest_sha256="0" * 64,
        manifest_text="", manifest_stat="", kind=Kind.INFERENCE, title=HOSTILE, owner=HOSTILE,
        contact=None, run_dir=str(config.roots[0].path / "x" / "results" / "r"),
    )  # fmt: skip
    batch = store.create_batch(new, BatchState.WAITING, f"accepted {HOSTILE}", 1.0e9)
    job = NewJob("infer-0", Pipeline.INFER, 0, 0, 1, (), "local")
    store.create_jobs(batch.id, [job], 1.0e9)
    problem = Problem(f"files[0] '{HOSTILE}'", f"is missing {HOSTILE}", "copy it")
    store.transition_batch(batch.id, BatchState.FAILED, HOSTILE, 1.0e9 + 1, problems=[problem])
    store.close()
    return config


@pytest.mark.parametrize(
    "args", [("batches",), ("show", "1"), ("status",), ("jobs",), ("jobs", "1")], ids=" ".join
)
def test_owner_text_is_shown_literally_with_control_characters_escaped(
    hostile: Config, args: tuple[str, ...]
) -> None:
    done = cli("watchctl", *args, "--config", str(hostile.source))
    shown = done.stdout
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert "Traceback" not in done.stderr and "State: DONE" not in shown.splitlines()
    if args[0] != "jobs":
        assert "[/] [bold]x :warning: \\x1b]0;owned\\x07" in shown
        assert "\\nState: DONE\\u202e" in shown


@pytest.mark.parametrize("args", [("batches",), ("show", "1"), ("status",)], ids=" ".join)
def test_json_keeps_owner_text_exactly_and_escapes_it_as_json(
    hostile: Config, args: tuple[str, ...]
) -> None:
    out = cli("watchctl", *args, "--json", "--config", str(hostile.source)).stdout
    assert "\x1b" not in out and "\u202e" not in out
    data = json.loads(out)
    batch = {"batches": lambda d: d["batches"][0], "show": lambda d: d,
             "status": lambda d: d["recent_failures"][0]}[args[0]](data)  # fmt: skip
    assert (batch["owner"], batch["reason"], batch["folder"]) == (
        HOSTILE,
        HOSTILE,
        f"plate {HOSTILE}",
    )


def test_a_limit_beyond_any_count_is_a_usage_error(hostile: Config) -> None:
    done = cli("watchctl", "batches", "--limit", HUGE, "--config", str(hostile.source), check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1] == (
        "Error: Invalid value for '--limit': Input should be less than or equal to 1000000"
    )
