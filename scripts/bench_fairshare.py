"""Benchmark: two owners on one daemon. Owner A drops ``--images-a`` images; owner B drops
``--images-b`` images ``--delay`` seconds later. Targets (issue 27): B's batch done within 2× the
time it takes alone, A's within 1.1× of its time alone.

Each owner is a real unprivileged user made here (useradd; root only), whose batch folder is
theirs as an expert's copy leaves it; the site's table charges A to account ``lab-a`` and B's
group to ``lab-b``. One daemon (this checkout, its default configuration but for the paths and
the table) runs three scenarios in turn, ``--rounds`` times: B alone, A alone, A then B. Times
are the daemon's own events: manifest landed → batch DONE. The table gives each owner's time
with the other against its time alone (medians over the rounds), the shards that yielded their
slot, and then ``watchctl usage`` of the whole run, by owner and by account.

``--baseline-grace S`` adds, each round, A then B again on the same daemon restarted with
``[accounts] preempt_grace_seconds = S`` (0: a slot is taken back at once, as before the grace
existed): the candidate and its baseline in one run.

``--slurm``: the jobs go to the local test cluster (scripts/slurm-cluster must run) through the
CLI client, ``executor.slurm.max_jobs`` = ``--slots`` (the fair order's slots; Slurm would queue
everything otherwise) and the array throttle the same; the accounts Slurm recorded on the jobs
are listed (``squeue --states=all -o %a``).

    .venv/bin/python scripts/bench_fairshare.py                       # local, 20,000 + 50
    .venv/bin/python scripts/bench_fairshare.py --slurm --slots 2     # on the test cluster
    .venv/bin/python scripts/bench_fairshare.py --images-a 400 --images-b 10 --delay 5  # a check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import owners
import synth
from bench_batch import ARCHITECTURE, MODEL, BatchDaemon, wait_done
from slurm_scenario import start_cluster

from daemon.core.manifest import CANCEL_NAME, STATUS_NAME
from daemon.site.config import AccountsSection
from models import registry
from models.unet import UNet

REPO = Path(__file__).resolve().parent.parent
WATCHCTL = str(REPO / ".venv/bin/watchctl")


@dataclass
class OwnersDaemon(BatchDaemon):
    """The benchmark's daemon: its defaults, the paths, and the site's table of owners."""

    accounts: dict[str, object] | None = None

    def config(self, **intake: object) -> Path:
        import tomllib

        import tomli_w

        path = super().config(**intake)
        document = tomllib.loads(path.read_text())
        if self.accounts is not None:
            document["accounts"] = self.accounts
        path.write_text(tomli_w.dumps(document))
        return path


def template(work: Path, name: str, images: int, size: int, seed: int) -> Path:
    """A staged batch: ``images`` synthetic images and a manifest written by watchctl."""
    folder = work / "templates" / name
    synth.make_batch(folder, "inference", images, size, seed=seed)
    subprocess.run(
        [WATCHCTL, "manifest", str(folder), "--kind", "inference", "--model", MODEL,
         "--owner", f"Owner {name}", "--title", f"{images} images of {name}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return folder


def drop(staged: Path, root: Path, name: str, person: owners.Person) -> float:
    """Copy the images in as ``person``'s folder, then rename the manifest into place: when
    it landed."""
    folder = root / name
    shutil.copytree(staged / "images", folder / "images")
    shutil.copy(staged / "manifest.toml", folder / ".manifest.part")
    owners.hand_over(folder, person)
    landed = time.time()
    os.rename(folder / ".manifest.part", folder / "manifest.toml")
    return landed


def scenario(
    daemon: BatchDaemon, plan: list[tuple[str, Path, owners.Person, float]], timeout: float
) -> dict[str, float]:
    """Drop each (folder, template, owner) at its delay; manifest → done of each, in s."""
    start, landed = time.monotonic(), {}
    for name, staged, person, delay in sorted(plan, key=lambda p: p[3]):
        time.sleep(max(0.0, start + delay - time.monotonic()))
        landed[name] = drop(staged, daemon.mount, name, person)
    return {name: wait_done(daemon, name, timeout) - at for name, at in landed.items()}


def yielded(daemon: BatchDaemon, folder: str) -> int:
    rows = daemon.query(
        "SELECT count(*) FROM events e JOIN batches b ON e.batch_id = b.id"
        " WHERE b.folder = ? AND e.reason LIKE 'yielded its slot%'",
        folder,
    )
    return int(rows[0][0]) if rows else 0  # type: ignore[call-overload]


def held(daemon: BatchDaemon, folder: str, timeout: float) -> str:
    """The hold the daemon put on ``folder``'s batch (its quota line), once it is there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = daemon.query("SELECT hold FROM batches WHERE folder = ? AND hold != ''", folder)
        if rows:
            return str(rows[0][0])
        time.sleep(0.2)
    raise SystemExit(f"{folder} not held by a quota in {timeout:.0f} s")


def status_saying(folder: Path, words: str, timeout: float = 120.0) -> str:
    """The batch's status file once it says ``words`` (it follows the state within a tick)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = folder / STATUS_NAME
        text = path.read_text() if path.exists() else ""
        if words in text:
            return text
        time.sleep(0.2)
    raise SystemExit(f"{folder.name}/{STATUS_NAME} does not say {words!r} in {timeout:.0f} s")


def over_quota(daemon: BatchDaemon, staged: Path, person: owners.Person, images: int) -> str:
    """Owner B's quota set (by an operator, watchctl quota) to what B has used today, and one
    more of B's batches dropped: the status file as B reads it while the quota holds it, then
    as B reads it after cancelling it themselves (a watchd-cancel file of theirs)."""
    config = str(daemon.state / "config.toml")
    subject = f"user:{person.user}"
    said = subprocess.run([WATCHCTL, "quota", subject, "--images", str(images),
                           "--per", "day", "--config", config],
                          capture_output=True, text=True)  # fmt: skip
    while not daemon.query("SELECT 1 FROM quotas WHERE subject = ?", subject):
        time.sleep(0.2)  # the daemon applies the intent at its next tick
    name = "b-over-quota"
    drop(staged, daemon.mount, name, person)
    held(daemon, name, 120.0)
    folder = daemon.mount / name
    status = status_saying(folder, "Held:")
    quota = subprocess.run([WATCHCTL, "quota", "--config", config], capture_output=True,
                           text=True)  # fmt: skip
    (folder / CANCEL_NAME).touch()
    os.chown(folder / CANCEL_NAME, person.uid, person.gid)
    cancelled = status_saying(folder, "CANCELLED")
    return (
        f"$ watchctl quota user:{person.user} --images {images} --per day\n{said.stdout}"
        f"{said.stderr}\n$ watchctl quota\n{quota.stdout}{quota.stderr}\n"
        f"--- {name}/{STATUS_NAME}, held by the quota ---\n{status}\n"
        f"--- {name}/{STATUS_NAME}, after {person.user} made {CANCEL_NAME} ---\n"
        f"{cancelled}"
    )


def slurm_accounts(daemon: BatchDaemon, env: dict[str, str]) -> list[str]:
    """Each Slurm job the daemon submitted (array tasks folded), with the account Slurm
    recorded on it: from squeue while the controller remembers it."""
    handles = daemon.query(
        "SELECT DISTINCT b.folder, j.handle FROM jobs j JOIN batches b ON j.batch_id = b.id"
        " WHERE j.handle LIKE 'slurm:%' ORDER BY j.handle"
    )
    ids = sorted({str(h).removeprefix("slurm:").split("_")[0] for _, h in handles})
    if not ids:
        return []
    out = subprocess.run(
        ["squeue", "--states=all", "--noheader", "--array", f"--jobs={','.join(ids)}",
         "--format=%i|%a|%q|%j"], env=env, capture_output=True, text=True,
    ).stdout  # fmt: skip
    folders = {str(h).removeprefix("slurm:"): f for f, h in handles}
    lines = []
    for line in out.splitlines():
        job, account, qos, name = (p.strip() for p in line.split("|", 3))
        lines.append(
            f"{job:<10} account={account:<8} qos={qos:<8} {name} ({folders.get(job, '?')})"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images-a", type=int, default=20_000)
    parser.add_argument("--images-b", type=int, default=50)
    parser.add_argument("--delay", type=float, default=30.0, help="B's drop after A's, in s")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--slurm", action="store_true", help="jobs to the local test cluster")
    parser.add_argument("--slots", type=int, default=2, help="Slurm: executor.slurm.max_jobs")
    parser.add_argument("--timeout", type=float, default=7200.0)
    parser.add_argument("--baseline-grace", type=float, default=None,
                        help="also run A then B with this preempt_grace_seconds (0: at once)")
    args = parser.parse_args()
    if not owners.available():
        raise SystemExit("needs root: the owners are real users made with useradd")
    slurm_conf = start_cluster() if args.slurm else None
    work = Path(tempfile.mkdtemp(prefix="watchd-bench-fairshare-"))
    torch.manual_seed(0)
    net = UNet(**ARCHITECTURE).eval()
    registry.register(work / "registry", MODEL, net.state_dict(),
                      {"architecture": net.architecture()})  # fmt: skip
    a_staged = template(work, "a", args.images_a, args.size, seed=7)
    b_staged = template(work, "b", args.images_b, args.size, seed=8)
    with owners.made("wdf", 2) as (ann, bob):
        accounts = {"users": {ann.user: {"account": "lab-a"}},
                    "groups": {bob.group: {"account": "lab-b"}}}  # fmt: skip
        daemon = OwnersDaemon("fair", REPO, work / "fair", work / "fair" / "drop",
                              work / "fair" / "state", registry=work / "registry",
                              accounts=accounts)  # fmt: skip
        env = dict(os.environ)
        if slurm_conf is not None:
            env["SLURM_CONF"] = str(slurm_conf)
            daemon.env = {"SLURM_CONF": str(slurm_conf)}
            daemon.slurm = {"client": "cli", "slurm_conf": str(slurm_conf),
                            "python": sys.executable, "max_jobs": args.slots,
                            "array_throttle": args.slots, "poll_seconds": 1.0,
                            "result_grace_seconds": 0.0, "memory_mb": 2048}  # fmt: skip
        daemon.mount.mkdir(parents=True)
        daemon.mount.chmod(0o1777)  # a drop root as docs/install.md makes it: sticky
        where = f"Slurm test cluster, max_jobs {args.slots}" if slurm_conf else "local executor"
        print(f"A: {args.images_a:,} images ({ann.user}), B: {args.images_b:,} images "
              f"({bob.user}) {args.delay:g} s later; {args.size}² images; {where}; "
              f"load {os.getloadavg()[0]:.1f}; work in {work}")  # fmt: skip
        alone_a, alone_b, with_a, with_b, yields = [], [], [], [], []
        base_a: list[float] = []
        base_b: list[float] = []
        base_yields: list[int] = []
        daemon.start()
        try:
            for r in range(args.rounds):
                b = scenario(daemon, [(f"b-alone-{r}", b_staged, bob, 0.0)], args.timeout)
                alone_b.append(b[f"b-alone-{r}"])
                a = scenario(daemon, [(f"a-alone-{r}", a_staged, ann, 0.0)], args.timeout)
                alone_a.append(a[f"a-alone-{r}"])
                plan = [(f"a-{r}", a_staged, ann, 0.0), (f"b-{r}", b_staged, bob, args.delay)]
                both = scenario(daemon, plan, args.timeout)
                with_a.append(both[f"a-{r}"])
                with_b.append(both[f"b-{r}"])
                yields.append(yielded(daemon, f"a-{r}"))
                print(f"round {r + 1}: alone A {alone_a[-1]:.1f} s, B {alone_b[-1]:.1f} s; "
                      f"together A {with_a[-1]:.1f} s, B {with_b[-1]:.1f} s; A's shards "
                      f"yielded {yields[-1]}; load {os.getloadavg()[0]:.1f}")  # fmt: skip
                if args.baseline_grace is not None:
                    base = baseline(daemon, r, a_staged, b_staged, (ann, bob), args)
                    base_a.append(base[f"a-base-{r}"])
                    base_b.append(base[f"b-base-{r}"])
                    base_yields.append(yielded(daemon, f"a-base-{r}"))
                    print(f"round {r + 1}, preempt_grace_seconds {args.baseline_grace:g}: "
                          f"together A {base_a[-1]:.1f} s, B {base_b[-1]:.1f} s; A's shards "
                          f"yielded {base_yields[-1]}")  # fmt: skip
            accounts_seen = slurm_accounts(daemon, env) if slurm_conf else []
            refusal = over_quota(daemon, b_staged, bob, args.images_b * 2 * args.rounds)
        finally:
            daemon.stop()
        print(f"preempt_grace_seconds: {grace_of(daemon)}")
        table(alone_a, alone_b, with_a, with_b, yields)
        if base_a:
            print(f"baseline, preempt_grace_seconds {args.baseline_grace:g}, same run:")
            table(alone_a, alone_b, base_a, base_b, base_yields)
        config = str(daemon.state / "config.toml")
        for by in ("owner", "account"):
            shown = subprocess.run([WATCHCTL, "usage", "--by", by, "--config", config],
                                   capture_output=True, text=True)  # fmt: skip
            print(f"$ watchctl usage --by {by}\n{shown.stdout}{shown.stderr}")
        print(f"a quota refusal, as owner B reads it:\n{refusal}")
        if accounts_seen:
            print("accounts Slurm recorded on the submitted jobs (squeue -o '%i|%a|%q|%j'):")
            print("\n".join(accounts_seen))
        data = {"alone_a": alone_a, "alone_b": alone_b, "with_a": with_a, "with_b": with_b,
                "base_a": base_a, "base_b": base_b}  # fmt: skip
        (work / "results.json").write_text(json.dumps(data))
    print(f"logs: {work}/fair/state/daemon.log")
    return 0


def baseline(
    daemon: OwnersDaemon,
    r: int,
    a_staged: Path,
    b_staged: Path,
    people: tuple[owners.Person, owners.Person],
    args: argparse.Namespace,
) -> dict[str, float]:
    """A then B again, the daemon restarted with the baseline's grace, then restarted as it
    was."""
    ann, bob = people
    kept = dict(daemon.accounts or {})
    daemon.stop()
    daemon.accounts = {**kept, "preempt_grace_seconds": args.baseline_grace}
    daemon.start()
    try:
        plan = [(f"a-base-{r}", a_staged, ann, 0.0), (f"b-base-{r}", b_staged, bob, args.delay)]
        return scenario(daemon, plan, args.timeout)
    finally:
        daemon.stop()
        daemon.accounts = kept
        daemon.start()


def grace_of(daemon: OwnersDaemon) -> str:
    """The candidate's grace: the table's, else the code's default."""
    value = (daemon.accounts or {}).get("preempt_grace_seconds")
    if value is None:
        value = AccountsSection().preempt_grace_seconds
    return f"{value:g} (the candidate)"


def table(
    alone_a: list[float],
    alone_b: list[float],
    with_a: list[float],
    with_b: list[float],
    yields: list[int],
) -> None:
    a, b = statistics.median(alone_a), statistics.median(alone_b)
    a2, b2 = statistics.median(with_a), statistics.median(with_b)
    ratio_a, ratio_b = a2 / a, b2 / b
    print()
    print("| owner | alone (s) | with the other (s) | ratio | target | verdict |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    print(f"| A | {a:.1f} | {a2:.1f} | {ratio_a:.2f} | ≤ 1.10 | "
          f"{'PASS' if ratio_a <= 1.1 else 'FAIL'} |")  # fmt: skip
    print(f"| B | {b:.1f} | {b2:.1f} | {ratio_b:.2f} | ≤ 2.00 | "
          f"{'PASS' if ratio_b <= 2.0 else 'FAIL'} |")  # fmt: skip
    print(f"(medians of {len(alone_a)} round(s); A's shards that yielded their slot to B: "
          f"{', '.join(map(str, yields))})\n")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
