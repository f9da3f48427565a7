"""Two real unprivileged owners (made with useradd) on the real one-node Slurm cluster: each
owner's jobs carry the account the site's table gives them (Slurm's own record: squeue's %a),
and with executor.slurm.max_jobs the daemon's fair order shares those slots: the second owner's
batch does not wait for the first one's backlog."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import owners
import pytest
from conftest import slurm
from owners import drop
from replay import Replay

from daemon.core.states import BatchState, JobState
from daemon.loop.service import Service
from daemon.site.config import Config
from daemon.store import Store

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not owners.available(), reason="making owners (useradd) needs root"),
]


def test_each_owners_jobs_carry_their_account_and_share_the_slots_in_turns(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    slurm_env: dict[str, str],
) -> None:
    with owners.made("wds", 2) as (ann, bob):
        accounts = {"users": {ann.user: {"account": "lab-a"}},
                    "groups": {bob.group: {"account": "lab-b"}}}  # fmt: skip
        config = config_for(slurm={"max_jobs": 2, "array_throttle": 2}, accounts=accounts)
        with Replay(config) as replay:
            drop(staged("a", count=8), drop_root, "plate ann", ann)

            def ann_holds_both(service: Service) -> bool:
                return len(service.store.jobs(states=[JobState.RUNNING])) == 2

            replay.run(until=ann_holds_both, timeout=180)
            drop(staged("b", count=2), drop_root, "plate bob", bob)
            replay.run(timeout=400)
        store = Store.open(config.daemon.database)
        done = {b.folder: b for b in store.batches()}
        ann_batch, bob_batch = done["plate ann"], done["plate bob"]
        assert {ann_batch.state, bob_batch.state} == {BatchState.DONE}
        ids = {
            str(j.handle).removeprefix("slurm:"): b.folder
            for b in (ann_batch, bob_batch)
            for j in store.jobs([b.id])
        }
        listed = slurm(slurm_env, "squeue", "--states=all", "--noheader", "--array",
                       f"--jobs={','.join(sorted({i.split('_')[0] for i in ids}))}",
                       "--format=%i|%a|%j")  # fmt: skip
        print(f"$ squeue --states=all --array --format='%i|%a|%j'\n{listed}")
        seen = {line.split("|")[0]: line.split("|")[1] for line in listed.splitlines() if line}
        expected = {"plate ann": "lab-a", "plate bob": "lab-b"}
        assert {job: seen.get(job) for job in ids} == {job: expected[f] for job, f in ids.items()}
        assert bob_batch.finished_at < ann_batch.finished_at  # type: ignore[operator]
        reasons = [e.reason for e in store.events(ann_batch.id)]
        assert any(r.startswith(f"yielded its slot to user:{bob.user}") for r in reasons)
