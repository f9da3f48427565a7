"""The text in and out of Slurm's tools, and the launch plan, as pure functions on strings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.contract.errors import CommandFailed, SubmissionError
from daemon.contract.jobspec import Pipeline
from daemon.core.manifest import ResourceRequest
from daemon.core.states import Phase
from daemon.executors import Submission
from daemon.executors import slurm_launch as launching
from daemon.executors.resources import given, slurm_bounds
from daemon.executors.slurm_api import JobRecord, JobRequest, describe, exit_status, phase_of
from daemon.executors.slurm_api import release as release_of
from daemon.executors.slurm_cli import (
    compress_ids,
    parse_sbatch,
    parse_show_config,
    parse_squeue,
    sbatch_args,
    transient,
)
from daemon.site.config import SlurmExecutorSection

SITE = SlurmExecutorSection(
    partition="gpu", account="lab", constraint="v100&ib", array_throttle=50, max_array_tasks=3,
    time_minutes=30, memory_mb=2048, gpus=1, max_gpus=4, tasks=1, max_tasks=2,
)  # fmt: skip


def request(**changes: object) -> JobRequest:
    values: dict = {
        "name": "b000001-infer", "comment": "watchd:b000001-infer:0123456789abcdef",
        "script": Path("/share/drop röot/plate 'x'/results/r/jobs/slurm/k.sh"),
        "work_dir": Path("/share/drop röot/plate 'x'/results/r/jobs"),
        "output": "slurm/k-%A_%a.out", "time_minutes": 30, "memory_mb": 2048,
    }  # fmt: skip
    return JobRequest(**(values | changes))


def test_sbatch_gets_every_option_as_its_own_argument_and_the_script_last() -> None:
    options = {"gpus": 2, "ntasks": 2, "cpus_per_task": 4, "array": "0-859%50",
               "partition": "gpu", "account": "lab", "constraint": "v100&ib"}  # fmt: skip
    args = sbatch_args(request(**options))
    assert args == [
        "sbatch", "--parsable", "--no-requeue", "--job-name=b000001-infer",
        "--comment=watchd:b000001-infer:0123456789abcdef",
        "--chdir=/share/drop röot/plate 'x'/results/r/jobs", "--output=slurm/k-%A_%a.out",
        "--time=30", "--mem=2048M", "--cpus-per-task=4", "--ntasks=2", "--gres=gpu:2",
        "--array=0-859%50", "--partition=gpu", "--account=lab", "--constraint=v100&ib",
        "/share/drop röot/plate 'x'/results/r/jobs/slurm/k.sh",
    ]  # fmt: skip


def test_empty_options_are_left_out_so_the_cluster_defaults_apply() -> None:
    args = sbatch_args(request())
    assert not [a for a in args if a.startswith(("--gres", "--array", "--partition", "--acc"))]


def test_sbatch_parsable_output_gives_the_job_id_with_or_without_a_cluster_name() -> None:
    assert parse_sbatch("4242\n") == "4242"
    assert parse_sbatch("sbatch: warning: x\n4243;cluster2\n") == "4243"
    with pytest.raises(SubmissionError, match="not a job id"):
        parse_sbatch("Submitted batch job 12\n")
    with pytest.raises(SubmissionError, match="no job id"):
        parse_sbatch("")


SQUEUE = """\
9|9|CANCELLED|None|15|(null)
8_1|8|FAILED|NonZeroExitCode|256|watchd:b000001-infer:0123456789abcdef
8_2|8|PENDING|JobArrayTaskLimit|0|watchd:b000001-infer:0123456789abcdef
12|12|RUNNING|None|0|a comment | with bars
garbage line
"""


def test_squeue_lines_become_records_with_decoded_exit_codes_and_whole_comments() -> None:
    records = parse_squeue(SQUEUE)
    assert records == [
        JobRecord("9", "CANCELLED", "None", 128 + 15, ""),
        JobRecord("8_1", "FAILED", "NonZeroExitCode", 1, "watchd:b000001-infer:0123456789abcdef"),
        JobRecord(
            "8_2", "PENDING", "JobArrayTaskLimit", 0, "watchd:b000001-infer:0123456789abcdef"
        ),
        JobRecord("12", "RUNNING", "None", 0, "a comment | with bars"),
    ]
    assert records[1].array_id == "8" and records[0].array_id == "9"
    assert (
        describe(records[1]) == "FAILED (NonZeroExitCode)" and describe(records[0]) == "CANCELLED"
    )


@pytest.mark.parametrize(
    ("state", "phase"),
    [("PENDING", Phase.QUEUED), ("REQUEUED", Phase.QUEUED), ("RUNNING", Phase.RUNNING),
     ("COMPLETING", Phase.RUNNING), ("COMPLETED", Phase.ENDED), ("TIMEOUT", Phase.ENDED),
     ("OUT_OF_MEMORY", Phase.ENDED), ("NODE_FAIL", Phase.ENDED), ("CANCELLED by 0", Phase.ENDED),
     ("", Phase.UNKNOWN), ("WEIRD", Phase.UNKNOWN)],
)  # fmt: skip
def test_slurm_states_map_to_phases_and_completing_is_not_yet_ended(
    state: str, phase: Phase
) -> None:
    assert phase_of(state) is phase


def test_wait_statuses_read_as_a_shell_would_say_them() -> None:
    assert [exit_status(s) for s in (0, 256, 512, 9, 15, 0x8B00)] == [0, 1, 2, 137, 143, 139]


def test_scancel_gets_array_tasks_folded_into_ranges() -> None:
    ids = ["8_3", "7", "8_1", "8_2", "8_7", "9_0", "8_1"]
    assert compress_ids(ids) == ["7", "8_[1-3,7]", "9_[0]"]


def test_scontrol_show_config_is_read_into_keys_and_values() -> None:
    text = "Configuration data as of 2026-11-21T06:00:00\nMaxArraySize            = 100001\nSLURM_VERSION           = 22.05.8\n"
    config = parse_show_config(text)
    assert config["SLURM_VERSION"] == "22.05.8" and config["MaxArraySize"] == "100001"


def test_versions_compare_by_release_whatever_the_spelling() -> None:
    assert release_of("slurm-wlm 22.05.8") == release_of("22.5.3") == (22, 5)
    assert release_of("pyslurm 25.11.0") == (25, 11) and release_of("unknown") is None


def test_an_unreachable_controller_or_a_timeout_is_transient_a_refusal_is_not() -> None:
    down = "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"
    assert transient(CommandFailed(["sbatch"], 1, "", down))
    assert transient(CommandFailed(["sbatch"], 1, "", "Resource temporarily unavailable"))
    assert transient(CommandFailed(["squeue"], 124, "", "timed out after 30 s"))
    refused = "sbatch: error: Batch job submission failed: Invalid partition name specified"
    assert not transient(CommandFailed(["sbatch"], 1, "", refused))


# -- launches -----------------------------------------------------------------------------------


NO_REQUEST = ResourceRequest()


def sub(i: int, jobs: Path, *, group: str = "b000001-infer", module: str = "pipelines.infer",
        attempt: int = 1, resources: ResourceRequest = NO_REQUEST,
        site: SlurmExecutorSection = SITE) -> Submission:  # fmt: skip
    """A submission shaped as the Slurm executor shapes it for the dispatcher
    (:meth:`SlurmExecutor.allocation`: the site's defaults, the manifest's ask, the bounds)."""
    name = f"{group}-{i:04d}" if module == "pipelines.infer" else group
    pipeline = Pipeline(module.removeprefix("pipelines."))
    cpus = site.cpus(pipeline is Pipeline.INFER)
    shape = given(resources, pipeline, cpus, site.shapes, slurm_bounds(site))
    return Submission(
        i, name, module, jobs / name, shape.cpus, shape.gpus, shape.tasks, group=group,
        attempt=attempt, resources=resources,
    )  # fmt: skip


def test_the_shards_of_a_stage_go_out_as_arrays_in_chunks_of_the_largest_allowed() -> None:
    jobs = Path("/share/b/results/r/jobs")
    subs = [sub(i, jobs) for i in range(5)] + [sub(9, jobs, group="b000001-train",
                                                     module="pipelines.train")]  # fmt: skip
    launches = launching.plan(subs, SITE)
    assert [len(launch.submissions) for launch in launches] == [3, 2, 1]
    assert [launch.is_array for launch in launches] == [True, True, False]
    assert launches[0].name == "b000001-infer" and launches[2].name == "b000001-train"
    req = launching.request(launches[0], SITE, Path("/s.sh"), {})
    assert req.array == "0-2%50"
    assert req.output == "/dev/null"  # slurmstepd opens it by path: never in the batch folder
    assert (req.partition, req.account, req.constraint) == ("gpu", "lab", "v100&ib")
    assert launches[0].handle("77", 2) == "slurm:77_2" and launches[2].handle("78", 0) == "slurm:78"


def test_training_gets_the_sites_gpus_and_tasks_unless_the_manifest_asks_within_bounds() -> None:
    jobs = Path("/j")
    default, asked = launching.plan(
        [sub(1, jobs, group="b1-train", module="pipelines.train"),
         sub(2, jobs, group="b2-train", module="pipelines.train",
             resources=ResourceRequest(time_minutes=90, memory_mb=4096, gpus=2, tasks=2))],
        SITE,
    )  # fmt: skip
    assert (default.allocation.gpus, default.allocation.tasks) == (1, 1)
    assert default.allocation.time_minutes == 30 and default.allocation.memory_mb == 2048
    assert (asked.allocation.gpus, asked.allocation.tasks, asked.allocation.time_minutes) == (
        2,
        2,
        90,
    )
    shard = launching.plan([sub(3, jobs, resources=ResourceRequest(gpus=2, tasks=2))], SITE)[0]
    assert (shard.allocation.gpus, shard.allocation.tasks) == (2, 1)  # inference: one task each


def test_inference_tasks_ask_for_the_sites_gpus_and_cpus_to_feed_them_other_jobs_do_not() -> None:
    """On a GPU partition, each inference task asks for ``--gres=gpu:N`` and its own
    ``--cpus-per-task`` (the job's workers use as many); training and the report keep
    ``cpus_per_task``."""
    site = SITE.model_copy(update={"inference_gpus": 1, "inference_cpus_per_task": 8,
                                   "cpus_per_task": 2})  # fmt: skip
    jobs = Path("/j")
    shards, train, report = launching.plan(
        [sub(0, jobs, site=site), sub(1, jobs, site=site),
         sub(2, jobs, group="b1-train", module="pipelines.train", site=site),
         sub(3, jobs, group="b1-report", module="pipelines.report", site=site)],
        site,
    )  # fmt: skip
    assert [s.cpus for s in shards.submissions] == [8, 8]
    assert (shards.allocation.cpus, shards.allocation.gpus) == (8, 1)
    options = launching.request(shards, site, Path("/s.sh"), {})
    assert (options.cpus_per_task, options.gpus) == (8, 1)
    assert {"--gres=gpu:1", "--cpus-per-task=8"} <= set(sbatch_args(options))
    assert (train.allocation.cpus, train.allocation.gpus) == (2, 1)
    assert (report.allocation.cpus, report.allocation.gpus) == (2, 0)
    assert launching.request(report, site, Path("/s.sh"), {}).cpus_per_task == 2
    assert SITE.cpus(inference=True) == SITE.cpus_per_task == 1


def test_a_launch_key_names_the_jobs_and_attempts_and_changes_with_a_retry() -> None:
    jobs = Path("/j")
    first = launching.plan([sub(0, jobs), sub(1, jobs)], SITE)[0]
    again = launching.plan([sub(0, jobs), sub(1, jobs)], SITE)[0]
    retry = launching.plan([sub(0, jobs), sub(1, jobs, attempt=2)], SITE)[0]
    assert first.key == again.key != retry.key
    assert launching.key_of_comment(first.comment) == first.key
    assert launching.key_of_comment("watchd:x:not-a-key") is None
    assert launching.key_of_comment("someone else's job") is None
    text = launching.tasks_text(retry)
    assert text == "b000001-infer-0000\t1\nb000001-infer-0001\t2\n"
    assert launching.parse_tasks(text) == [("b000001-infer-0000", 1), ("b000001-infer-0001", 2)]


def test_only_tasks_still_waiting_or_running_in_slurm_are_found_for_adoption() -> None:
    """Two arrays of one launch (the first cancelled, then the same tasks submitted again):
    each task's live copy is found, an ended one never; a launch of one job is the job id."""
    tasks = [("b1-infer-0000", 1), ("b1-infer-0001", 1)]
    live = {"12_0", "12_1", "11_1"}
    assert launching.live_tasks(tasks, ["10", "11", "12"], live) == {
        ("b1-infer-0000", 1): "slurm:12_0",
        ("b1-infer-0001", 1): "slurm:11_1",
    }
    assert launching.live_tasks([("b1-train", 1)], ["7", "8"], {"8"}) == {
        ("b1-train", 1): "slurm:8"
    }
    assert launching.live_tasks(tasks, ["10"], live) == {}


def test_a_job_name_that_could_not_name_a_task_is_refused() -> None:
    with pytest.raises(SubmissionError, match="cannot name a Slurm task"):
        launching.plan([Submission(1, "x", "pipelines.infer", Path("/j/a b"))], SITE)


def stand_in_python(folder: Path) -> str:
    """An interpreter for the job script: the real one for watchd's log opener, ``echo`` for
    the job itself (so the test runs no pipeline)."""
    path = folder / "python"
    path.write_text(
        "#!/bin/bash\n"
        f'if [ "$1 $2" = "-m daemon.executors.slurm_job" ]; then exec {sys.executable} "$@"; fi\n'
        'echo "$@"\n'
    )
    path.chmod(0o755)
    return str(path)


def array_on_disk(drop_root: Path) -> tuple[launching.Launch, Path]:
    """A launch of three tasks, its files written, in a spool whose path is awkward."""
    jobs = drop_root.parent / "spool $(touch x) 'q'" / "runs" / "b000001" / "r" / "jobs"
    subs = [sub(i, jobs) for i in range(3)]
    launch = launching.plan(subs, SITE)[0]
    launch.files.mkdir(parents=True)
    for s in launch.submissions:
        s.job_dir.mkdir()
    (launch.files / f"{launch.key}.tasks").write_text(launching.tasks_text(launch))
    script = launch.files / f"{launch.key}.sh"
    script.write_text(launching.job_script(launch, stand_in_python(drop_root.parent)))
    return launch, script


def test_the_job_script_maps_each_array_task_to_its_job_folder_whatever_the_path(
    drop_root: Path,
) -> None:
    """The generated script run by bash as Slurm would run it (task id in the environment),
    with ``echo`` standing in for the job: the task runs in its own job folder, logs there,
    and gets the folder as one argument however awkward its path."""
    launch, script = array_on_disk(drop_root)
    jobs = launch.jobs_dir
    env = {"PATH": os.environ["PATH"], "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "77"}
    subprocess.run(["bash", str(script)], env=env, check=True, cwd=drop_root)
    log = (jobs / "b000001-infer-0002" / "log.txt").read_text()
    assert "watchd: Slurm job 77 task 2" in log
    assert f"-m pipelines.infer {jobs / 'b000001-infer-0002'}\n" in log
    assert not (drop_root / "x").exists() and not list(jobs.glob("*/x"))
    env["SLURM_ARRAY_TASK_ID"] = "5"
    missing = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert missing.returncode == 3 and "no job for task 5" in missing.stderr


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_the_job_script_refuses_a_log_that_is_a_link_or_fifo_and_writes_nothing_there(
    drop_root: Path, tmp_path: Path, planted: str
) -> None:
    """(The spool is the service's alone; all the same:) a ``log.txt`` that is a link to a file
    the daemon's user may write (the registry's weights) is not appended to, a FIFO does not
    block the task; the task ends at once with exit status 3, before the job runs."""
    launch, script = array_on_disk(drop_root)
    log = launch.jobs_dir / "b000001-infer-0001" / "log.txt"
    weights = tmp_path / "weights.pt"
    weights.write_bytes(b"model bytes")
    if planted == "link":
        log.symlink_to(weights)
    else:
        os.mkfifo(log)
    env = {"PATH": os.environ["PATH"], "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "78"}
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 3, done.stderr
    what = "a symbolic link" if planted == "link" else "a FIFO"
    assert f"the job's log cannot be opened: 'log.txt' is {what}, not a regular file" in (
        done.stderr
    )
    assert weights.read_bytes() == b"model bytes" and "pipelines.infer" not in done.stdout


def test_training_runs_under_srun_and_other_jobs_do_not() -> None:
    jobs = Path("/j")
    train = launching.plan([sub(1, jobs, group="b1-train", module="pipelines.train")], SITE)[0]
    infer = launching.plan([sub(2, jobs)], SITE)[0]
    assert (
        '-- \\\n  srun --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" "$python"'
        in launching.job_script(train, "/p")
    )
    assert '-- \\\n  "$python" -m "$module" "$job_dir"' in launching.job_script(infer, "/p")
