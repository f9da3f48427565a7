"""Real jobs in batch folders whose owner planted links and FIFOs under ``results/`` first.

The rule (:mod:`daemon.contract.heldfolder`, :func:`pipelines.job.run_folder`): nothing outside the
batch folder is ever written. A link, FIFO or file planted where a job needs a folder fails the
job with an INPUT problem naming it; one planted at a file name the job writes is replaced by
the job's own file (the link itself, never its target). What the jobs hand each other is not in
the batch folder at all (the spool): entries planted at the names it had there are neither read
nor written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from daemon.contract.jobspec import ErrorKind, InputFile, ModelRef, Pipeline, Shard

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import InferredBatch, JobRun

SENTINEL = b"the owner's file outside the batch folder\n"


def _outside(tmp_path: Path) -> Path:
    """A folder beside the batch folder with one file in it: nothing may change there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(SENTINEL)
    return outside


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file()}  # fmt: skip


def _plant(entry: Path, kind: str, target: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        entry.symlink_to(target)
    else:
        os.mkfifo(entry)


def _secret(tmp_path: Path) -> tuple[str, Path]:
    """A file only its owner may read, its content a random canary: (the canary, the file)."""
    canary = f"CANARY-{os.urandom(8).hex()}"
    secret = tmp_path / "service-only" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(canary + "\n")
    secret.chmod(0o600)
    return canary, secret


def _report_spec(job_spec: Callable[..., Any], spec: Any) -> Any:
    """The spec of the report job of the inference shard ``spec``'s batch."""
    return job_spec(Path(spec.batch_dir), Pipeline.REPORT, spec.inputs,
                    registry=Path(spec.registry_dir), model=spec.model, params=spec.params,
                    job_name="report")  # fmt: skip


@pytest.fixture
def shard(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., tuple[InputFile, ...]],
    infer_params: dict[str, Any],
) -> Callable[..., Any]:
    """Make a batch folder of the session batch's ``images/`` (renamed by ``names``) and the
    spec of its one inference shard (run_dir ``results/``) with the session's model."""

    def make(names: dict[str, str] | None = None) -> Any:
        batch_dir = tmp_path / "batch"
        shutil.copytree(inferred.batch_dir / "images", batch_dir / "images")
        for old, new in (names or {}).items():
            (batch_dir / "images" / old).rename(batch_dir / "images" / new)
        inputs = manifest_inputs(batch_dir, sorted((batch_dir / "images").iterdir()))
        return job_spec(batch_dir, Pipeline.INFER, inputs, registry=inferred.model.registry,
                        model=ModelRef(inferred.model.name, "latest"), params=infer_params,
                        shard=Shard(0, 1))  # fmt: skip

    return make


@pytest.mark.parametrize(
    ("planted", "kind", "what"),
    [
        ("masks", "link", "is a symbolic link, not a folder"),
        ("masks/images", "link", "is a symbolic link, not a folder"),
        ("masks", "fifo", "is a FIFO, not a folder"),
    ],
)
def test_a_link_or_fifo_planted_where_a_job_makes_a_folder_fails_it_naming_the_entry(
    shard: Callable[..., Any],
    tmp_path: Path,
    run: Callable[..., JobRun],
    planted: str,
    kind: str,
    what: str,
) -> None:
    outside = _outside(tmp_path)
    spec = shard()
    _plant(Path(spec.run_dir) / planted, kind, outside)
    job = run(spec)
    assert job.returncode == 2, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.INPUT
    assert [p.where for p in error.problems] == [f"'results/{planted}'"]
    assert what in error.problems[0].message and "results/" in error.problems[0].hint
    assert f"'results/{planted}': {what}" in job.log
    assert _listing(outside) == {"keep.txt": SENTINEL}


def test_links_and_fifos_planted_at_the_names_of_a_jobs_files_are_replaced_by_its_own_files(
    shard: Callable[..., Any],
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
) -> None:
    """The mask's own name; then the report's table, summary and report: each planted as a link
    to a file outside or as a FIFO. The names the ledger, the shard table and the job's files
    had under results/ before they moved to the spool: planted too, neither read nor written
    (the jobs succeed, the FIFO blocks nothing, the links still point where they pointed)."""
    outside = _outside(tmp_path)
    spec = shard()
    results = Path(spec.run_dir)
    first_mask = f"masks/{spec.inputs[0].path}"
    planted = {
        first_mask: "link",
        "table.csv": "link",
        "summary.json": "fifo",
        "report.html": "link",
    }
    ignored = {
        "ledger/shard-0000.jsonl": "fifo",
        "parts/table-0000.csv": "link",
        "parts/table-9999.csv": "fifo",
        f"jobs/{spec.job_name}/result.json": "link",
        "jobs/report/result.json": "fifo",
    }
    for name, kind in {**planted, **ignored}.items():
        _plant(results / name, kind, outside / "keep.txt")
    job = run(spec)
    assert job.returncode == 0 and job.result is not None, job.log
    assert job.result.summary["segmented"] == len(spec.inputs)
    report = _report_spec(job_spec, spec)
    reported = run(report)
    assert reported.returncode == 0, reported.log
    for name in planted:
        entry = results / name
        assert entry.is_file() and not entry.is_symlink(), name
        assert entry.stat().st_nlink == 1 and entry.read_bytes() != SENTINEL, name
    for name, kind in ignored.items():
        entry = results / name
        assert entry.is_symlink() if kind == "link" else entry.is_fifo(), name
    assert _listing(outside) == {"keep.txt": SENTINEL}


def test_an_input_with_a_name_of_250_bytes_gets_its_mask(
    inferred: InferredBatch, shard: Callable[..., Any], run: Callable[..., JobRun]
) -> None:
    """The mask's temporary name no longer embeds the final name: 250 (and 255) bytes work."""
    first = sorted(p.name for p in (inferred.batch_dir / "images").iterdir())[0]
    long_name = "ü" * 60 + "x" * (250 - 120 - 4) + ".png"
    longest = "y" * 251 + ".png"
    assert (len(long_name.encode()), len(longest.encode())) == (250, 255)
    second = sorted(p.name for p in (inferred.batch_dir / "images").iterdir())[1]
    spec = shard({first: long_name, second: longest})
    job = run(spec)
    assert job.returncode == 0, job.log
    for name in (long_name, longest):
        mask = Path(spec.run_dir) / "masks" / "images" / name
        assert mask.read_bytes().startswith(b"\x89PNG"), name


def test_the_red_teams_plants_under_results_reach_no_output(
    shard: Callable[..., Any],
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
) -> None:
    """Issue 25's findings 1 to 3, on an inference batch: a training model card, curves and a
    previews index naming a secret by its absolute path; a shard table that is a link to the
    secret, another that is a FIFO; a forged spec for the report job. The report reads what the
    jobs left in the spool, never these: it ends DONE at once, and the secret appears in no
    output and no log."""
    canary, secret = _secret(tmp_path)
    spec = shard()
    job = run(spec)
    assert job.returncode == 0, job.log
    results = Path(spec.run_dir)
    (results / "training" / "previews").mkdir(parents=True)
    (results / "training" / "model.json").write_text('{"name": "x", "version": 1}')
    (results / "training" / "metrics.csv").write_text("epoch,train_loss,val_loss,val_dice,val_iou\n"
                                                      "1,0.5,0.5,0.5,0.5\n")  # fmt: skip
    (results / "training" / "previews" / "index.json").write_text(
        json.dumps({"previews": [{"file": str(secret)}]})
    )
    (results / "parts").mkdir()
    (results / "parts" / "table-9999.csv").symlink_to(secret)
    os.mkfifo(results / "parts" / "table-9998.csv")
    (results / "jobs" / "report").mkdir(parents=True)
    (results / "jobs" / "report" / "spec.json").write_text(
        json.dumps({"batch_dir": "/", "run_dir": str(secret.parent)})
    )
    report = _report_spec(job_spec, spec)
    reported = run(report)
    assert reported.returncode == 0 and reported.result is not None, reported.log
    assert reported.result.summary["sections"] == ["inference"]
    summary = json.loads((results / "summary.json").read_text())
    assert "training" not in summary and summary["inference"]["images"] == len(spec.inputs)
    outputs = [p for p in results.rglob("*") if p.is_file() and not p.is_symlink()]
    outputs += [p for p in Path(report.work_dir).rglob("*") if p.is_file()]
    assert len(outputs) > 5
    for path in outputs:
        assert canary.encode() not in path.read_bytes(), path
    assert list(secret.parent.iterdir()) == [secret]


def test_a_mask_swapped_for_a_hard_link_is_never_read_by_the_report(
    shard: Callable[..., Any],
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
) -> None:
    """Found by the fuzz campaign (canary family): a mask swapped, after the job wrote it, for
    a hard link to a file the owner may not read (where the kernel lets them make one: an NFS
    server, fs.protected_hardlinks = 0) was read by the report, and the log copied for the
    owner said its first eight bytes (``is not a PNG or TIFF image (it starts with …)``). Now
    a mask with another link is not read: no overlay for it, its file unread (its atime as it
    was), nothing of it anywhere."""
    canary, secret = _secret(tmp_path)
    spec = shard()
    assert run(spec).returncode == 0
    masks = sorted((Path(spec.run_dir) / "masks" / "images").iterdir())
    masks[0].unlink()
    os.link(secret, masks[0])
    os.utime(secret, ns=(946_684_800 * 10**9, secret.stat().st_mtime_ns))
    before = secret.stat().st_atime_ns
    report = _report_spec(job_spec, spec)
    reported = run(report)
    assert reported.returncode == 0, reported.log
    assert secret.stat().st_atime_ns == before, "the secret was read"
    assert f"no overlay for images/{masks[0].name}" in reported.log
    assert "has other hard links" in reported.log
    outputs = [p for p in Path(spec.run_dir).rglob("*") if p.is_file() and p != masks[0]]
    outputs += [p for p in Path(report.work_dir).rglob("*") if p.is_file()]
    for path in outputs:
        assert canary[:8].encode() not in path.read_bytes(), path
    assert canary[:8] not in reported.log
