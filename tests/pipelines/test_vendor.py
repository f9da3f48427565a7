"""Vendors' files through bioio: a Zeiss CZI is segmented like the same image as a PNG; a file
whose reader is not installed, or that is damaged, is refused naming what to do."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import tifffile
from jobrun import work_dir_for
from PIL import Image
from pylibCZIrw import czi as pyczi

from daemon.contract.jobspec import InputFile, ModelRef, Pipeline
from pipelines.images import read_bounded
from pipelines.job import InputError

if TYPE_CHECKING:
    from conftest import InferredBatch, JobRun


def write_czi(path: Path, planes: list[np.ndarray], names: list[str]) -> None:
    """A CZI of one plane per channel, as Zeiss's own library writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with pyczi.create_czi(str(path), exist_ok=True) as czi:
        for channel, plane in enumerate(planes):
            czi.write(data=plane, plane={"C": channel}, location=(0, 0))
        czi.write_metadata(channel_names=dict(enumerate(names)))


def _refusal(path: Path, **kw: Any) -> str:
    with pytest.raises(InputError) as refused:
        read_bounded(path.parent, InputFile(path.name), **kw)
    (problem,) = refused.value.problems
    return problem.render()


def test_a_czi_is_read_by_its_channel_and_bounded(tmp_path: Path) -> None:
    grey = np.arange(48 * 64, dtype=np.uint16).reshape(48, 64)
    write_czi(tmp_path / "a.czi", [grey // 2, grey], ["DAPI", "GFP"])
    found = read_bounded(tmp_path, InputFile("a.czi"), max_pixels=None, channel="GFP")
    assert found is not None and np.allclose(found[0], grey / 65535.0)
    assert len(found[1]) == 64  # the file's sha256, read through the job's own descriptor
    assert _refusal(tmp_path / "a.czi", max_pixels=None) == (
        "input 'a.czi': has 2 channels (0: DAPI, 1: GFP); which one to segment is not said — "
        'set [params] channel in the manifest to one of them (channel = "DAPI")'
    )
    assert "is 64×48 pixels, more than params.max_whole_pixels = 1,000 allows" in _refusal(
        tmp_path / "a.czi", max_pixels=1000, channel=1
    )


def test_a_damaged_czi_or_a_format_without_its_reader_is_refused_saying_what_to_do(
    tmp_path: Path,
) -> None:
    (tmp_path / "b.czi").write_bytes(b"ZISRAWFILE" + bytes(100))
    assert _refusal(tmp_path / "b.czi", max_pixels=None).startswith(
        "input 'b.czi': cannot be read as a Zeiss CZI file ("
    )
    if importlib.util.find_spec("bioio_nd2") is not None:
        pytest.skip("bioio-nd2 is installed here")
    (tmp_path / "c.nd2").write_bytes(bytes(64))
    assert _refusal(tmp_path / "c.nd2", max_pixels=None) == (
        "input 'c.nd2': is a Nikon ND2 file, and the jobs' environment has no reader for it "
        "(bioio-nd2 is not installed) — ask an operator to install bioio-nd2 where the jobs "
        "run, or export the images as OME-TIFF (e.g. Fiji: File > Save As > OME-TIFF)"
    )


def test_an_inference_job_segments_a_czi_like_the_same_image_as_a_png(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """Two images as the GFP channel of CZIs beside a channel of noise: their masks (TIFFs named
    after the CZI) equal the PNGs' masks; the table names the CZIs."""
    pngs = [i for i in inferred.inputs if i.path.endswith(".png")][:2]
    batch_dir = tmp_path / "plate"
    noise = np.random.default_rng(5)
    inputs = []
    for item in pngs:
        grey = np.asarray(Image.open(inferred.batch_dir / item.path))
        name = f"images/{Path(item.path).stem}.czi"
        write_czi(batch_dir / name, [noise.integers(0, 255, grey.shape, dtype=np.uint8), grey],
                  ["DAPI", "GFP"])  # fmt: skip
        inputs.append(InputFile(name))
    spec = job_spec(batch_dir, Pipeline.INFER, tuple(inputs), registry=inferred.model.registry,
                    model=ModelRef(inferred.model.name, "1"),
                    params={**infer_params, "channel": "GFP"})  # fmt: skip
    job = run(spec)
    assert job.returncode == 0, job.log
    for item, source in zip(inputs, pngs, strict=True):
        ours = tifffile.imread(batch_dir / "results" / "masks" / f"{item.path}.tif")
        theirs = np.asarray(Image.open(inferred.batch_dir / "results" / "masks" / source.path))
        assert np.array_equal(ours > 0, theirs > 0)
    table = (work_dir_for(batch_dir) / "parts" / "table-0000.csv").read_text()
    assert all(f'"{item.path}"' in table for item in inputs)
