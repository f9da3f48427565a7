"""Which plane of a multi-channel TIFF a job segments: the manifest's ``channel`` parameter.

A microscope's OME-TIFF (or an ImageJ hyperstack) stores one plane per channel: DAPI, GFP, … .
The net segments one grey plane, so a file of several channels needs ``[params] channel``: a
channel's name as the instrument wrote it, or its number from 0. A file of one channel (grey or
RGB) ignores it, so a batch may mix both. A stack along any other axis (Z slices, time points)
is refused: one plane per file. Every refusal says what the file holds and what to write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import tifffile

PLANE_AXES = "YXS"  # rows, columns, samples (RGB): what one plane holds


class ChannelProblem(Exception):
    """The file's planes and the ``channel`` asked for do not fit; ``hint`` says what to do."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class Planes:
    """The planes of a TIFF's first series: how many, and the channels' names if known."""

    count: int  # pages of the series (1 for a plain image)
    channels: int  # along C (1 without a C axis)
    names: tuple[str, ...]  # the channels' names (OME metadata), () when unnamed
    stacked: str  # an axis other than C with more than one plane, e.g. "12 Z slices"

    @classmethod
    def of(cls, tif: tifffile.TiffFile) -> Planes:
        series = tif.series[0]
        sizes = {
            a: n for a, n in zip(series.axes, series.shape, strict=True) if a not in PLANE_AXES
        }
        count = math.prod(sizes.values())
        stacked = next((_planes(a, n) for a, n in sizes.items() if a != "C" and n > 1), "")
        channels = sizes.get("C", 1)
        return cls(count, channels, _names(tif, channels), stacked)

    def page(self, channel: Any) -> int:
        """The page of the series to segment for ``channel`` (None, a name or a number)."""
        if self.stacked:
            raise ChannelProblem(
                f"holds {self.stacked}; one plane per file is segmented",
                "save each plane (slice, time point) as a file of its own",
            )
        if self.channels == 1:
            return 0
        listed = self._listed()
        if channel is None:
            raise ChannelProblem(
                f"has {self.channels} channels ({listed}); which one to segment is not said",
                f"set [params] channel in the manifest to one of them ({self._example()})",
            )
        if isinstance(channel, int) and not isinstance(channel, bool):
            if 0 <= channel < self.channels:
                return channel
        elif channel in self.names:
            return self.names.index(channel)
        raise ChannelProblem(
            f"has no channel {channel!r}: it has {self.channels} ({listed})",
            f"set [params] channel to one of them ({self._example()})",
        )

    def _listed(self) -> str:
        if self.names:
            return ", ".join(f"{i}: {name}" for i, name in enumerate(self.names))
        return f"numbered 0 to {self.channels - 1}, unnamed"

    def _example(self) -> str:
        return f'channel = "{self.names[0]}"' if self.names else "channel = 0"


_PLANES = {"Z": "Z slices", "T": "time points"}  # other axes (I, Q: tifffile's guesses): pages


def _planes(axis: str, count: int) -> str:
    return f"{count} {_PLANES.get(axis, 'pages')}"


def plane_page(tif: tifffile.TiffFile, channel: Any, level: int = 0) -> tifffile.TiffPage | None:
    """The page of ``tif`` to segment for ``channel`` (a page for each plane; None where the
    series has none to give), at its pyramid's ``level`` (0: full resolution, -1: the
    smallest); raises ChannelProblem."""
    page = tif.series[0].levels[level].pages[Planes.of(tif).page(channel)]
    return page.aspage() if isinstance(page, tifffile.TiffFrame) else page


def _names(tif: tifffile.TiffFile, channels: int) -> tuple[str, ...]:
    """The channels' names from the OME-XML, when every channel has one."""
    if not tif.is_ome or not tif.ome_metadata:
        return ()
    try:
        pixels = tifffile.xml2dict(tif.ome_metadata)["OME"]["Image"]
        pixels = (pixels[0] if isinstance(pixels, list) else pixels)["Pixels"]
        found = pixels.get("Channel", [])
    except (KeyError, TypeError, IndexError, ValueError):
        return ()
    found = found if isinstance(found, list) else [found]
    names = tuple(str(c.get("Name", "")) for c in found if isinstance(c, dict))
    return names if len(names) == channels and all(names) else ()
