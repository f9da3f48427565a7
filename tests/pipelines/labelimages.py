"""Reading the OME-Zarr label images the jobs write, for the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zarr
from zarr.core.sync import cleanup_resources


def zarr_levels(path: Path, group: str = "") -> list[Any]:
    """The levels of the multiscale group ``group`` of the OME-Zarr at ``path`` (numpy arrays).
    zarr's I/O thread and loop are stopped after, so no test leaves them running."""
    try:
        found = zarr.open_group(str(path), mode="r")
        if group:
            found = found[group]
        names = [d["path"] for d in found.attrs["multiscales"][0]["datasets"]]
        return [found[name][:] for name in names]
    finally:
        cleanup_resources()
