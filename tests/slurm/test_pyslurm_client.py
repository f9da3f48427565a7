"""The pyslurm client's translation as pure code (no pyslurm needed), and its import guard."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import tomli_w

from daemon.contract.errors import ExecutorUnavailable
from daemon.executors import pyslurm_client
from daemon.executors.pyslurm_client import (
    PyslurmClient,
    arrays_to_cancel,
    expand,
    load,
    records_of,
    submit_fields,
    transient,
)
from daemon.executors.slurm import choose_client
from daemon.executors.slurm_api import JobRecord, JobRequest
from daemon.site.config import SlurmExecutorSection


def test_a_request_becomes_job_submit_description_fields_with_sbatchs_meaning() -> None:
    request = JobRequest(
        name="b000001-train", comment="watchd:b000001-train:0123456789abcdef",
        script=Path("/share/b/jobs/slurm/k.sh"), work_dir=Path("/share/b/jobs"),
        output="slurm/k-%j.out", time_minutes=90, memory_mb=4096, cpus_per_task=4, ntasks=2,
        gpus=2, partition="gpu", account="lab", constraint="v100",
        environment={"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm/slurm.conf"},
    )  # fmt: skip
    assert submit_fields(request) == {
        "name": "b000001-train", "comment": "watchd:b000001-train:0123456789abcdef",
        "script": "/share/b/jobs/slurm/k.sh", "working_directory": "/share/b/jobs",
        "standard_output": "slurm/k-%j.out", "time_limit": 90, "memory_per_node": 4096,
        "cpus_per_task": 4, "ntasks": 2, "is_requeueable": False,
        "environment": {"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm/slurm.conf"},
        "gres_per_node": "gpu:2", "partitions": "gpu", "account": "lab", "constraints": "v100",
    }  # fmt: skip
    assert isinstance(submit_fields(request)["time_limit"], int)  # pyslurm 22.5 refuses "90"


def test_an_array_request_keeps_its_throttle_and_leaves_unset_options_out() -> None:
    request = JobRequest(
        name="b1-infer", comment="c", script=Path("/s.sh"), work_dir=Path("/w"),
        output="slurm/k-%A_%a.out", time_minutes=5, memory_mb=512, array="0-859%50",
    )  # fmt: skip
    fields = submit_fields(request)
    assert fields["array"] == "0-859%50"
    assert not {"gres_per_node", "partitions", "account", "constraints"} & fields.keys()


def test_jobs_become_records_one_per_task_with_pending_array_tasks_expanded() -> None:
    jobs = [
        {"id": 40, "array_id": None, "state": "RUNNING", "state_reason": "None",
         "exit_code": 0, "comment": "watchd:b1-train:0123456789abcdef", "user_id": 0},
        # the array's pending tasks share one record; task 0 runs with array_task_id None
        {"id": 41, "array_id": 41, "array_tasks_waiting": "2-3,5", "array_task_id": None,
         "state": "PENDING", "state_reason": "JobArrayTaskLimit", "exit_code": 0,
         "comment": "watchd:b1-infer:fedcba9876543210", "user_id": 0},
        {"id": 42, "array_id": 41, "array_tasks_waiting": None, "array_task_id": None,
         "state": "RUNNING", "state_reason": None, "exit_code": 0, "comment": "k", "user_id": 0},
        {"id": 43, "array_id": 41, "array_tasks_waiting": None, "array_task_id": 1,
         "state": "FAILED", "state_reason": "NonZeroExitCode", "exit_code": 1, "comment": "k",
         "user_id": 0},
        {"id": 44, "array_id": None, "state": "RUNNING", "user_id": 1000},  # someone else's
    ]  # fmt: skip
    records = records_of(jobs, uid=0)
    assert [r.id for r in records] == ["40", "41_2", "41_3", "41_5", "41_0", "41_1"]
    assert records[1] == JobRecord(
        "41_2", "PENDING", "JobArrayTaskLimit", 0, "watchd:b1-infer:fedcba9876543210"
    )
    assert records[-1] == JobRecord("41_1", "FAILED", "NonZeroExitCode", 1, "k")
    assert records[4].reason == ""


def test_task_lists_expand_with_ranges_steps_and_throttles() -> None:
    assert expand("1,3,5-7") == [1, 3, 5, 6, 7]
    assert expand("0-6:3%2") == [0, 3, 6]
    assert expand("9") == [9] and expand("") == []


def test_rpc_errors_of_an_absent_or_busy_controller_are_transient() -> None:
    assert transient(1800, "Unable to contact slurm controller (connect failure)")
    assert transient(11, "Resource temporarily unavailable")
    assert transient(None, "Socket timed out on send/recv operation")
    assert not transient(2017, "Invalid job id specified")
    assert not transient(2081, "Invalid job array specification")


def test_cancelling_array_tasks_signals_each_array_once() -> None:
    assert arrays_to_cancel(["41_2", "41_3", "40", "45_0"]) == [40, 41, 45]


class StandInPyslurm(types.ModuleType):
    """The part of pyslurm's object API a cancel uses, answering as pyslurm 22.5 does: jobs in
    ``errnos`` raise RPCError with that errno, the others are cancelled."""

    class RPCError(Exception):
        def __init__(self, msg: str, errno: int) -> None:
            super().__init__(msg)
            self.errno = errno

    def __init__(self, errnos: dict[int, int]) -> None:
        super().__init__("pyslurm")
        self.errnos = errnos
        self.cancelled: list[int] = []
        module = self

        class Job:
            def __init__(self, job_id: int) -> None:
                self.job_id = job_id

            def cancel(self) -> None:
                if self.job_id in module.errnos:
                    raise module.RPCError(
                        f"errno {module.errnos[self.job_id]}", module.errnos[self.job_id]
                    )
                module.cancelled.append(self.job_id)

        self.Job = Job


def test_a_cancel_of_a_job_slurm_forgot_or_already_ended_is_delivered_not_an_outage() -> None:
    """A kept cancel is sent again until it is delivered: a job purged meanwhile (2017) or
    ended (2021) must count as delivered, or it would hold the daemon back for good."""
    pyslurm = StandInPyslurm({40: 2017, 41: 2021})
    client = PyslurmClient(pyslurm, "22.5.3", 0)
    client.cancel(["40", "41_2", "42"])
    assert pyslurm.cancelled == [42]
    pyslurm.errnos[43] = 1800  # the controller did not answer: not delivered
    with pytest.raises(ExecutorUnavailable, match="errno 1800"):
        client.cancel(["43"])


# -- the import guard ---------------------------------------------------------------------------


def test_a_missing_slurm_conf_refuses_pyslurm_in_one_line_without_importing_it(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    with pytest.raises(ExecutorUnavailable) as caught:
        load(tmp_path / "no" / "slurm.conf", {})
    assert time.monotonic() - started < 1.0
    message = str(caught.value)
    assert message.startswith(f"pyslurm: no Slurm configuration at {tmp_path}/no/slurm.conf")
    assert "\n" not in message and "pyslurm" not in sys.modules


def test_the_config_file_is_found_from_the_config_then_slurm_conf_then_slurms_default() -> None:
    named = Path("/site/slurm.conf")
    assert pyslurm_client.config_path(named, {"SLURM_CONF": "/env.conf"}) == named
    assert pyslurm_client.config_path(None, {"SLURM_CONF": "/env.conf"}) == Path("/env.conf")
    assert pyslurm_client.config_path(None, {}) == Path("/etc/slurm/slurm.conf")


def test_pyslurm_that_cannot_be_imported_is_refused_in_one_line(tmp_path: Path) -> None:
    """The import is probed in a child process first: an ImportError there (no pyslurm, or one
    built for another Slurm) becomes one line, and this process never imports it."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=none\n")
    broken = tmp_path / "site-packages"
    broken.mkdir()  # a pyslurm whose libslurm is not this machine's, as the loader says it
    (broken / "pyslurm.py").write_text(
        "raise ImportError('libslurm.so.42: cannot open shared object file')\n"
    )
    environment = {"PATH": os.environ["PATH"], "PYTHONPATH": str(broken)}
    with pytest.raises(ExecutorUnavailable) as caught:
        load(conf, environment)
    assert str(caught.value) == (
        "pyslurm cannot be imported here: "
        "ImportError: libslurm.so.42: cannot open shared object file"
    )
    assert "pyslurm" not in sys.modules


def test_auto_falls_back_to_the_command_line_tools_when_pyslurm_is_unusable(
    tmp_path: Path,
) -> None:
    site = SlurmExecutorSection(client="auto", slurm_conf=tmp_path / "missing.conf")
    assert choose_client(site, {"PATH": os.environ["PATH"]}).name == "cli"


def test_the_daemon_refuses_to_start_with_pyslurm_and_no_slurm_conf_in_one_error_line(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    document = {
        "daemon": {"state_dir": str(tmp_path / "state"), "spool_dir": str(tmp_path / "spool")},
        "roots": [{"path": str(tmp_path / "drop")}],
        "executor": {
            "kind": "slurm",
            "slurm": {"client": "pyslurm", "slurm_conf": str(tmp_path / "gone.conf")},
        },
    }
    config.write_text(tomli_w.dumps(document))
    watchd = Path(sys.executable).parent / "watchd"
    started = time.monotonic()
    done = subprocess.run(
        [str(watchd), "run", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    assert done.stderr.startswith(f"Error: pyslurm: no Slurm configuration at {tmp_path}/gone.conf")
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
