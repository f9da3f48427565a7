"""Microscope vendors' files through bioio's readers: Zeiss CZI, Nikon ND2.

A reader is a plugin of bioio (``bioio-czi``, with watchd's ``vendor`` extra; ``bioio-nd2``),
installed where the jobs run; a file whose reader is not installed there is refused naming the
package to install (or the export to make instead). The image is read whole, as one plane: a
channel by the manifest's ``channel`` (names from the file's metadata), the first scene,
refused if it is a stack along Z or time, or larger than ``max_whole_pixels`` (these readers
cannot be read window by window here: export a large one as a tiled OME-TIFF).

The library opens the file by path; it is given the job's own open descriptor of it
(``/proc/self/fd/N``), opened by the batch folder's rule, so no other file can be read in its
place. The sha256 is computed through that descriptor before the reader reads it, and the
file's size and modification time must not change in between (:func:`held_still`).
"""

from __future__ import annotations

import importlib
from typing import Any, BinaryIO

import numpy as np

from daemon.contract.checksums import sha256_of_stream
from daemon.contract.jobspec import InputFile, Problem
from daemon.contract.names import VENDOR_FORMATS
from pipelines.bounds import where
from pipelines.channels import ChannelProblem, Planes
from pipelines.job import InputError

_EXPORT = "or export the images as OME-TIFF (e.g. Fiji: File > Save As > OME-TIFF)"


def reader_module(item: InputFile) -> Any:
    """The bioio plugin that reads ``item`` (its ``Reader``), or InputError: not installed."""
    suffix = "." + item.path.rsplit(".", 1)[-1].lower()
    name, package = VENDOR_FORMATS[suffix]
    try:
        return importlib.import_module(package.replace("-", "_"))
    except ImportError:
        message = (
            f"is a {name} file, and the jobs' environment has no reader for it "
            f"({package} is not installed)"
        )
        hint = f"ask an operator to install {package} where the jobs run, {_EXPORT}"
        raise InputError("no reader", [Problem(where(item), message, hint)]) from None


def read_vendor(
    handle: BinaryIO, item: InputFile, max_pixels: int | None, channel: Any
) -> tuple[np.ndarray, str]:
    """The plane of ``item`` (open as ``handle``) as integer pixels, and its file's sha256."""
    plugin = reader_module(item)
    from bioio import BioImage  # (bioio comes with any of its plugins)

    handle.seek(0)
    digest = sha256_of_stream(handle)
    try:
        image = BioImage(f"/proc/self/fd/{handle.fileno()}", reader=plugin.Reader)
        dims = image.dims
    except Exception as exc:  # the readers raise what their libraries do on a damaged file
        name = VENDOR_FORMATS["." + item.path.rsplit(".", 1)[-1].lower()][0]
        raise InputError("unreadable image", [Problem(
            where(item), f"cannot be read as a {name} file ({type(exc).__name__}: {exc})",
            "the file is damaged or incomplete; copy or export it again",
        )]) from exc  # fmt: skip
    stacked = next((f"{n} {axis}" for axis, n in (("Z slices", dims.Z), ("time points", dims.T))
                    if n > 1), "")  # fmt: skip
    names = tuple(str(n) for n in image.channel_names or ())
    planes = Planes(dims.C, dims.C, names if len(names) == dims.C else (), stacked)
    try:
        plane = planes.page(channel)
    except ChannelProblem as exc:
        raise InputError("channel", [Problem(where(item), exc.message, exc.hint)]) from None
    if max_pixels is not None and max_pixels < dims.Y * dims.X:
        message = (f"is {dims.X}×{dims.Y} pixels, more than params.max_whole_pixels = "
                   f"{max_pixels:,} allows to segment as a whole")  # fmt: skip
        hint = "export it as a tiled OME-TIFF: those are segmented window by window"
        raise InputError("image too large", [Problem(where(item), message, hint)])
    order = "YXS" if "S" in dims.order and dims.S > 1 else "YX"
    pixels = np.asarray(image.get_image_data(order, C=plane, T=0, Z=0))
    return pixels, digest
