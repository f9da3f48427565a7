"""The store's accounting: what each ended job attempt used, charged to its batch's owner, group
and account; the quotas operators set; why a queued batch is held."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from daemon.contract.usage import JobUsage
from daemon.core.owners import Accounts, Period, Quota
from daemon.core.quotas import Account, Used, period
from daemon.core.records import Batch, Job
from daemon.core.states import BatchState, JobState
from daemon.store.base import StoreBase

GROUPINGS = {"owner": "owner_user", "group": "owner_group", "account": "account"}


@dataclass(frozen=True)
class Charged:
    """Who an ended attempt is charged to."""

    user: str
    group: str
    account: str


@dataclass(frozen=True)
class UsageLine:
    """Usage summed over one owner, group or account (``key``) in a period."""

    key: str
    batches: int
    jobs: int
    images: int
    cpu_hours: float
    gpu_hours: float
    wall_hours: float
    bytes_in: int
    bytes_out: int


@dataclass(frozen=True)
class SetQuotaRecord:
    subject: str
    quota: Quota
    set_by: str
    set_at: float


class UsageStore(StoreBase):
    """Usage rows (one per ended attempt), operators' quotas and batch holds."""

    def record_usage(self, job: Job, charged: Charged, usage: JobUsage | None, now: float) -> None:
        """Charge an ended attempt (once: the same attempt recorded again is ignored). Its
        images count when it succeeded (an inference job's images)."""
        measured = usage or JobUsage()
        row = {
            "at": now, "job_id": job.id, "batch_id": job.batch_id, "attempt": job.attempts,
            "pipeline": job.pipeline.value, "state": job.state.value,
            "owner_user": charged.user, "owner_group": charged.group, "account": charged.account,
            "handle": job.handle or "", "wall_s": measured.wall_s, "cpu_s": measured.cpu_s,
            "gpu_s": measured.gpu_s, "bytes_in": measured.bytes_in,
            "bytes_out": measured.bytes_out,
            "images": job.images if job.state is JobState.SUCCEEDED else 0,
        }  # fmt: skip
        with self.atomic():
            self._table("usage").insert(row, ignore=True)

    def usage_by(self, by: str, since: float, until: float | None = None) -> list[UsageLine]:
        """Usage summed by ``owner``, ``group`` or ``account`` over attempts that ended in
        [since, until)."""
        column = GROUPINGS[by]
        rows = self.db.execute(
            f"SELECT {column}, count(DISTINCT batch_id), count(*), sum(images), sum(cpu_s),"
            " sum(gpu_s), sum(wall_s), sum(bytes_in), sum(bytes_out) FROM usage"
            f" WHERE at >= ? AND at < ? GROUP BY {column} ORDER BY {column}",
            [since, float("inf") if until is None else until],
        )
        return [
            UsageLine(str(key), int(b), int(j), int(i or 0), (cpu or 0) / 3600, (gpu or 0) / 3600,
                      (wall or 0) / 3600, int(bin_ or 0), int(bout or 0))
            for key, b, j, i, cpu, gpu, wall, bin_, bout in rows
        ]  # fmt: skip

    def handles_since(self, since: float) -> list[tuple[str, str]]:
        """(handle, account charged) of the attempts that ended since ``since`` (for sacct)."""
        rows = self.db.execute(
            "SELECT handle, account FROM usage WHERE at >= ? AND handle != ''", [since]
        )
        return [(str(h), str(a)) for h, a in rows]

    def used(self, subject: str, since: float) -> Used:
        """What a subject (``user:NAME`` or ``group:NAME``) used since ``since``: the images of
        its ended attempts and of its running batches' jobs not ended yet (committed), and the
        CPU- and GPU-hours its attempts measured."""
        kind, _, name = subject.partition(":")
        column = "owner_user" if kind == "user" else "owner_group"
        row = self.db.execute(
            f"SELECT sum(images), sum(cpu_s), sum(gpu_s) FROM usage WHERE {column} = ? AND at >= ?",
            [name, since],
        ).fetchone()
        ended = [s.value for s in JobState if s.terminal]
        committed = self.db.execute(
            f"SELECT sum(j.images) FROM jobs j JOIN batches b ON j.batch_id = b.id"
            f" WHERE b.{column} = ? AND b.state = ? AND j.state NOT IN"
            f" ({','.join('?' * len(ended))})",
            [name, BatchState.RUNNING.value, *ended],
        ).fetchone()
        images = int(row[0] or 0) + int(committed[0] or 0)
        return Used(images, (row[1] or 0) / 3600, (row[2] or 0) / 3600)

    # -- quotas set by operators (written by the daemon alone, applying their intents) ---------

    def set_quota(self, subject: str, quota: Quota | None, by: str, now: float) -> None:
        with self.atomic():
            if quota is None:
                self.db.execute("DELETE FROM quotas WHERE subject = ?", [subject])
                return
            row = {"subject": subject, "per": quota.per.value, "images": quota.images,
                   "cpu_hours": quota.cpu_hours, "gpu_hours": quota.gpu_hours, "set_by": by,
                   "set_at": now}  # fmt: skip
            self._table("quotas").upsert(row, pk="subject")

    def quota_account(self, subject: str, configured: Quota | None, now: float) -> Account | None:
        """The quota in force for a subject (an operator's, else ``configured``, the site's)
        and what it used in the quota's period; None without one."""
        rows = list(self.db.query("SELECT * FROM quotas WHERE subject = ?", [subject]))
        quota, set_by = configured, ""
        if rows:
            r = rows[0]
            quota = Quota(Period(r["per"]), r["images"], r["cpu_hours"], r["gpu_hours"])
            set_by = r["set_by"]
        if quota is None or not quota.limited:
            return None
        since, until = period(quota.per, now)
        return Account(subject, quota, self.used(subject, since), since, until, set_by)

    def quotas_of(
        self, batches: Iterable[Batch], accounts: Accounts, now: float
    ) -> dict[str, Account]:
        """The quotas in force (operators', else the site's) of the owners and groups of the
        queued ``batches``, with what each used this period: what the planner holds them by."""
        found: dict[str, Account] = {}
        for batch in batches:
            owner = batch.owned_by
            if batch.state is not BatchState.QUEUED or owner is None:
                continue
            terms = accounts.terms(owner)
            for subject, quota in ((f"user:{owner.user}", terms.user_quota),
                                   (f"group:{owner.group}", terms.group_quota)):  # fmt: skip
                if subject not in found and (held := self.quota_account(subject, quota, now)):
                    found[subject] = held
        return found

    def set_quotas(self) -> list[SetQuotaRecord]:
        rows = self.db.query("SELECT * FROM quotas ORDER BY subject")
        return [
            SetQuotaRecord(
                r["subject"],
                Quota(Period(r["per"]), r["images"], r["cpu_hours"], r["gpu_hours"]),
                r["set_by"], r["set_at"],
            )
            for r in rows
        ]  # fmt: skip

    # -- holds ---------------------------------------------------------------------------------

    def set_hold(self, batch_id: int, reason: str, now: float) -> None:
        """Record why a queued batch is held ('' : released), with a note in its history."""
        with self.atomic():
            self.db.execute("UPDATE batches SET hold = ? WHERE id = ?", [reason, batch_id])
            said = f"held: {reason}" if reason else "no longer held: it may start"
            self._event(now, batch_id, None, None, None, said)

    def owner_users(self) -> list[str]:
        """Every folder owner (user name) a batch was taken in from."""
        rows = self.db.execute(
            "SELECT DISTINCT owner_user FROM batches WHERE owner_uid IS NOT NULL ORDER BY 1"
        )
        return [str(u) for (u,) in rows]

    def subjects_with_batches(self, states: Sequence[BatchState]) -> set[tuple[str, str]]:
        """(user, group) of the batches in ``states`` (whose quotas the loop must look up)."""
        wanted = [s.value for s in states]
        rows = self.db.execute(
            f"SELECT DISTINCT owner_user, owner_group FROM batches WHERE owner_uid IS NOT NULL"
            f" AND state IN ({','.join('?' * len(wanted))})",
            wanted,
        )
        return {(str(u), str(g)) for u, g in rows}
