"""Each batch owner's account, QOS, partition and share of the array throttle in what goes to
Slurm, and sacct's word on the jobs, as pure functions on strings."""

from __future__ import annotations

from pathlib import Path

from daemon.contract.jobspec import Pipeline
from daemon.core.owners import Charge
from daemon.executors import Submission
from daemon.executors import slurm_launch as launching
from daemon.executors.pyslurm_client import submit_fields
from daemon.executors.slurm_accounting import parse_sacct, sacct_args
from daemon.executors.slurm_cli import sbatch_args
from daemon.site.config import SlurmExecutorSection

SITE = SlurmExecutorSection(partition="cpu", account="service", array_throttle=50)
JOBS = Path("/spool/runs/b1/r/jobs")
ANN = Charge(account="imaging", qos="high", partition="gpu")
NONE = Charge()


def sub(i: int, charge: Charge = NONE, throttle: int = 0) -> Submission:
    group = "b000001-infer"
    name = f"{group}-{i:04d}"
    return Submission(i, name, Pipeline.INFER.module, JOBS / name, group=group, attempt=1,
                      charge=charge, throttle=throttle)  # fmt: skip


def test_an_owners_account_qos_and_partition_go_to_sbatch_and_pyslurm() -> None:
    (launch,) = launching.plan([sub(0, ANN), sub(1, ANN)], SITE)
    request = launching.request(launch, SITE, Path("/s.sh"), {})
    assert (request.account, request.qos, request.partition) == ("imaging", "high", "gpu")
    args = sbatch_args(request)
    assert {"--account=imaging", "--qos=high", "--partition=gpu"} <= set(args)
    fields = submit_fields(request)
    assert (fields["account"], fields["qos"], fields["partitions"]) == ("imaging", "high", "gpu")


def test_an_owner_the_table_says_nothing_of_goes_out_under_the_sites_own_settings() -> None:
    (launch,) = launching.plan([sub(0)], SITE)
    request = launching.request(launch, SITE, Path("/s.sh"), {})
    assert (request.account, request.qos, request.partition) == ("service", "", "cpu")
    assert not any(a.startswith("--qos") for a in sbatch_args(request))
    assert "qos" not in submit_fields(request)


def test_jobs_charged_differently_never_share_an_array() -> None:
    launches = launching.plan([sub(0, ANN), sub(1, Charge(account="phys")), sub(2, ANN)], SITE)
    assert sorted(len(x.submissions) for x in launches) == [1, 2]
    assert {x.charge.account for x in launches} == {"imaging", "phys"}


def test_an_owners_share_of_the_throttle_applies_below_the_sites() -> None:
    (mine,) = launching.plan([sub(0, ANN, throttle=8), sub(1, ANN, throttle=8)], SITE)
    assert launching.request(mine, SITE, Path("/s.sh"), {}).array == "0-1%8"
    (big,) = launching.plan([sub(0, ANN, throttle=80), sub(1, ANN, throttle=80)], SITE)
    assert launching.request(big, SITE, Path("/s.sh"), {}).array == "0-1%50"
    assert launching.throttle(0, 8) == 8 and launching.throttle(0, 0) == 0


def test_sacct_lines_give_each_jobs_account_cpu_and_gpu_seconds() -> None:
    text = (
        "123_0|imaging|240|120|billing=2,cpu=2,gres/gpu=1,mem=1G,node=1\n"
        "123_1|imaging|60|60|cpu=1,mem=1G,node=1\n"
        "124|phys|bad|1|cpu=1\n"
        "garbage\n"
    )
    lines = parse_sacct(text)
    assert [(x.job, x.account, x.cpu_s, x.gpu_s) for x in lines] == [
        ("123_0", "imaging", 240.0, 120.0), ("123_1", "imaging", 60.0, 0.0),
    ]  # fmt: skip
    assert sacct_args(["123_0", "124"])[4] == "--jobs=123_0,124"
