"""watchctl, complete: finding batches and jobs, reading and following job logs, requeue, pausing
and resuming a drop root, and doctor, each as a real `watchctl` subprocess on a database a real
daemon run produced. Exit codes: 0 done, 1 `Error: …`, 2 usage, 3 doctor found a problem."""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import synth
import tomli_w

# At import, while "conftest" is this folder's (see test_badinput.py).
from conftest import MODEL, write_config
from replay import Replay, manifest_text
from test_cli import cli
from test_crash import start_daemon, wait_for

from daemon.cli.doctor import inotify_limits
from daemon.contract.spool import work_dir
from daemon.core.manifest import STATUS_NAME
from daemon.core.manifest_schema import Kind
from daemon.core.states import BatchState, JobState
from daemon.site.config import Config, load_config
from daemon.store import Store
from daemon.store.migrations import MIGRATIONS

IS_ROOT = os.geteuid() == 0
WATCHCTL = str(Path(sys.executable).parent / "watchctl")


def with_second_root(config: Config, second: Path) -> Config:
    """The same config with one more drop root."""
    document = tomllib.loads(config.source.read_text())
    document["roots"].append({**document["roots"][0], "path": str(second)})
    config.source.write_text(tomli_w.dumps(document))
    return load_config(config.source)


def stage(where: Path, count: int = 2, owner: str = "Replay Tester") -> Path:
    synth.make_batch(where, "inference", count=count, size=64, seed=7)
    (where / "manifest.toml").write_bytes(
        manifest_text(where, Kind.INFERENCE, model=MODEL, version="latest", owner=owner)
    )
    return where


def ctl_json(config: Config, *args: str) -> dict:
    return json.loads(cli("watchctl", *args, "--json", "--config", str(config.source)).stdout)


def fails(config: Config, *args: str) -> tuple[int, str, str]:
    done = cli("watchctl", *args, "--config", str(config.source), check=False)
    return done.returncode, done.stderr.strip(), done.stdout


# -- a history to read: two roots, two done batches, one failed ---------------------------------


@dataclass(frozen=True)
class History:
    config: Config
    roots: tuple[Path, Path]


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory, trained_registry: Path) -> History:
    base = tmp_path_factory.mktemp("watchctl")
    first, second = base / "drop röot 'q'", base / "second root"
    first.mkdir()
    second.mkdir()
    shutil.copytree(trained_registry, base / "registry")
    config = with_second_root(write_config(base, first, base / "registry"), second)
    stage(first / "plate A", owner="Anna Ärger")
    (first / "plate bad").mkdir()
    (first / "plate bad" / "manifest.toml").write_text('watchd = 1\nkind = "guess"\n')
    stage(second / "plate B", owner="Bob")
    with Replay(config) as replay:
        replay.run(timeout=120)
    return History(config, (first, second))


def test_batches_filter_by_state_owner_root_and_age_newest_first(history: History) -> None:
    config = history.config
    rows = ctl_json(config, "batches")["batches"]
    assert [r["id"] for r in rows] == sorted((r["id"] for r in rows), reverse=True)
    by_folder = {r["folder"]: r for r in rows}
    assert {f: r["state"] for f, r in by_folder.items()} == {
        "plate A": "done", "plate bad": "failed", "plate B": "done",
    }  # fmt: skip
    assert by_folder["plate A"]["jobs_done"] == by_folder["plate A"]["jobs_total"] == 2

    def folders(*args: str) -> set[str]:
        return {r["folder"] for r in ctl_json(config, "batches", *args)["batches"]}

    assert folders("--state", "failed") == {"plate bad"}
    assert folders("--state", "failed", "--state", "done") == {"plate A", "plate B", "plate bad"}
    assert folders("--owner", "ÄRGER") == {"plate A"}  # any case, beyond ASCII
    assert folders("--owner", "bo") == {"plate B"}
    assert folders("--root", "1") == {"plate B"}
    assert folders("--root", str(history.roots[0])) == {"plate A", "plate bad"}
    assert folders("--limit", "1") == {rows[0]["folder"]}
    assert folders("--since", "1h") == {"plate A", "plate B", "plate bad"}
    newest = max(r["created_at"] for r in rows)
    while time.time() - _epoch(newest) < 2.5:
        time.sleep(0.2)
    assert folders("--since", "2s") == set()
    out = cli("watchctl", "batches", "--config", str(config.source)).stdout
    assert out.startswith("Batches (newest first, at most 50)") and "plate B" in out
    none = cli("watchctl", "batches", "--since", "1s", "--config", str(config.source)).stdout
    assert none.strip() == "no batches match"


def _epoch(iso: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(iso).timestamp()


def test_bad_filters_are_usage_errors_or_one_line_errors(history: History) -> None:
    code, err, _ = fails(history.config, "batches", "--since", "2 fortnights")
    assert code == 2 and "Invalid value for '--since': '2 fortnights': expected an age" in err
    code, err, _ = fails(history.config, "batches", "--state", "asleep")
    assert code == 2 and "Invalid value for '--state'" in err
    first, second = history.roots
    assert fails(history.config, "batches", "--root", "/nowhere") == (
        1,
        f"Error: '/nowhere' is not a drop root of {history.config.source}"
        f" (its roots: [0] {first}, [1] {second})",
        "",
    )


def test_jobs_of_one_batch_or_of_all_by_state(history: History) -> None:
    config = history.config
    store = Store(config.daemon.database)
    plate_a = next(b for b in store.batches() if b.folder == "plate A")
    expected = [j.name for j in store.jobs([plate_a.id])]
    store.close()
    jobs = ctl_json(config, "jobs", str(plate_a.id))["jobs"]
    assert [j["name"] for j in jobs] == expected and len(expected) == 2  # one shard, the report
    assert {j["state"] for j in jobs} == {"succeeded"}
    everything = ctl_json(config, "jobs", "--state", "succeeded")["jobs"]
    assert len(everything) == 4 and {j["batch_id"] for j in everything} >= {plate_a.id}
    assert ctl_json(config, "jobs", "--state", "failed")["jobs"] == []
    assert len(ctl_json(config, "jobs", "--limit", "1")["jobs"]) == 1
    text = cli("watchctl", "jobs", str(plate_a.id), "--config", str(config.source)).stdout
    assert expected[0] in text and "succeeded" in text
    assert fails(config, "jobs", "999") == (1, "Error: no batch 999", "")


def test_logs_print_the_tail_of_a_jobs_log_by_id_or_name(history: History) -> None:
    config = history.config
    store = Store(config.daemon.database)
    batch = next(b for b in store.batches() if b.folder == "plate A")
    job = store.jobs([batch.id])[0]
    store.close()
    path = work_dir(config.daemon.spool_dir, batch.id, batch.run_dir) / "jobs" / job.name / "log.txt"
    whole = path.read_text().splitlines()
    copy = (Path(batch.run_dir) / "logs" / f"{job.name}.log").read_text().splitlines()
    assert copy == whole  # the owner's copy, in the batch folder
    assert len(whole) > 3
    by_name = cli("watchctl", "logs", job.name, "-n", "3", "--config", str(config.source))
    assert by_name.stdout.splitlines() == whole[-3:]
    data = ctl_json(config, "logs", str(job.id), "--lines", "1000")
    assert (data["job"]["name"], data["path"], data["lines"]) == (job.name, str(path), whole)
    assert fails(config, "logs", "999") == (1, "Error: no job 999", "")
    assert fails(config, "logs", "b999999-infer-0000") == (
        1, "Error: no job 'b999999-infer-0000'", "",
    )  # fmt: skip
    code, err, _ = fails(config, "logs", job.name, "--follow", "--json")
    assert code == 2 and "--follow prints lines as they come: leave out --json" in err


def test_status_lists_the_drop_roots_and_help_documents_the_exit_codes(history: History) -> None:
    roots = ctl_json(history.config, "status")["roots"]
    assert [(r["index"], r["path"], r["paused"]) for r in roots] == [
        (0, str(history.roots[0]), False),
        (1, str(history.roots[1]), False),
    ]
    text = cli("watchctl", "status", "--config", str(history.config.source)).stdout
    assert f"root 1: {history.roots[1]}" in text
    usage = " ".join(cli("watchctl", "--help").stdout.replace("│", " ").split())
    assert "Exit status: 0 done; 1 an error, printed as one line 'Error: …' on stderr;" in usage
    assert "3 watchctl doctor found a problem." in usage


# -- doctor -------------------------------------------------------------------------------------


def test_doctor_passes_on_a_good_setup_and_says_what_it_checked(history: History) -> None:
    done = cli("watchctl", "doctor", "--json", "--config", str(history.config.source))
    data = json.loads(done.stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert data["ok"] is True and all(c["ok"] for c in checks.values())
    assert list(checks) == [
        "config", "root 0", "root 0 observer", "root 0 lease", "root 1", "root 1 observer",
        "root 1 lease", "inotify",
        "database", "daemon", "registry", "spool", "local executor",
    ]  # fmt: skip
    assert checks["root 0"]["detail"].endswith("readable and writable by " + _user())
    assert checks["root 0 observer"]["detail"].endswith(" filesystem, observer inotify")
    assert checks["root 0 lease"]["detail"] == "none (the daemon takes it when it starts)"
    # A watch on each root; none on plate A, plate bad and plate B, whose batches have ended.
    assert checks["inotify"]["detail"].startswith("2 watch(es) needed of max_user_watches ")
    database = checks["database"]["detail"]
    latest = MIGRATIONS[-1][0]
    assert f"integrity ok, schema version {latest} of {latest}, journal wal" in database
    assert checks["daemon"]["detail"].startswith("stopped at ")
    assert checks["registry"]["detail"].endswith(f"1 model(s), writable by {_user()}")
    text = cli("watchctl", "doctor", "--config", str(history.config.source)).stdout
    assert text.startswith(f"ok   config: {history.config.source}: executor local, roots ")


def _user() -> str:
    import getpass

    return getpass.getuser()


def test_doctor_names_a_missing_root_and_an_unwritable_one_and_exits_3(tmp_path: Path) -> None:
    gone, locked = tmp_path / "gone", tmp_path / "locked"
    locked.mkdir()
    config = with_second_root(write_config(tmp_path, gone, tmp_path / "registry"), locked)
    immutable = IS_ROOT and shutil.which("chattr") is not None
    if immutable:
        subprocess.run(["chattr", "+i", str(locked)], check=True)  # even root cannot write
    else:
        locked.chmod(0o555)
    try:
        done = cli("watchctl", "doctor", "--config", str(config.source), check=False)
        data = json.loads(
            cli("watchctl", "doctor", "--json", "--config", str(config.source), check=False).stdout
        )
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=False) if immutable else None
        locked.chmod(0o755)
    assert done.returncode == 3
    assert done.stderr == "Error: 2 check(s) failed: root 0, root 1\n"
    assert f"FAIL root 0: {gone}: does not exist\n" in done.stdout
    assert "     hint: mount the share or create the folder" in done.stdout
    assert f"FAIL root 1: {locked}: not writable by {_user()} (" in done.stdout
    checks = {c["name"]: c for c in data["checks"]}
    assert data["ok"] is False
    assert checks["root 1"]["hint"].startswith("watchd writes status files and results")
    assert checks["database"]["ok"] and "not created yet" in checks["database"]["detail"]


def test_doctor_reports_every_problem_of_an_invalid_config_and_exits_3(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[daemon]\ntick_seconds = 0\nfoo = 1\n[[roots]]\npath = "d"\n')
    done = cli("watchctl", "doctor", "--config", str(config), check=False)
    assert done.returncode == 3
    lines = done.stdout.splitlines()
    assert lines[0] == f"FAIL config: {config}: 2 problem(s)"
    assert lines[1] == "  - daemon.tick_seconds: Input should be greater than 0 (got 0)"
    assert lines[2].startswith("  - daemon.foo: unknown key 'foo'")
    assert done.stderr == "Error: 1 check(s) failed: config\n"


def test_inotify_limits_fail_when_the_watches_needed_exceed_the_kernels() -> None:
    assert inotify_limits(10, 8192, 128).ok
    short = inotify_limits(9000, 8192, 128)
    assert not short.ok and short.hint.startswith("raise fs.inotify.max_user_watches above 9000")
    assert not inotify_limits(1, 8192, 0).ok
    assert inotify_limits(5, None, None).detail == "5 watch(es) needed; the limits are unknown here"


# -- intents: requeue, pause and resume -------------------------------------------------------


def test_requeue_runs_a_done_batch_again_and_inference_skips_what_is_current(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    config = config_for()
    shutil.copytree(staged(count=2), drop_root / "plate")
    with Replay(config) as replay:
        replay.run(until=lambda s: s.store.batch(1).state is BatchState.DONE)
        assert cli("watchctl", "requeue", "1", "--config", str(config.source)).stdout.startswith(
            "requeue of batch 1 recorded (intent 1); the daemon applies it at its next tick"
        )
        replay.run(until=lambda s: s.store.intent(1).applied_at is not None)
        replay.run(until=lambda s: s.store.batch(1).state is BatchState.DONE)
        store = replay.service.store
        jobs, events = store.jobs([1]), store.events(1)
        outcome, batch = store.intent(1).outcome, store.batch(1)
    assert outcome == "requeue: waiting for inputs again"
    assert [(j.state, j.attempts, j.tries) for j in jobs] == [(JobState.SUCCEEDED, 2, 1)] * 2
    assert [e.to_state.value for e in events if e.job_id is None] == [
        "waiting", "queued", "running", "done", "waiting", "queued", "running", "done",
    ]  # fmt: skip
    assert any(e.reason == f"requeue asked by {_user()}" for e in events)
    work = work_dir(config.daemon.spool_dir, batch.id, batch.run_dir)
    log = (work / "jobs" / jobs[0].name / "log.txt").read_text()
    assert "2 of 2 images already done (ledger): skipped" in log
    (request,) = ctl_json(config, "show", "1")["requests"]
    assert (request["action"], request["by"], request["outcome"]) == (
        "requeue", _user(), "requeue: waiting for inputs again",
    )  # fmt: skip


def test_a_retried_job_that_failed_at_its_first_attempt_runs_again(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    """Its first attempt's result (the model's weights missing) is not taken for the retry's:
    the retry is a submission of its own, and with the weights back the batch finishes. (The
    model stays listed: one the registry does not list is refused at intake, before any job.)"""
    config = config_for()
    (weights,) = config.registry.path.glob("*/v*/weights.pt")
    aside = weights.with_name("aside.pt")
    weights.rename(aside)
    shutil.copytree(staged(count=2), drop_root / "plate")
    with Replay(config) as replay:
        replay.run(until=lambda s: s.store.batch(1).state is BatchState.FAILED)
        assert "manifest" not in (replay.service.store.batch(1).reason or "")
        aside.rename(weights)
        cli("watchctl", "retry", "1", "--config", str(config.source))
        replay.run(until=lambda s: s.store.intent(1).applied_at is not None)
        replay.run(until=lambda s: s.store.batch(1).state.terminal)
        batch, jobs = replay.service.store.batch(1), replay.service.store.jobs([1])
    assert (batch.state, batch.reason) == (BatchState.DONE, "all jobs succeeded")
    assert [(j.attempts, j.tries) for j in jobs] == [(2, 1), (1, 1)]  # the shard; the report


def after(seconds: float) -> Callable[[object], bool]:
    """A replay's ``until``: true once ``seconds`` have passed."""
    end = time.monotonic() + seconds
    return lambda _: time.monotonic() >= end


def test_a_paused_root_takes_nothing_in_and_holds_its_queued_batch_until_resumed(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path
) -> None:
    """Paused with `watchctl pause 0` while batch 1 settles: it becomes queued but submits
    nothing, its status file says why, and `logs --follow` on its job ends cleanly on Ctrl-C.
    A manifest dropped while the daemon is down and the root paused is not taken in at start-up;
    `watchctl resume PATH` takes it in, and both batches finish."""
    config = config_for(intake={"settle_seconds": 2.0})
    shutil.copytree(staged("first", count=2), drop_root / "first")
    source = str(config.source)
    with Replay(config) as replay:
        replay.run(until=lambda s: bool(s.store.batches()))
        cli("watchctl", "pause", "0", "--config", source)
        replay.run(until=lambda s: s.store.batch(1).state is BatchState.QUEUED, timeout=30)
        replay.run(until=after(1.0))
        store = replay.service.store
        assert store.batch(1).state is BatchState.QUEUED
        assert [j.state for j in store.jobs([1])] == [JobState.PENDING]
        status_text = (drop_root / "first" / STATUS_NAME).read_text()
        follow = subprocess.Popen(
            [WATCHCTL, "logs", "b000001-infer-0000", "--follow", "--config", source],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert follow.stderr is not None
        waiting = follow.stderr.readline()  # following has begun
        follow.send_signal(signal.SIGINT)
        out, err = follow.communicate(timeout=10)
        roots = ctl_json(config, "status")["roots"]
    assert "Paused:    the drop folder was paused by " in status_text
    assert waiting == "(job b000001-infer-0000 is pending: its log begins when it runs)\n"
    assert (follow.returncode, out, err) == (0, "", "")
    assert roots[0]["paused"] is True and roots[0]["paused_by"] == _user()
    shutil.copytree(staged("second", count=2), drop_root / "second")
    with Replay(config) as replay:
        replay.run(until=after(2.5))  # past a rescan
        assert [b.folder for b in replay.service.store.batches()] == ["first"]
        out = cli("watchctl", "resume", str(drop_root), "--config", source).stdout
        assert out.startswith(f"resume of drop root {drop_root} recorded (intent 2)")
        replay.run(
            until=lambda s: [b.state for b in s.store.batches()] == [BatchState.DONE] * 2,
            timeout=120,
        )
        outcomes = [replay.service.store.intent(i).outcome for i in (1, 2)]
    assert outcomes == ["paused", "resumed"]
    assert "Paused:" not in (drop_root / "first" / STATUS_NAME).read_text()


def test_logs_follow_prints_a_running_jobs_log_and_ends_when_the_job_ends(
    config_for: Callable[..., Config], staged: Callable[..., Path], drop_root: Path, tmp_path: Path
) -> None:
    config = config_for()
    daemon = start_daemon(config, tmp_path / "daemon.log")
    try:
        shutil.copytree(staged(count=4), drop_root / "followed")
        wait_for(lambda s: bool(s.jobs()), config, timeout=60)
        store = Store(config.daemon.database)
        (job,) = store.jobs()
        store.close()
        assert not job.state.terminal
        follow = subprocess.run(
            [WATCHCTL, "logs", job.name, "--follow", "-n", "1000", "--config", str(config.source)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        store = Store(config.daemon.database)
        ended, batch = store.job(job.id), store.batch(job.batch_id)
        store.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    assert follow.returncode == 0, follow.stderr
    assert ended.state is JobState.SUCCEEDED
    log = work_dir(config.daemon.spool_dir, batch.id, batch.run_dir) / "jobs" / job.name / "log.txt"
    assert follow.stdout.splitlines() == log.read_text().splitlines()


# -- progress bars --------------------------------------------------------------------------------


def test_manifest_shows_a_progress_bar_on_a_terminal_and_nothing_else_elsewhere(
    tmp_path: Path, config_for: Callable[..., Config]
) -> None:
    """(With a configuration whose registry holds the model, so no note is due either.)"""
    config = config_for()
    folder = tmp_path / "plate"
    synth.make_batch(folder, "inference", count=3, size=32, seed=1)
    ask = (
        "manifest",
        str(folder),
        "--owner",
        "A",
        "--model",
        MODEL,
        "--config",
        str(config.source),
    )
    plain = cli("watchctl", *ask)
    assert (plain.stdout.strip(), plain.stderr) == (f"wrote {folder / 'manifest.toml'}", "")
    leader, follower = pty.openpty()
    done = subprocess.run(
        [WATCHCTL, *ask, "--force"],
        stdout=subprocess.PIPE, stderr=follower, text=True, timeout=60,
    )  # fmt: skip
    os.close(follower)
    seen = _drain(leader)
    assert done.returncode == 0 and done.stdout.strip() == f"wrote {folder / 'manifest.toml'}"
    assert "hashing" in seen


def _drain(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO once the other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("show", "abc"), "Error: Invalid value for 'batch_id': Input should be a valid integer"),
        (("nosuch",), "Error: No such command 'nosuch'."),
        (("logs",), "Error: Missing argument 'job'."),
    ],
)
def test_usage_errors_exit_2_with_clicks_message_and_no_traceback(
    args: tuple[str, ...], says: str
) -> None:
    done = cli("watchctl", *args, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert says in done.stderr
