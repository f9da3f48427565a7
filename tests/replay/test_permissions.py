"""A batch folder the service may not read (made without the ACLs of docs/install.md, step 3) is
reported where the operator looks, and taken in within the retry period once it is fixed.

Tests run as root, and root reads everything: the daemon here runs as root without the
capabilities that override file permissions (``setpriv --bounding-set``), so the kernel
checks its access as it checks an unprivileged service's. The folder belongs to another user
with mode 0700, as an expert's folder copied with a restrictive umask does; the fix gives the
service access to it, as setfacl would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cli import cli
from test_crash import WATCHD, wait_for

from daemon.core.states import BatchState
from daemon.site.config import Config
from daemon.store import Store

EXPERT_UID = 12345  # no such user needs to exist: the folder is simply someone else's
UNPRIVILEGED = "--bounding-set=-dac_override,-dac_read_search"


def as_unprivileged_service(config: Config, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            ["setpriv", UNPRIVILEGED, "--", WATCHD, "run", "--config", str(config.source)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def owned_by_expert(folder: Path) -> None:
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, EXPERT_UID, EXPERT_UID)
    folder.chmod(0o700)


def states_of(folder: str) -> Callable[[Store], list[BatchState]]:
    """The states of the folder's revisions, the first first."""
    return lambda store: [
        b.state for b in sorted(store.batches(), key=lambda b: b.revision) if b.folder == folder
    ]


@pytest.mark.parametrize("observer", ["inotify", "polling"])
def test_a_folder_the_service_cannot_read_is_reported_and_taken_in_once_fixed(
    config_for: Callable[..., Config],
    staged: Callable[..., Path],
    drop_root: Path,
    tmp_path: Path,
    observer: str,
) -> None:
    config = config_for(
        roots={"observer": observer},
        daemon={"rescan_seconds": 3600.0},  # the retry, not the catch-up scan, takes it in
        intake={"retry_unreadable_seconds": 1.0},
    )
    batch = tmp_path / "moved in"
    shutil.copytree(staged(count=2), batch)
    owned_by_expert(batch)
    daemon = as_unprivileged_service(config, tmp_path / "daemon.log")
    try:
        wait_for(lambda store: store.heartbeat() is not None, config, 60)
        batch.rename(drop_root / "plate 17")  # `mv`, which keeps the permissions
        wait_for(lambda store: states_of("plate 17")(store) == [BatchState.FAILED], config, 60)

        status = cli("watchctl", "status", "--config", str(config.source)).stdout
        print("STATUS-BEFORE\n" + status)
        assert "plate 17" in status and "cannot be read by the watchd service" in status
        data = json.loads(
            cli("watchctl", "status", "--json", "--config", str(config.source)).stdout
        )
        (problem,) = data["recent_failures"][0]["problems"]
        assert problem.startswith("batch folder: cannot be read by the watchd service: Permission")
        assert "docs/install.md, step 3" in problem and "looks again every 1 s" in problem
        listed = cli("watchctl", "batches", "--state", "failed", "--config", str(config.source))
        assert "plate 17" in listed.stdout

        subprocess.run(["chmod", "-R", "o+rwX", str(drop_root / "plate 17")], check=True)
        done = [BatchState.FAILED, BatchState.DONE]
        wait_for(lambda store: states_of("plate 17")(store) == done, config, 120)
        status = cli("watchctl", "status", "--config", str(config.source)).stdout
        assert "Last failures" not in status, "the fixed folder needs nobody to act any more"
        print(
            "STATUS-AFTER\n"
            + cli("watchctl", "status", "--config", str(config.source)).stdout
            + cli("watchctl", "batches", "--config", str(config.source)).stdout
        )
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    said = [json.loads(line) for line in (tmp_path / "daemon.log").read_text().splitlines()]
    warnings = [e for e in said if e.get("event") == "batch folder unreadable"]
    assert len(warnings) == 1, "said once, not at every retry"
    assert warnings[0]["folder"] == "plate 17"
    assert (drop_root / "plate 17" / "results").is_dir()
