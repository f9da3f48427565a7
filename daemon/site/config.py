"""The daemon's configuration: loaded once at the edge, validated all at once, typed.

``config.toml`` at the top of the repository is the documented default. Relative paths are
resolved against the directory of the file that names them. Unknown keys are refused with the
valid keys listed; every problem is reported in one go.
"""

from __future__ import annotations

import enum
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import pydantic
from pydantic import AfterValidator, BeforeValidator, Field

from daemon.contract.errors import ConfigError
from daemon.core.owners import Accounts, FairBy, Period, Quota, Rule
from daemon.core.validation import problems
from daemon.site.access import denied

Seconds = Annotated[float, Field(gt=0, le=7 * 24 * 3600)]


class _Section(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class ObserverMode(enum.Enum):
    AUTO = "auto"  # polling on network filesystems (from the mount table), inotify elsewhere
    INOTIFY = "inotify"
    POLLING = "polling"


class DaemonSection(_Section):
    state_dir: Path = Path("var/state")
    # The service's own folder for what the daemon and its jobs exchange (daemon.contract.spool):
    # on a filesystem the compute nodes see, writable by the service's user alone, never inside
    # a drop root.
    spool_dir: Path = Path("var/spool")
    tick_seconds: Seconds = 1.0
    heartbeat_seconds: Seconds = 5.0
    rescan_seconds: Seconds = 300.0
    shutdown_grace_seconds: Annotated[float, Field(ge=0, le=3600)] = 30.0
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # A drop root's lease (daemon.site.claims), renewed every heartbeat, is taken over by a daemon
    # on another host once it is this old; on the same host, as soon as its holder is gone.
    lease_seconds: Seconds = 120.0

    @pydantic.model_validator(mode="after")
    def _lease_outlives_heartbeats(self) -> DaemonSection:
        if self.lease_seconds < 3 * self.heartbeat_seconds:
            raise ValueError(
                f"lease_seconds = {self.lease_seconds} is below 3 × heartbeat_seconds "
                f"({self.heartbeat_seconds}): a lease must outlive a few missed renewals"
            )
        return self

    @property
    def database(self) -> Path:
        return self.state_dir / "watchd.sqlite"


class RootSection(_Section):
    path: Path
    observer: ObserverMode = ObserverMode.AUTO
    poll_seconds: Seconds = 2.0


class IntakeSection(_Section):
    settle_seconds: Annotated[float, Field(ge=0, le=86400)] = 5.0
    timeout_seconds: Seconds = 24 * 3600.0
    check_seconds: Seconds = 2.0
    # A waiting batch whose inputs did not change is looked at less and less often, up to this;
    # a watcher event on its folder brings the next look forward.
    max_check_seconds: Seconds = 30.0
    max_manifest_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 16 << 20
    # The most entries of a batch folder its patterns may look at in one check, all together;
    # a pattern that needs more fails its batch, naming this bound.
    max_pattern_entries: Annotated[int, Field(ge=100, le=100_000_000)] = 200_000
    # How long the folder of an ended batch stays watched for a changed manifest; after that
    # the catch-up scan (daemon.rescan_seconds) finds one.
    watch_ended_seconds: Annotated[float, Field(ge=0, le=30 * 86400)] = 900.0
    # A batch folder or manifest the service may not read is looked at again this often, so
    # that one fixed (its ACLs set) is taken in at once, not at the next catch-up scan.
    retry_unreadable_seconds: Annotated[float, Field(ge=1, le=3600)] = 30.0
    # A batch folder under way is looked at this often for its owner's watchd-cancel file (and
    # at once when the watcher reports a change in it).
    cancel_check_seconds: Annotated[float, Field(ge=0.1, le=3600)] = 10.0


class PlannerSection(_Section):
    # 0: an inference batch is split into as many jobs as run side by side (the executor's
    # width), each of at most max_shard_size images; N: jobs of N images.
    shard_size: Annotated[int, Field(ge=0, le=100_000)] = 0
    max_shard_size: Annotated[int, Field(ge=1, le=1_000_000)] = 2000
    # an image file larger than this many bytes (a whole-slide image) is segmented by several
    # jobs, one region each, then assembled; 0: every image by one job
    region_bytes: Annotated[int, Field(ge=0)] = 1 << 30
    max_attempts: Annotated[int, Field(ge=1, le=20)] = 3


@dataclass(frozen=True)
class JobShapes:
    """GPUs and tasks jobs get when their manifest's ``[resources]`` does not say."""

    training_gpus: int = 0
    training_tasks: int = 1
    inference_gpus: int = 0


NO_SITE_SHAPES = JobShapes()  # one training task, no GPU


class LocalExecutorSection(_Section):
    max_parallel: Annotated[int, Field(ge=1, le=256)] = 2
    cpus_per_job: Annotated[int, Field(ge=1, le=256)] = 1
    python: str = ""  # interpreter that runs the pipelines; empty: the daemon's own
    max_tasks: Annotated[int, Field(ge=1, le=64)] = 2  # DDP processes one training job may start
    max_gpus: Annotated[int, Field(ge=0, le=64)] = 0  # GPUs a manifest may ask for, per job
    # GPUs an inference job uses when its manifest does not say: 0 runs it on the CPU; N > 0
    # on its GPUs (daemon/executors/gpus.py)
    inference_gpus: Annotated[int, Field(ge=0, le=64)] = 0
    # A job is ended when it runs longer than its manifest's [resources] time_minutes, else
    # than this (a manifest may ask up to max_time_minutes) ...
    time_minutes: Annotated[int, Field(ge=1, le=365 * 24 * 60)] = 24 * 60
    max_time_minutes: Annotated[int, Field(ge=1, le=365 * 24 * 60)] = 7 * 24 * 60
    # ... or when neither its log nor its progress file changed for this long (0: never).
    stall_minutes: Annotated[float, Field(ge=0, le=7 * 24 * 60)] = 60.0
    # GPUs of this machine handed to the jobs, CUDA's 0 … gpus-1, each job its own
    # (CUDA_VISIBLE_DEVICES), at most jobs_per_gpu jobs on one; 0: every job sees every GPU
    gpus: Annotated[int, Field(ge=0, le=64)] = 0
    jobs_per_gpu: Annotated[int, Field(ge=1, le=64)] = 1
    # Inference jobs' launchers kept started ahead, torch imported (daemon/executors/spares.py):
    # the next job is forked from one, without 1-2 s of imports; 0: every job starts cold
    warm_starts: Annotated[int, Field(ge=0, le=64)] = 1
    # Inference nets kept on their GPUs across jobs, one process per GPU (one in all without
    # gpus): CUDA's start, the model's load and the precision's check once per model, not per
    # shard (daemon/executors/resident.py); at a daemon's restart its jobs load their own
    resident_device: bool = False

    @pydantic.model_validator(mode="after")
    def _defaults_within_bounds(self) -> LocalExecutorSection:
        if self.inference_gpus > self.max_gpus:
            raise ValueError(
                f"inference_gpus = {self.inference_gpus} is above max_gpus = {self.max_gpus}"
            )
        if self.time_minutes > self.max_time_minutes:
            raise ValueError(
                f"time_minutes = {self.time_minutes} is above max_time_minutes = "
                f"{self.max_time_minutes}"
            )
        if self.gpus and self.max_gpus > self.gpus:
            raise ValueError(
                f"max_gpus = {self.max_gpus} is above gpus = {self.gpus}: such a job would "
                "never start"
            )
        return self


Minutes = Annotated[int, Field(ge=1, le=365 * 24 * 60)]
MegaBytes = Annotated[int, Field(ge=1, le=1 << 30)]
Count = Annotated[int, Field(ge=0, le=1024)]


class SlurmExecutorSection(_Section):
    """Jobs go to Slurm: inference shards as one job array per batch, training as one job.

    ``time_minutes``, ``memory_mb``, ``gpus`` and ``tasks`` are the defaults; a manifest's
    ``[resources]`` table may ask for other values up to the ``max_*`` bounds (see
    docs/slurm.md). A job Slurm says has ended is given ``result_grace_seconds`` for its result
    file to show on the share (attribute caching on NFS) before it counts as lost.
    """

    client: Literal["auto", "pyslurm", "cli"] = "auto"
    slurm_conf: Path | None = None  # the cluster's slurm.conf; unset: SLURM_CONF or Slurm's own
    python: str = ""  # interpreter on the compute nodes; empty: the daemon's own
    partition: str = ""  # empty: the cluster's default partition
    account: str = ""
    constraint: str = ""  # Slurm --constraint (node features)
    cpus_per_task: Annotated[int, Field(ge=1, le=256)] = 1
    # CPUs of each inference task (its workers read, decode and finish beside the net); 0: as
    # cpus_per_task. On a GPU node, what it takes to feed the GPU (docs/slurm.md)
    inference_cpus_per_task: Annotated[int, Field(ge=0, le=256)] = 0
    time_minutes: Minutes = 60
    max_time_minutes: Minutes = 24 * 60
    memory_mb: MegaBytes = 4096
    max_memory_mb: MegaBytes = 64 * 1024
    gpus: Count = 0  # GPUs of a training job (--gres=gpu:N)
    inference_gpus: Count = 0  # GPUs of each inference task (--gres=gpu:N); 0: on the CPU
    max_gpus: Count = 8
    tasks: Annotated[int, Field(ge=1, le=1024)] = 1  # tasks of a training job (srun, DDP)
    max_tasks: Annotated[int, Field(ge=1, le=1024)] = 1
    array_throttle: Annotated[int, Field(ge=0, le=100_000)] = 50  # %K; 0: no throttle
    # Jobs the service keeps in Slurm at once (0: no limit, Slurm queues them all): a number
    # gives the daemon's fair order (and its yielding) that many slots to share out.
    max_jobs: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    max_array_tasks: Annotated[int, Field(ge=1, le=1_000_000)] = 1000  # below MaxArraySize
    poll_seconds: Seconds = 10.0  # at most one status query this often
    result_grace_seconds: Annotated[float, Field(ge=0, le=3600)] = 30.0  # see below
    command_timeout_seconds: Seconds = 60.0
    retry_attempts: Annotated[int, Field(ge=1, le=10)] = 3  # tries of one call, if they fail fast
    retry_wait_seconds: Seconds = 1.0  # first pause after an unreachable controller; doubles
    max_backoff_seconds: Seconds = 120.0  # the longest pause between tries
    # Slurm refusing a job (bad partition, a limit) this many times, max_backoff_seconds apart,
    # fails it with Slurm's message, and its batch with it.
    max_refusals: Annotated[int, Field(ge=1, le=100)] = 3

    @property
    def shapes(self) -> JobShapes:
        """GPUs and tasks of its jobs when their manifest does not say."""
        return JobShapes(self.gpus, self.tasks, self.inference_gpus)

    def cpus(self, inference: bool) -> int:
        """CPUs of each task of a job: an inference job's own when set."""
        return (self.inference_cpus_per_task if inference else 0) or self.cpus_per_task

    @pydantic.model_validator(mode="after")
    def _defaults_within_bounds(self) -> SlurmExecutorSection:
        pairs = [
            ("time_minutes", self.time_minutes, "max_time_minutes", self.max_time_minutes),
            ("memory_mb", self.memory_mb, "max_memory_mb", self.max_memory_mb),
            ("gpus", self.gpus, "max_gpus", self.max_gpus),
            ("inference_gpus", self.inference_gpus, "max_gpus", self.max_gpus),
            ("tasks", self.tasks, "max_tasks", self.max_tasks),
        ]
        for name, value, bound_name, bound in pairs:
            if value > bound:
                raise ValueError(f"{name} = {value} is above {bound_name} = {bound}")
        return self


def _slurm_name(value: str | None) -> str | None:
    if value and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}", value):
        raise ValueError("must be a Slurm name: letters, digits, '_', '.', '+', '-'")
    return value


SlurmName = Annotated[str | None, AfterValidator(_slurm_name)]


class QuotaSection(_Section):
    """What an owner or group may use per calendar period (UTC); unset: no limit on it."""

    per: Literal["day", "month"] = "month"
    images: Annotated[int, Field(ge=0)] | None = None
    cpu_hours: Annotated[float, Field(ge=0)] | None = None
    gpu_hours: Annotated[float, Field(ge=0)] | None = None

    def quota(self) -> Quota:
        return Quota(Period(self.per), self.images, self.cpu_hours, self.gpu_hours)


class AccountRule(_Section):
    """One row of the site's table of owners: unset values come from the group's row, then
    the default."""

    account: SlurmName = None  # sbatch --account
    qos: SlurmName = None  # sbatch --qos
    partition: SlurmName = None  # sbatch --partition (else executor.slurm.partition)
    weight: Annotated[float, Field(gt=0, le=1000)] | None = None  # share of the slots
    max_running: Annotated[int, Field(ge=0, le=1_000_000)] | None = None  # 0: no cap
    array_throttle: Annotated[int, Field(ge=0, le=100_000)] | None = None  # 0: the site's
    quota: QuotaSection | None = None

    def rule(self) -> Rule:
        return Rule(self.account, self.qos, self.partition, self.weight, self.max_running,
                    self.array_throttle, self.quota.quota() if self.quota else None)  # fmt: skip


class AccountsSection(_Section):
    """Who is charged for a batch and how owners share the slots (daemon.core.owners): a batch's
    owner is its folder's user and group on the share, never the manifest's [owner]."""

    fair_by: Literal["owner", "group"] = "owner"  # whose turn it is
    unknown: Literal["default", "refuse"] = "default"  # an owner in neither table
    preempt: bool = True  # an owner over its share yields an inference job to one below it
    # … unless a live job is due to end within this many seconds of the waiting one's queueing
    preempt_grace_seconds: Annotated[float, Field(ge=0, le=86_400)] = 30.0
    default: AccountRule = AccountRule()
    users: dict[str, AccountRule] = {}
    groups: dict[str, AccountRule] = {}

    def table(self) -> Accounts:
        return Accounts(
            default=self.default.rule(),
            users={name: rule.rule() for name, rule in self.users.items()},
            groups={name: rule.rule() for name, rule in self.groups.items()},
            refuse_unknown=self.unknown == "refuse",
            fair_by=FairBy(self.fair_by),
            preempt=self.preempt,
            preempt_grace=self.preempt_grace_seconds,
        )


class ExecutorSection(_Section):
    kind: Literal["local", "slurm"] = "local"
    local: LocalExecutorSection = LocalExecutorSection()
    slurm: SlurmExecutorSection = SlurmExecutorSection()


class RegistrySection(_Section):
    path: Path = Path("var/registry")


class JobsSection(_Section):
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"


class MetricsSection(_Section):
    """The Prometheus endpoint (off by default)."""

    enabled: bool = False
    address: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 9464  # 0: any free port (it is logged)


def _address(value: str) -> str:
    if value and not re.match(r"^[^@\s]+@[^@\s]+$", value):
        raise ValueError("must be an e-mail address such as watchd@example.org")
    return value


class MailSection(_Section):
    """E-mail to a batch's owner when it ends (off by default). The password is never in the
    config: ``password_file`` names a file that holds it (e.g. a systemd credential)."""

    enabled: bool = False
    host: str = "localhost"
    port: Annotated[int, Field(ge=1, le=65535)] = 25
    sender: Annotated[str, AfterValidator(_address)] = Field(default="", alias="from")
    starttls: bool = False
    username: str = ""
    password_file: Annotated[Path | None, BeforeValidator(lambda v: v or None)] = None  # "": none
    timeout_seconds: Annotated[float, Field(gt=0, le=600)] = 30.0

    @pydantic.model_validator(mode="after")
    def _complete(self) -> MailSection:
        if self.enabled and not self.sender:
            raise ValueError("'from' is needed when mail is enabled")
        if self.username and self.password_file is None:
            raise ValueError("'username' needs 'password_file' (never a password in the config)")
        return self


class Config(_Section):
    daemon: DaemonSection = DaemonSection()
    roots: tuple[RootSection, ...]
    intake: IntakeSection = IntakeSection()
    planner: PlannerSection = PlannerSection()
    executor: ExecutorSection = ExecutorSection()
    registry: RegistrySection = RegistrySection()
    jobs: JobsSection = JobsSection()
    metrics: MetricsSection = MetricsSection()
    mail: MailSection = MailSection()
    accounts: AccountsSection = AccountsSection()
    source: Path = Field(default=Path("config.toml"), exclude=True)


def load_config(path: Path) -> Config:
    """Read, validate and resolve ``path``; raise ConfigError listing every problem."""
    path = Path(path).absolute()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(path), ["file not found"]) from None
    except PermissionError:
        raise denied(path, "the configuration") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(str(path), [str(exc)]) from None
    return parse_config(data, source=path)


def parse_config(data: dict[str, object], *, source: Path) -> Config:
    """Validate a parsed TOML document; relative paths are taken from ``source``'s folder."""
    if "source" in data:
        raise ConfigError(str(source), ["unknown key 'source'"])
    try:
        config = Config.model_validate({**data, "source": source})
    except pydantic.ValidationError as exc:
        raise ConfigError(str(source), [f"{w}: {m}" for w, m in problems(exc, Config)]) from None
    return _resolved(config, source.parent)


def _resolved_executor(
    section: ExecutorSection, absolute: Callable[[Path], Path]
) -> ExecutorSection:
    conf = section.slurm.slurm_conf
    if conf is None:
        return section
    slurm = section.slurm.model_copy(update={"slurm_conf": absolute(conf)})
    return section.model_copy(update={"slurm": slurm})


def _resolved(config: Config, base: Path) -> Config:
    def absolute(p: Path) -> Path:
        return p if p.is_absolute() else (base / p).resolve()

    roots = tuple(r.model_copy(update={"path": absolute(r.path)}) for r in config.roots)
    seen: set[Path] = set()
    clashes = [] if roots else ["roots: at least one drop root is needed"]
    for i, root in enumerate(roots):
        if root.path in seen:
            clashes.append(f"roots[{i}].path: {root.path} is listed twice")
        seen.add(root.path)
    spool = absolute(config.daemon.spool_dir)
    for i, root in enumerate(roots):
        if spool.is_relative_to(root.path) or root.path.is_relative_to(spool):
            clashes.append(
                f"daemon.spool_dir: {spool} overlaps roots[{i}].path {root.path}: the spool is "
                "the service's own, out of the data owners' reach; put it beside the drop roots"
            )
    if clashes:
        raise ConfigError(str(config.source), clashes)
    return config.model_copy(
        update={
            "roots": roots,
            "daemon": config.daemon.model_copy(
                update={"state_dir": absolute(config.daemon.state_dir), "spool_dir": spool}
            ),
            "registry": config.registry.model_copy(update={"path": absolute(config.registry.path)}),
            "executor": _resolved_executor(config.executor, absolute),
            "mail": config.mail.model_copy(
                update={
                    "password_file": config.mail.password_file
                    and absolute(config.mail.password_file)
                }
            ),
        }
    )
