"""Multi-channel TIFFs (OME-TIFF, ImageJ hyperstacks): the plane named by [params] channel is
segmented, whole or window by window; a file that cannot say which plane is refused with what
it holds and what to write."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import tifffile
from PIL import Image

from daemon.contract.jobspec import InputFile, ModelRef, Pipeline
from pipelines.bounds import declared_size
from pipelines.channels import ChannelProblem
from pipelines.images import UnreadableImage, decode, read_bounded
from pipelines.job import InputError
from pipelines.tiles import RegionReader

if TYPE_CHECKING:
    from conftest import InferredBatch, JobRun

NAMES = ["DAPI", "GFP", "RFP"]
PLANES = np.stack(
    [np.full((40, 56), 1000 * (c + 1), dtype=np.uint16) + np.arange(56, dtype=np.uint16)
     for c in range(3)]
)  # fmt: skip


def ome(
    planes: np.ndarray, axes: str = "CYX", names: list[str] | None = NAMES, **kw: object
) -> bytes:
    buffer = io.BytesIO()
    metadata: dict[str, object] = {"axes": axes}
    if names:
        metadata["Channel"] = {"Name": names}
    tifffile.imwrite(buffer, planes, ome=True, metadata=metadata, **kw)  # type: ignore[arg-type]
    return buffer.getvalue()


@pytest.mark.parametrize("channel", ["GFP", 1])
def test_the_channel_named_or_numbered_is_the_plane_segmented(channel: object) -> None:
    grey = decode(ome(PLANES), channel)
    assert np.allclose(grey, PLANES[1] / 65535.0)


def test_a_file_of_several_channels_without_a_channel_says_which_there_are() -> None:
    with pytest.raises(UnreadableImage) as refused:
        decode(ome(PLANES))
    assert refused.value.message == (
        "has 3 channels (0: DAPI, 1: GFP, 2: RFP); which one to segment is not said"
    )
    assert 'channel = "DAPI"' in refused.value.hint
    with pytest.raises(UnreadableImage, match=r"has no channel 'Cy5': it has 3 \(0: DAPI"):
        decode(ome(PLANES), "Cy5")
    with pytest.raises(UnreadableImage, match=r"has no channel 3: it has 3"):
        decode(ome(PLANES), 3)


def test_unnamed_channels_are_numbered_and_a_stack_of_slices_is_refused() -> None:
    with pytest.raises(UnreadableImage, match=r"numbered 0 to 2, unnamed"):
        decode(ome(PLANES, names=None))
    assert np.allclose(decode(ome(PLANES, names=None), 2), PLANES[2] / 65535.0)
    stack = np.stack([PLANES[:2], PLANES[:2]])  # Z, C, Y, X
    with pytest.raises(UnreadableImage, match=r"holds 2 Z slices; one plane per file"):
        decode(ome(stack, axes="ZCYX", names=NAMES[:2]), "GFP")


def test_a_file_of_one_channel_ignores_the_parameter() -> None:
    single = ome(PLANES[:1], names=["DAPI"])
    assert np.allclose(decode(single, "GFP"), PLANES[0] / 65535.0)
    plain = io.BytesIO()
    tifffile.imwrite(plain, PLANES[0])
    assert np.allclose(decode(plain.getvalue(), 2), PLANES[0] / 65535.0)


def test_a_large_multichannel_tiff_is_read_window_by_window_from_its_channel() -> None:
    rng = np.random.default_rng(1)
    planes = rng.integers(0, 255, (3, 300, 520), dtype=np.uint8)
    data = ome(planes, tile=(128, 128), compression="zlib")
    reader = RegionReader(io.BytesIO(data), channel="RFP")
    try:
        assert np.allclose(reader.region(100, 300, 200, 520), planes[2, 100:, 200:] / 255.0)
    finally:
        reader.close()
    with pytest.raises(ChannelProblem, match="which one to segment is not said"):
        RegionReader(io.BytesIO(data))


def test_every_plane_counts_towards_what_the_file_may_hold(tmp_path: Path) -> None:
    """A file of three channels is three planes of pixels: not 'far larger than its image'."""
    path = tmp_path / "cells.ome.tif"
    path.write_bytes(ome(PLANES))
    item = InputFile(path.name)
    with path.open("rb") as handle:
        declared = declared_size(handle, item)
    assert declared is not None and declared.planes == 3
    found = read_bounded(tmp_path, item, max_pixels=None, channel="DAPI")
    assert found is not None and np.allclose(found[0], PLANES[0] / 65535.0)
    with pytest.raises(InputError) as refused:
        read_bounded(tmp_path, item, max_pixels=None)
    (problem,) = refused.value.problems
    assert problem.where == "input 'cells.ome.tif'" and "3 channels" in problem.message


def test_an_inference_job_segments_the_channel_its_manifest_names(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    infer_params: dict[str, Any],
) -> None:
    """The same images, as the GFP channel of three-channel OME-TIFFs beside two channels of
    noise, give the same masks; without a channel the job names each file and what to write."""
    batch_dir = tmp_path / "plate"
    pngs = [i for i in inferred.inputs if i.path.endswith(".png")][:2]
    inputs = []
    noise = np.random.default_rng(3)
    for item in pngs:
        grey = np.asarray(Image.open(inferred.batch_dir / item.path))
        planes = np.stack([noise.integers(0, 255, grey.shape, dtype=np.uint8), grey, grey // 2])
        name = f"{Path(item.path).stem}.ome.tif"
        (batch_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (batch_dir / name).write_bytes(ome(planes))
        inputs.append(InputFile(name))
    model = ModelRef(inferred.model.name, "1")
    spec = job_spec(batch_dir, Pipeline.INFER, tuple(inputs), registry=inferred.model.registry,
                    model=model, params={**infer_params, "channel": "GFP"})  # fmt: skip
    job = run(spec)
    assert job.returncode == 0, job.log
    for item, source in zip(inputs, pngs, strict=True):
        ours = tifffile.imread(batch_dir / "results" / "masks" / item.path)
        theirs = np.asarray(Image.open(inferred.batch_dir / "results" / "masks" / source.path))
        assert np.array_equal(ours > 0, theirs > 0)
    again = job_spec(batch_dir, Pipeline.INFER, tuple(inputs), registry=inferred.model.registry,
                     model=model, params=infer_params, job_name="no-channel")  # fmt: skip
    refused = run(again)
    assert refused.returncode == 2 and refused.result is not None and refused.result.error
    problems = refused.result.error.problems
    assert [p.where for p in problems] == [f"input '{i.path}'" for i in inputs]
    assert all("3 channels (0: DAPI, 1: GFP, 2: RFP)" in p.message for p in problems)
