"""OME-Zarr images read as inputs (pipelines/ngff.py): NGFF 0.4 on Zarr v2 and 0.5 on Zarr v3,
any of t, c, z before y, x; a channel picked by its name; what is not an image it reads refused
saying why; a store that holds a link, or changes while it is read, is a problem of the input."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.core.sync import cleanup_resources

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile
from pipelines.channels import ChannelProblem
from pipelines.job import InputError
from pipelines.ngff import StoreReader, open_store

ITEM = InputFile("images/cells.ome.zarr")


@pytest.fixture(autouse=True)
def zarr_threads_stopped() -> Iterator[None]:
    """Zarr's I/O threads, stopped after each test (a job's process ends after it reads)."""
    yield
    cleanup_resources()


def write_store(
    path: Path, pixels: np.ndarray, axes: str, fmt: int = 2, names: tuple[str, ...] = ()
) -> None:
    """``pixels`` (axes as named) as level 0 and one halved level, chunks of 64 along y, x."""
    group = zarr.open_group(str(path), mode="w", zarr_format=fmt)
    chunks = tuple(64 if a in "yx" else 1 for a in axes)
    halved = pixels[tuple(slice(None, None, 2) if a in "yx" else slice(None) for a in axes)]
    datasets = []
    for level, data in enumerate((pixels, halved)):
        group.create_array(str(level), data=data, chunks=chunks)
        scale = [2.0**level if a in "yx" else 1.0 for a in axes]
        datasets.append({"path": str(level), "coordinateTransformations": [
            {"type": "scale", "scale": scale}]})  # fmt: skip
    kinds = {"t": "time", "c": "channel"}
    multiscale = {"axes": [{"name": a, "type": kinds.get(a, "space")} for a in axes],
                  "datasets": datasets}  # fmt: skip
    ome: dict = {"multiscales": [{**multiscale, "version": "0.4" if fmt == 2 else "0.5"}]}
    if names:
        ome["omero"] = {"channels": [{"label": n} for n in names]}
    group.attrs.update(ome if fmt == 2 else {"ome": {"version": "0.5", **ome}})


def read(path: Path, channel: object = None, tolerance: float = 0.0) -> np.ndarray:
    with HeldFolder.open(path) as folder:
        reader = StoreReader(folder, ITEM, 256, channel, tolerance)
        try:
            return reader.region(0, reader.height, 0, reader.width)
        finally:
            reader.close()


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_channel_is_picked_by_its_name_in_ngff_0_4_and_0_5(tmp_path: Path, fmt: int) -> None:
    rng = np.random.default_rng(0)
    planes = rng.integers(0, 65535, (3, 150, 200), dtype=np.uint16)
    write_store(tmp_path / "s.zarr", planes, "cyx", fmt, ("DAPI", "GFP", "RFP"))
    np.testing.assert_allclose(read(tmp_path / "s.zarr", "GFP"), planes[1] / 65535, rtol=1e-6)
    np.testing.assert_allclose(read(tmp_path / "s.zarr", 2), planes[2] / 65535, rtol=1e-6)
    with pytest.raises(ChannelProblem) as caught:
        read(tmp_path / "s.zarr")
    assert caught.value.message == (
        "has 3 channels (0: DAPI, 1: GFP, 2: RFP); which one to segment is not said"
    )


def test_a_z_stack_is_refused_one_plane_of_a_time_series_is_read(tmp_path: Path) -> None:
    pixels = np.arange(5 * 100 * 100, dtype=np.uint8).reshape(5, 1, 100, 100)
    write_store(tmp_path / "z.zarr", pixels, "zcyx")
    with pytest.raises(ChannelProblem, match="holds 5 Z slices; one plane per file"):
        read(tmp_path / "z.zarr")
    write_store(tmp_path / "t.zarr", pixels[:1], "tcyx")
    np.testing.assert_array_equal(read(tmp_path / "t.zarr") * 255, pixels[0, 0])


@pytest.mark.parametrize(
    ("attrs", "dtype", "said"),
    [
        ({}, np.uint8, "has no multiscales metadata: it is not an OME-Zarr image"),
        (None, np.float32, "has float32 samples; watchd reads 8- and 16-bit unsigned images"),
        (None, np.uint8, "has the axes y,q; the image's last two must be y and x"),
    ],
)
def test_what_is_not_an_image_this_reads_is_refused_saying_why(
    tmp_path: Path, attrs: dict | None, dtype: type, said: str
) -> None:
    write_store(tmp_path / "s.zarr", np.zeros((80, 80), dtype), "yx" if "q" not in said else "yq")
    if attrs is not None:
        group = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")
        group.attrs.clear()
    with pytest.raises(InputError) as caught:
        read(tmp_path / "s.zarr")
    (problem,) = caught.value.problems
    assert problem.where == "input 'images/cells.ome.zarr'" and problem.message.startswith(said)


def test_a_link_planted_in_the_store_or_a_change_while_read_is_a_problem_of_the_input(
    tmp_path: Path,
) -> None:
    batch = tmp_path / "batch"
    top = batch / ITEM.path
    write_store(top, np.full((100, 100), 200, np.uint8), "yx")
    with HeldFolder.open(batch) as held:
        with (
            pytest.raises(InputError) as caught,
            open_store(held, ITEM, 256, None, 0.0) as (
                reader,
                _,
            ),
        ):
            assert reader.region(0, 2, 0, 2).tolist() == [[pytest.approx(200 / 255)] * 2] * 2
            (top / "0" / "extra").write_bytes(b"written while read")
        assert caught.value.problems[0].message == "changed while it was being segmented"
        os.symlink("/etc/passwd", top / "0" / "planted")
        with pytest.raises(InputError) as caught, open_store(held, ITEM, 256, None, 0.0):
            pass
        assert caught.value.problems[0].message == (
            "now holds a symbolic link at '0/planted': an OME-Zarr store may hold only folders "
            "and regular files"
        )
        os.unlink(top / "0" / "planted")
        with open_store(held, ITEM, 256, None, 0.0) as (_, seen):
            assert seen["size"] > 0 and len(seen["state"]) == 64
