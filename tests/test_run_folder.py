"""A batch's run folder is made by the daemon at intake, with a name its owner cannot plant in
advance: UTC second (so names sort by time), manifest prefix, and a random part."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from daemon.loop.intake import make_run_dir

SHA = "0123456789abcdef" * 4
NOW = 1_790_000_000.0


def test_run_folders_are_made_with_an_unguessable_name_that_sorts_by_time(tmp_path: Path) -> None:
    (tmp_path / "plate").mkdir()
    first = Path(make_run_dir(tmp_path, "plate", NOW, SHA))
    again = Path(make_run_dir(tmp_path, "plate", NOW, SHA))
    later = Path(make_run_dir(tmp_path, "plate", NOW + 1, SHA))
    assert first.parent == tmp_path / "plate" / "results"
    assert re.fullmatch(r"\d{8}T\d{6}Z-01234567-[0-9a-f]{8}", first.name)
    assert first != again and first.is_dir() and again.is_dir()
    assert max(first.name, again.name) < later.name


def test_a_name_that_exists_already_is_never_taken_as_the_daemons(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner guessed the random part (here: the draw is forced): another name is drawn."""
    draws = iter(["aaaaaaaa", "aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr("daemon.loop.intake.secrets.token_hex", lambda _n: next(draws))
    planted = tmp_path / "plate" / "results" / "19700101T000000Z-01234567-aaaaaaaa"
    planted.mkdir(parents=True)
    (planted / "jobs").mkdir()
    made = Path(make_run_dir(tmp_path, "plate", 0.0, SHA))
    assert made.name == "19700101T000000Z-01234567-bbbbbbbb" and made.is_dir()


def test_a_results_folder_planted_as_a_link_is_not_written_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "plate").mkdir()
    (tmp_path / "plate" / "results").symlink_to(elsewhere)
    made = make_run_dir(tmp_path, "plate", NOW, SHA)  # the first job's preparation says why
    assert made.startswith(str(tmp_path / "plate" / "results"))
    assert list(elsewhere.iterdir()) == []
