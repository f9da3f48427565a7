"""Real inference jobs whose inputs were swapped after the spec was written: a link out of the
batch folder or a FIFO is an input error naming the file, read neither to segment it nor by the
ledger's hashing, and never a hang."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from daemon.contract.jobspec import SPEC_FILE, ErrorKind, Identity, ModelRef, Pipeline, Shard

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import InferredBatch, JobRun


def _copy_images(inferred: InferredBatch, batch_dir: Path) -> list[Path]:
    shutil.copytree(inferred.batch_dir / "images", batch_dir / "images")
    return sorted((batch_dir / "images").iterdir())


def _swap(files: list[Path], elsewhere: Path) -> Path:
    """files[0] becomes a link to an identical copy outside the batch (a read of it would pass
    every checksum), files[1] a FIFO; the outside copy is returned."""
    elsewhere.mkdir()
    outside = elsewhere / files[0].name
    shutil.copy(files[0], outside)
    files[0].unlink()
    os.symlink(outside, files[0])
    files[1].unlink()
    os.mkfifo(files[1])
    return outside


def _spec(job_spec: Callable[..., Any], batch_dir: Path, inputs: Any, inferred: InferredBatch,
          params: dict[str, Any], name: str = "infer-0000") -> Any:  # fmt: skip
    model = ModelRef(inferred.model.name, "1")
    return job_spec(batch_dir, Pipeline.INFER, tuple(inputs), registry=inferred.model.registry,
                    model=model, params=params, shard=Shard(0, 1), job_name=name)  # fmt: skip


def _problems(job: JobRun) -> dict[str, str]:
    assert job.returncode == 2, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.INPUT
    return {p.where: p.message for p in error.problems}


@pytest.mark.timeout(280)  # a job blocked on the FIFO would end at run()'s 240 s limit
def test_inputs_swapped_for_a_link_out_or_a_fifo_fail_the_job_unread(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    batch_dir = tmp_path / "batch"
    files = _copy_images(inferred, batch_dir)
    inputs = manifest_inputs(batch_dir, files, checksums=True)
    spec = _spec(job_spec, batch_dir, inputs, inferred, infer_params)
    outside = _swap(files, tmp_path / "elsewhere")
    job = run(spec)
    assert _problems(job) == {
        f"input '{inputs[0].path}'": f"now leads outside the batch folder (to {outside})",
        f"input '{inputs[1].path}'": "now is a FIFO, not a regular file",
    }
    masks = batch_dir / "results" / "masks"
    assert not (masks / inputs[0].path).exists() and not (masks / inputs[1].path).exists()
    assert (masks / inputs[2].path).is_file()  # the others are still segmented
    assert not (batch_dir / "results" / "parts").exists()


@pytest.mark.timeout(280)
def test_a_rerun_does_not_hash_swapped_inputs_to_skip_them(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Without sha256 in the manifest, the ledger hashes a file to know it is unchanged: that
    read goes by the same rule, so a swapped file is not skipped as done but refused."""
    batch_dir = tmp_path / "batch"
    files = _copy_images(inferred, batch_dir)
    spec = _spec(job_spec, batch_dir, manifest_inputs(batch_dir, files), inferred, infer_params)
    first = run(spec)
    assert first.returncode == 0, first.log
    outside = _swap(files, tmp_path / "elsewhere")
    where = [f"input 'images/{f.name}'" for f in files]
    assert _problems(run(spec)) == {
        where[0]: f"now leads outside the batch folder (to {outside})",
        where[1]: "now is a FIFO, not a regular file",
    }


@pytest.mark.timeout(280)
def test_a_job_whose_batch_folder_was_replaced_fails_without_reading_the_new_one(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    manifest_inputs: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """The spec names the folder the batch was accepted from (device, inode); a folder moved
    away and replaced by another of the same name, with images of the same names (here the very
    same bytes: checksums cannot tell), is an input problem of the batch folder, and nothing is
    segmented."""
    batch_dir = tmp_path / "batch"
    files = _copy_images(inferred, batch_dir)
    inputs = manifest_inputs(batch_dir, files, checksums=True)
    accepted = Identity.of(os.stat(batch_dir))
    os.rename(batch_dir, tmp_path / "moved away")
    _copy_images(inferred, batch_dir)
    spec = replace(_spec(job_spec, batch_dir, inputs, inferred, infer_params),
                   batch_identity=accepted)  # fmt: skip
    (spec.job_dir / SPEC_FILE).write_text(spec.to_json(), encoding="utf-8")
    job = run(spec)
    assert _problems(job) == {"batch folder": "was replaced by another folder of the same name"}
    assert job.result.error.message == "the batch folder was replaced"  # type: ignore[union-attr]
    for folder in (batch_dir, tmp_path / "moved away"):
        assert not (folder / "results" / "masks").exists()
        assert not (folder / "results" / "parts").exists()
