"""Warm starts: the local executor hands a job to a launcher started ahead of it, its imports
done (daemon/executors/spares.py). The job runs as a job started cold does, in its own
environment, with its exit status, limits, cancel and adoption; where no spare fits, or the
spare cannot serve it, the job starts cold and nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import structlog

from daemon.contract.jobspec import Pipeline, Resources
from daemon.core.states import Phase
from daemon.executors import Accepted, Deferred, Status, Submission, local_job, spares
from daemon.executors.local import LAUNCH_FILE, LocalExecutor
from daemon.executors.local_job import TIMED_OUT, Forked
from daemon.site.config import LocalExecutorSection
from daemon.site.subprocesses import exited, process_start_ticks

# A job module: says at import and at run what a test checks; WARM_IMPORTS what its spare imports.
JOB = """\
import os, sys
print("imported", os.getpid(), flush=True)
WARM_IMPORTS = ("decimal",)
if __name__ == "__main__":
    print("ran", os.getpid(), sys.argv[1], os.environ.get("OMP_NUM_THREADS"),
          os.environ.get("CUDA_VISIBLE_DEVICES"), "decimal" in sys.modules, flush=True)
    if os.environ.get("KILL"):
        os.kill(os.getpid(), int(os.environ["KILL"]))
    if os.environ.get("SLEEP"):
        import time
        time.sleep(float(os.environ["SLEEP"]))
    sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "warmjob.py").write_text(JOB)
    return tmp_path / "lib"


def executor_for(lib: Path, **env: str) -> LocalExecutor:
    environ = {**os.environ, "PYTHONPATH": f"{lib}:{os.environ.get('PYTHONPATH', '')}", **env}
    return LocalExecutor(max_parallel=2, env=environ, warm=("warmjob",),
                         limits=LocalExecutorSection(warm_starts=1))  # fmt: skip


def submit(executor: LocalExecutor, job_dir: Path, cpus: int = 1) -> str:
    job_dir.mkdir(parents=True)
    (accepted,) = executor.submit([Submission(1, job_dir.name, "warmjob", job_dir, cpus=cpus)])
    assert isinstance(accepted, Accepted), accepted
    return accepted.handle


def until_ended(executor: LocalExecutor, handle: str, seconds: float = 60) -> Status:
    deadline = time.monotonic() + seconds
    while (status := executor.poll([handle])[handle]).phase is Phase.RUNNING:
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.05)
    return status


def ready(spare: spares.Spare, seconds: float = 60) -> None:
    """Wait until ``spare``'s imports are done (it said so)."""
    deadline = time.monotonic() + seconds
    while not spare.says_ready():
        assert time.monotonic() < deadline, "the spare never got ready"
        time.sleep(0.05)


def zombie(pid: int, seconds: float = 30) -> None:
    """Wait until our child ``pid`` has ended, without reaping it."""
    deadline = time.monotonic() + seconds
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"{pid} did not end"
        time.sleep(0.05)


def test_the_next_job_is_forked_from_a_spare_with_its_imports_done_in_its_own_environment(
    lib: Path, tmp_path: Path
) -> None:
    """The first job starts cold and a spare is started behind it; the second goes to that
    spare: its handle is the spare's, its launch record says so, the job ran in a process
    forked from the spare (a child of it) with the spare's imports, its own command line's
    argument and environment, and its log starts with what the imports printed."""
    executor = executor_for(lib, CODE="3")
    try:
        first = submit(executor, tmp_path / "one", cpus=2)
        assert until_ended(executor, first) == Status(Phase.ENDED, 3, "")
        (spare,) = executor.spares.waiting()
        ready(spare)
        second = submit(executor, tmp_path / "two", cpus=2)
        assert second == spare.handle and executor.spares.waiting() != [spare]
        assert until_ended(executor, second) == Status(Phase.ENDED, 3, "")
    finally:
        executor.close()
    cold = (tmp_path / "one" / "log.txt").read_text().splitlines()
    assert cold[1].split()[2:] == [str(tmp_path / "one"), "2", "None", "False"]
    warm = (tmp_path / "two" / "log.txt").read_text().splitlines()
    assert warm[0] == f"imported {spare.pid}"  # the spare's imports, in the job's log
    ran = warm[-1].split()
    assert ran[0] == "ran" and int(ran[1]) != spare.pid
    assert ran[2:] == [str(tmp_path / "two"), "2", "None", "True"]
    record = json.loads((tmp_path / "two" / LAUNCH_FILE).read_text())
    assert record["handle"] == spare.handle and record["warm"] is True
    assert record["command"][-3:] == ["-m", "warmjob", str(tmp_path / "two")]
    assert executor.spares.waiting() == []  # closed with the executor, and reaped
    assert exited(spare.pid) is None and not Path(f"/proc/{spare.pid}").exists()


def test_a_job_in_another_environment_starts_cold_and_gets_a_spare_of_its_own(
    lib: Path, tmp_path: Path
) -> None:
    """A library reads its environment as it is imported: a spare serves only jobs started in
    the environment it was (here: another thread count)."""
    executor = executor_for(lib)
    try:
        until_ended(executor, submit(executor, tmp_path / "one", cpus=1))
        (one_cpu,) = executor.spares.waiting()
        other = submit(executor, tmp_path / "two", cpus=4)
        assert other != one_cpu.handle
        assert until_ended(executor, other).exit_code == 0
        assert sorted(s.env["OMP_NUM_THREADS"] for s in executor.spares.waiting()) == ["1", "4"]
    finally:
        executor.close()
    assert (tmp_path / "two" / "log.txt").read_text().split()[-1] == "False"  # cold


def slow_job(lib: Path, seconds: float) -> str:
    """A job module whose spare takes ``seconds`` over its imports."""
    (lib / "slowdep.py").write_text(f"import time\ntime.sleep({seconds})\n")
    (lib / "slowjob.py").write_text(JOB.replace('("decimal",)', '("slowdep",)'))
    return "slowjob"


def test_a_job_whose_spare_is_still_importing_waits_for_it_and_its_word_wakes_the_loop(
    lib: Path, tmp_path: Path
) -> None:
    """The spare started behind a job is ahead of any cold start: the next job is deferred
    (quietly) until it says its imports are done, which wakes the daemon's loop, and is then
    forked from it. One job waits per spare: a second one in the same submission starts cold."""
    module = slow_job(lib, 1.5)
    environ = {**os.environ, "PYTHONPATH": f"{lib}:{os.environ.get('PYTHONPATH', '')}",
               "SLEEP": "4"}  # fmt: skip
    executor = LocalExecutor(max_parallel=3, env=environ, warm=(module,),
                             limits=LocalExecutorSection(warm_starts=1))  # fmt: skip
    woken = threading.Event()
    executor.wake_on_end(woken.set)
    dirs = [tmp_path / name for name in ("one", "two", "three")]
    for job_dir in dirs:
        job_dir.mkdir()
    try:
        (first,) = executor.submit([Submission(1, "one", module, dirs[0])])
        assert isinstance(first, Accepted)
        (spare,) = executor.spares.waiting()
        waits, cold = executor.submit([Submission(2, "two", module, dirs[1]),
                                       Submission(3, "three", module, dirs[2])])  # fmt: skip
        assert isinstance(waits, Deferred) and waits.quiet
        assert "two waits for its warm start, importing for" in waits.reason
        assert isinstance(cold, Accepted) and cold.handle != spare.handle
        assert woken.wait(30) and spare.says_ready()
        assert executor.poll([first.handle])[first.handle].phase is Phase.RUNNING  # not an end
        (warm,) = executor.submit([Submission(2, "two", module, dirs[1])])
        assert isinstance(warm, Accepted) and warm.handle == spare.handle
        for handle in (first.handle, cold.handle, warm.handle):
            assert until_ended(executor, handle).exit_code == 0
    finally:
        executor.close()
    assert json.loads((dirs[1] / LAUNCH_FILE).read_text())["warm"] is True
    assert (dirs[2] / "log.txt").read_text().split()[-1] == "False"  # cold


def test_a_job_waits_only_for_a_spare_past_half_the_imports_of_the_last_one(
    lib: Path, tmp_path: Path
) -> None:
    """Once a spare of its kind said ready after R seconds, a job waits for a spare still
    importing only if it has been at it for R/2 or more (a cold start overlaps its imports with
    its workers' reads): earlier, the job starts cold. Each spare here imports until the test
    lets it (a file named by its pid); the copy made of the first is ended, so that the next
    spare is started, and imports."""
    gate = tmp_path / "gate"
    gate.mkdir()
    (lib / "gated.py").write_text(
        "import os, time\n"
        f"while not os.path.exists(os.path.join({str(gate)!r}, str(os.getpid()))):\n"
        "    time.sleep(0.01)\n"
    )
    (lib / "gatedjob.py").write_text(JOB.replace('("decimal",)', '("gated",)'))
    environ = {**os.environ, "PYTHONPATH": f"{lib}:{os.environ.get('PYTHONPATH', '')}"}
    executor = LocalExecutor(max_parallel=4, env=environ, warm=("gatedjob",),
                             limits=LocalExecutorSection(warm_starts=1))  # fmt: skip

    def offer(name: str) -> Accepted | Deferred:
        (job_dir := tmp_path / name).mkdir(exist_ok=True)
        (handed,) = executor.submit([Submission(1, name, "gatedjob", job_dir)])
        assert isinstance(handed, Accepted | Deferred), handed
        return handed

    try:
        offer("one")
        (first,) = executor.spares.waiting()
        time.sleep(1.0)
        (gate / str(first.pid)).touch()  # its imports took a second
        ready(first)
        assert first.ready_after is not None and 1.0 <= first.ready_after < 10  # its own word
        assert offer("two") == Accepted(first.handle)
        (copy,) = executor.spares.waiting()  # a copy of it, ready: ended here
        assert copy.copied and copy.says_ready()
        spares.end(copy)
        assert isinstance(offer("three"), Accepted)  # cold
        (second,) = executor.spares.waiting()  # started behind "three", importing
        assert not second.copied
        cold = offer("four")  # the second spare has been importing for less than 0.5 s
        assert isinstance(cold, Accepted) and cold.handle != second.handle
        time.sleep(0.6)
        assert isinstance(offer("five"), Deferred)  # now past half: it waits
        (gate / str(second.pid)).touch()
        ready(second)
        assert offer("five") == Accepted(second.handle)
    finally:
        executor.close()


def test_a_job_does_not_wait_for_a_spare_that_ended_or_took_too_long(
    lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare still importing past READY_WAIT_SECONDS is taken for stuck, and one that ended
    before its word serves nobody: the job starts cold at once."""
    module = slow_job(lib, 30)
    environ = {**os.environ, "PYTHONPATH": f"{lib}:{os.environ.get('PYTHONPATH', '')}"}
    executor = LocalExecutor(max_parallel=3, env=environ, warm=(module,),
                             limits=LocalExecutorSection(warm_starts=1))  # fmt: skip
    dirs = [tmp_path / name for name in ("one", "two", "three")]
    for job_dir in dirs:
        job_dir.mkdir()
    try:
        executor.submit([Submission(1, "one", module, dirs[0])])
        (spare,) = executor.spares.waiting()
        (waits,) = executor.submit([Submission(2, "two", module, dirs[1])])
        assert isinstance(waits, Deferred)
        monkeypatch.setattr(spares, "READY_WAIT_SECONDS", 0.0)
        (stuck,) = executor.submit([Submission(2, "two", module, dirs[1])])
        assert isinstance(stuck, Accepted) and stuck.handle != spare.handle
        monkeypatch.undo()
        os.kill(spare.pid, signal.SIGKILL)
        zombie(spare.pid)
        (gone,) = executor.submit([Submission(3, "three", module, dirs[2])])
        assert isinstance(gone, Accepted) and gone.handle != spare.handle
    finally:
        executor.close()


def test_a_spare_whose_imports_fail_starts_its_job_cold_and_the_log_says_why(
    lib: Path, tmp_path: Path
) -> None:
    """A module that cannot be imported fails the job as it would have cold: its traceback and
    the job's own failure are in the job's log, after the line that says it started cold."""
    (lib / "warmjob.py").write_text("raise ImportError('no such library here')\n")
    executor = executor_for(lib)
    try:
        until_ended(executor, submit(executor, tmp_path / "one"))
        (spare,) = executor.spares.waiting()
        ready(spare)
        second = submit(executor, tmp_path / "two")
        assert second == spare.handle
        assert until_ended(executor, second).exit_code == 1
    finally:
        executor.close()
    log = (tmp_path / "two" / "log.txt").read_text()
    said = "watchd: the job starts cold: the process started ahead for it: its imports failed"
    assert said in log
    assert log.count("ImportError: no such library here") == 2  # the spare's, the cold job's
    assert log.index(said) < log.rindex("ImportError")


def test_a_warm_job_is_cancelled_as_a_cold_one(lib: Path, tmp_path: Path) -> None:
    """A cancel signals the launcher's group: the spare and the job forked from it end."""
    executor = executor_for(lib, SLEEP="300")
    try:
        executor.cancel([submit(executor, tmp_path / "one")])
        (spare,) = executor.spares.waiting()
        ready(spare)
        warm = submit(executor, tmp_path / "two")
        assert warm == spare.handle
        deadline = time.monotonic() + 30
        while "ran" not in (tmp_path / "two" / "log.txt").read_text():
            assert time.monotonic() < deadline, "the warm job did not start"
            time.sleep(0.05)
        executor.cancel([warm])
        while Path(f"/proc/{spare.pid}").exists():  # ended and reaped
            executor.poll([])
            assert time.monotonic() < deadline, "the warm job outlived its cancel"
            time.sleep(0.05)
    finally:
        executor.close()
    job = int((tmp_path / "two" / "log.txt").read_text().split("ran ")[1].split()[0])
    assert not Path(f"/proc/{job}").exists()


def test_a_warm_job_is_kept_to_its_time_limit(lib: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(lib), "SLEEP": "300"}
    waiting = spares.Spares(sys.executable, 1, ["warmjob"])
    waiting.top_up("warmjob", env)
    (started,) = waiting.waiting()
    assert waiting.take("warmjob", env) is None  # not ready yet: the job would start cold
    ready(started)
    spare = waiting.take("warmjob", env)
    assert spare is started
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    log_fd = os.open(job_dir / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    started = time.monotonic()
    spares.hand_over(spare, str(job_dir), 2, 0, [sys.executable, "-m", "warmjob", str(job_dir)],
                     env, log_fd)  # fmt: skip
    os.close(log_fd)
    _, status = os.waitpid(spare.pid, 0)
    assert os.waitstatus_to_exitcode(status) == TIMED_OUT
    assert spares.end_word(spare.channel) == TIMED_OUT  # its last word says it too
    spare.channel.close()
    assert 2 <= time.monotonic() - started < 30
    log = (job_dir / "log.txt").read_text().splitlines()
    assert log[-2].split()[-1] == "True"  # it ran warm
    assert log[-1] == ("watchd: ended by watchd: it ran past its time limit ([resources] "
                       "time_minutes): 0.0333333 minutes")  # fmt: skip


def test_a_warm_job_outlives_its_daemon_and_is_adopted_while_idle_spares_end(
    lib: Path, tmp_path: Path
) -> None:
    """Stopping the executor (the daemon) ends the spares that wait, not a job handed to one;
    the next executor adopts that job by its launch record."""
    executor = executor_for(lib, SLEEP="300")
    first = submit(executor, tmp_path / "one")
    (spare,) = executor.spares.waiting()
    ready(spare)
    sub = Submission(1, "two", "warmjob", tmp_path / "two")
    (tmp_path / "two").mkdir()
    (accepted,) = executor.submit([sub])
    assert accepted == Accepted(spare.handle)
    (behind,) = executor.spares.waiting()
    assert behind.copied  # a copy of the spare: no child here, init reaps it
    executor.close()
    assert process_start_ticks(behind.pid) is None  # the idle spare ended
    again = executor_for(lib, SLEEP="300")
    try:
        assert again.submit([sub]) == [Accepted(spare.handle)]
        assert again.poll([spare.handle])[spare.handle].phase is Phase.RUNNING
        assert again.spares.waiting() == []  # an adopted job starts no spare
    finally:
        for handle in (first, spare.handle):
            pid = int(handle.split(":")[1])
            os.killpg(pid, signal.SIGTERM)
            os.waitpid(pid, 0)  # this test's children
        again.close()


def test_a_spare_gone_before_its_job_came_is_never_handed_one(lib: Path, tmp_path: Path) -> None:
    """Its socket's end of file (the daemon killed: the kernel closes its end) ends a spare
    (exit 0); the next job does not go to it, but starts cold, and a new spare is started."""
    executor = executor_for(lib)
    try:
        until_ended(executor, submit(executor, tmp_path / "one"))
        (spare,) = executor.spares.waiting()
        ready(spare)
        spare.channel.shutdown(socket.SHUT_RDWR)  # as the kernel does for a daemon killed
        zombie(spare.pid)
        handle = submit(executor, tmp_path / "two")
        assert handle != spare.handle
        assert until_ended(executor, handle).exit_code == 0
        (behind,) = executor.spares.waiting()
        assert behind.pid != spare.pid and not Path(f"/proc/{spare.pid}").exists()  # reaped
    finally:
        executor.close()
    assert "True" not in (tmp_path / "two" / "log.txt").read_text()


def test_a_spare_no_job_came_for_ends_by_itself_and_then_refuses_one(lib: Path) -> None:
    """Past SPARE_IDLE_SECONDS (here 1 s) a spare stops reading and ends: a job sent then is
    refused at once (EPIPE), and the executor starts it cold; none is lost in between."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    code = ("import sys; from daemon.executors import local_job as l; "
            "l.SPARE_IDLE_SECONDS = 1.0; sys.exit(l.main(['--spare', 'warmjob']))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{lib}:{os.environ.get('PYTHONPATH', '')}"}
    started = time.monotonic()
    spare = subprocess.Popen([sys.executable, "-c", code], stdin=theirs, env=env)
    theirs.close()
    assert ours.recv(1) == b"R"
    assert spare.wait(30) == 0 and 1 <= time.monotonic() - started < 30
    with pytest.raises(OSError):
        socket.send_fds(ours, [b"{}"], [1])
    ours.close()


def test_no_spare_is_started_where_warm_starts_is_0_or_for_modules_not_warmed(
    lib: Path, tmp_path: Path
) -> None:
    environ = {**os.environ, "PYTHONPATH": str(lib)}
    off = LocalExecutor(max_parallel=1, env=environ, warm=("warmjob",),
                        limits=LocalExecutorSection(warm_starts=0))  # fmt: skip
    other = LocalExecutor(max_parallel=1, env=environ, warm=("pipelines.infer",))
    try:
        for number, executor in enumerate((off, other)):
            until_ended(executor, submit(executor, tmp_path / f"job{number}"))
            assert executor.spares.waiting() == []
    finally:
        off.close()
        other.close()


@pytest.mark.parametrize(("pipeline", "cpus"), [(Pipeline.INFER, 2), (Pipeline.REPORT, 1)])
def test_an_expected_job_finds_its_warm_start_ready_when_it_comes(
    tmp_path: Path, pipeline: Pipeline, cpus: int
) -> None:
    """Told that jobs of a warmed pipeline come (a batch's inputs settle: its shards and its
    report; its shards run: its report), the executor starts one spare for them, however often told, in
    their environment; the first such job is forked from it. Nothing is started for a
    pipeline not warmed (training)."""
    executor = LocalExecutor(max_parallel=1, env=dict(os.environ))
    try:
        executor.expect(Pipeline.TRAIN, Resources(cpus=cpus))
        assert executor.spares.waiting() == []
        for _ in range(3):
            executor.expect(pipeline, Resources(cpus=cpus))
        (spare,) = executor.spares.waiting()
        assert spare.module == pipeline.module and spare.env["OMP_NUM_THREADS"] == str(cpus)
        ready(spare, 120)
        job_dir = tmp_path / "first"
        job_dir.mkdir()
        sub = Submission(1, job_dir.name, pipeline.module, job_dir, cpus=cpus)
        (accepted,) = executor.submit([sub])
        assert isinstance(accepted, Accepted) and accepted.handle == spare.handle
        until_ended(executor, accepted.handle)  # no spec in its folder: it fails, saying so
    finally:
        executor.close()
    assert json.loads((job_dir / LAUNCH_FILE).read_text())["warm"] is True
    assert "spec.json" in (job_dir / "log.txt").read_text()


def test_a_spare_that_ends_before_it_is_ready_pauses_the_start_of_others_and_says_so() -> None:
    """A launcher that cannot serve (here an interpreter that exits at once, as a wrapper in
    ``executor.local.python`` might): a warning, and no other spare of its kind started at
    each look for a while (the jobs start cold); not one per tick."""
    executor = LocalExecutor(max_parallel=1, python="/bin/false")
    try:
        executor.expect(Pipeline.INFER, Resources(cpus=1))
        (spare,) = executor.spares.waiting()
        zombie(spare.pid)
        with structlog.testing.capture_logs() as logged:
            for _ in range(5):  # five ticks
                executor.spares.tend()
                executor.expect(Pipeline.INFER, Resources(cpus=1))
        assert executor.spares.waiting() == []
    finally:
        executor.close()
    (said,) = [e for e in logged if e["event"].startswith("warm start ended before")]
    assert (
        said["module"] == Pipeline.INFER.module and said["next_in_s"] == spares.FAILED_PAUSE_SECONDS
    )


@pytest.mark.parametrize("pidfds", [True, False])
def test_a_forked_job_is_waited_for_with_or_without_pidfds(
    pidfds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a filter or an old kernel refuses pidfds, the launcher looks for its job's end."""
    if not pidfds:
        monkeypatch.setattr(os, "pidfd_open", lambda pid: (_ for _ in ()).throw(OSError(1, "no")))
    pid = os.fork()
    if pid == 0:
        time.sleep(0.5)
        os._exit(5)
    job = Forked(pid)
    assert (job.pidfd is not None) is pidfds
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(0.05)
    assert job.wait() == 5 and job.wait(0) == 5


def test_a_warm_job_sees_its_own_gpus_set_as_it_is_forked(lib: Path, tmp_path: Path) -> None:
    """The spare is started without CUDA_VISIBLE_DEVICES; the job forked from it has the GPU
    the executor handed it (CUDA reads it only as it starts, in the job)."""
    environ = {**os.environ, "PYTHONPATH": str(lib), "SLEEP": "2"}
    limits = LocalExecutorSection(gpus=2, max_gpus=1, warm_starts=1)
    executor = LocalExecutor(max_parallel=2, env=environ, warm=("warmjob",), limits=limits)
    handles = []
    try:
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            sub = Submission(1, name, "warmjob", tmp_path / name, gpus=1)
            (accepted,) = executor.submit([sub])
            assert isinstance(accepted, Accepted)
            handles.append(accepted.handle)
            if name == "one":
                (spare,) = executor.spares.waiting()
                assert "CUDA_VISIBLE_DEVICES" not in spare.env
                ready(spare)
        assert handles[1] == spare.handle
        for handle in handles:
            assert until_ended(executor, handle).exit_code == 0
    finally:
        executor.close()
    said = [(tmp_path / n / "log.txt").read_text().split()[-2:] for n in ("one", "two")]
    assert said == [["0", "False"], ["1", "True"]]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGINT])
def test_a_job_killed_by_a_signal_ends_its_launcher_by_it_cold_or_warm(
    lib: Path, tmp_path: Path, signum: int
) -> None:
    """The daemon reads the launcher's end as the job's: one killed by SIGKILL (the kernel's
    out-of-memory killer) or interrupted ends by that signal, started cold or forked, from a
    spare or from a copy of one (which says it on its socket: it is no child of the daemon)."""
    executor = executor_for(lib, KILL=str(int(signum)))
    try:
        cold = submit(executor, tmp_path / "one")
        assert until_ended(executor, cold).exit_code == -signum
        (spare,) = executor.spares.waiting()
        ready(spare)
        warm = submit(executor, tmp_path / "two")
        assert warm == spare.handle
        assert until_ended(executor, warm).exit_code == -signum
        (copy,) = executor.spares.waiting()
        assert copy.copied and submit(executor, tmp_path / "three") == copy.handle
        assert until_ended(executor, copy.handle).exit_code == -signum
    finally:
        executor.close()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_wave_of_jobs_starts_warm_from_copies_of_one_spare_that_imported_once(
    lib: Path, tmp_path: Path
) -> None:
    """With one warm start, three jobs submitted at once all start warm: the spare runs the
    first, copies of it forked in turn (no children of the daemon, each in a session of its
    own) the others; the imports ran once, in the spare (every log starts with its pid), and
    each job's exit status comes back."""
    executor = LocalExecutor(
        max_parallel=4, warm=("warmjob",), limits=LocalExecutorSection(warm_starts=1),
        env={**os.environ, "PYTHONPATH": f"{lib}:{os.environ.get('PYTHONPATH', '')}",
             "CODE": "3", "SLEEP": "1"},
    )  # fmt: skip
    names = ("one", "two", "three", "four")
    for name in names:
        (tmp_path / name).mkdir()
    try:
        (cold,) = executor.submit([Submission(1, "one", "warmjob", tmp_path / "one")])
        assert isinstance(cold, Accepted)
        (spare,) = executor.spares.waiting()
        ready(spare)
        wave = executor.submit([Submission(n, name, "warmjob", tmp_path / name)
                                for n, name in enumerate(names[1:], start=2)])  # fmt: skip
        handles = [h.handle for h in wave if isinstance(h, Accepted)]
        assert len(set(handles)) == 3 and handles[0] == spare.handle
        pids = [int(h.split(":")[1]) for h in handles]
        assert parent(pids[0]) == os.getpid()
        assert all(parent(pid) != os.getpid() and os.getsid(pid) == pid for pid in pids[1:])
        (behind,) = executor.spares.waiting()  # a copy of the last, for the next job
        assert behind.copied and behind.pid not in pids
        for handle in [*handles, cold.handle]:
            assert until_ended(executor, handle) == Status(Phase.ENDED, 3, "")
    finally:
        executor.close()
    for name in names[1:]:
        log = (tmp_path / name / "log.txt").read_text().splitlines()
        assert log[0] == f"imported {spare.pid}" and log[-1].split()[-1] == "True"
        assert json.loads((tmp_path / name / LAUNCH_FILE).read_text())["warm"] is True


def test_a_copys_job_is_cancelled_alone_and_a_copy_killed_unsaid_is_left_to_its_result(
    lib: Path, tmp_path: Path
) -> None:
    """A cancel of a job forked from a copy ends its group (the copy and its job), not the
    spare it was copied from; a copy's launcher killed before it could say its end gives an
    unknown status, which the daemon settles by the job's result, as for a job adopted."""
    executor = executor_for(lib, SLEEP="300")
    try:
        cold = submit(executor, tmp_path / "one")
        (spare,) = executor.spares.waiting()
        ready(spare)
        warm = submit(executor, tmp_path / "two")
        (copy,) = executor.spares.waiting()
        assert submit(executor, tmp_path / "three") == copy.handle
        (second,) = executor.spares.waiting()
        assert submit(executor, tmp_path / "four") == second.handle
        deadline = time.monotonic() + 30
        while not all("ran" in (tmp_path / n / "log.txt").read_text() for n in ("three", "four")):
            assert time.monotonic() < deadline, "the jobs did not start"
            time.sleep(0.05)
        job = int((tmp_path / "three" / "log.txt").read_text().split("ran ")[1].split()[0])
        executor.cancel([copy.handle])
        while process_start_ticks(copy.pid) is not None or process_start_ticks(job):
            assert time.monotonic() < deadline, "the copy's job outlived its cancel"
            time.sleep(0.05)
        assert executor.poll([warm])[warm].phase is Phase.RUNNING
        os.killpg(second.pid, signal.SIGKILL)  # its launcher and job, with no word said
        assert until_ended(executor, second.handle) == Status(Phase.UNKNOWN)
    finally:
        for handle in (cold, warm):
            executor.cancel([handle])
        executor.close()


def test_a_spare_taken_is_replaced_by_a_copy_only_while_fewer_than_count_wait(lib: Path) -> None:
    """Two spares of a kind wait where one is kept (the setting lowered): taking one leaves
    the other, and no copy; taking that one then leaves a copy of it, forked at once."""
    env = {**os.environ, "PYTHONPATH": str(lib)}
    waiting = spares.Spares(sys.executable, 2, ["warmjob"])
    try:
        waiting.top_up("warmjob", env)
        for spare in waiting.waiting():
            ready(spare)
        waiting.count = 1
        first = waiting.take("warmjob", env, replace=True)
        assert first is not None and len(waiting.waiting()) == 1
        (other,) = waiting.waiting()
        assert not other.copied
        assert waiting.take("warmjob", env, replace=True) is other
        (copy,) = waiting.waiting()
        assert copy.copied and copy.says_ready() and process_start_ticks(copy.pid) is not None
        for taken in (first, other):
            spares.end(taken)
    finally:
        waiting.close()


def test_a_launcher_told_to_stop_before_its_job_was_started_ends_the_job(tmp_path: Path) -> None:
    """A cancel's SIGTERM to the launcher's group that comes before the job is forked (a
    job just handed to a spare) misses the job: the launcher ends it itself, not 300 s later."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def start() -> subprocess.Popen[bytes]:
        os.kill(os.getpid(), signal.SIGTERM)  # the group's signal, before the job is there
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])

    started = time.monotonic()
    try:
        assert local_job.supervise(tmp_path, 0, 0, start) == -signal.SIGTERM
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert time.monotonic() - started < 30
