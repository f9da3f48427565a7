"""The fault campaign's short version: a few runs of SIGKILLed daemons and workers, with the
invariants checked after each (the full campaign is `scripts/fault_campaign.py --runs 100`).
Behind the ``campaign`` marker, out of the default run (3 minutes of CI's 30): `scripts/test -m
campaign`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.campaign
def test_a_short_fault_campaign_keeps_every_invariant() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fault_campaign.py"), "--runs", "3", "--seed", "11"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary.startswith("runs: 3,") and summary.endswith("invariant violations: 0")
