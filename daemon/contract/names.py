"""The names and defaults the daemon and the jobs share beyond the job spec: the rule for model
names, the registry's top level (a folder per model) and its aliases, the image formats the jobs
read (by name: checked at intake, before any job runs), how an image pairs with its mask, and
the defaults of the inference parameters and of training's augmentations.

One place for each: the manifest's validation (:mod:`daemon.core.manifest_schema`), the model
catalogue (:mod:`models.catalog`), the inference job (:mod:`pipelines.infer`) and training
(:mod:`pipelines.augment`) read them here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from daemon.contract.jobspec import InputFile, Role

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MODEL_NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"

LATEST = "latest"  # the newest version of a model
BEST = "best"  # the version that scored best on its validation split
ALIASES = (LATEST, BEST)
ALIASES_FILE = "aliases.json"  # a model's aliases, {"latest": 3, "best": 2} (models.catalog)
VERSION_DIR = re.compile(r"v(\d{4,})")  # a version's folder: v0001, v0002, …


# The inputs' file names the jobs read (the content decides the decoder) and write masks as:
# TIFF's, an Aperio SVS slide (a tiled TIFF, JPEG tiles, its pyramid in pages) and a Hamamatsu
# NDPI (a TIFF with 64-bit offsets, a JPEG per level; tifffile knows it by its name) among them.
TIFF_SUFFIXES = frozenset({".tif", ".tiff", ".svs", ".ndpi"})
# Microscope vendors' files, read by a bioio plugin where the jobs run (pipelines/vendor.py):
# the format's name and the plugin's package.
VENDOR_FORMATS = {".czi": ("Zeiss CZI", "bioio-czi"), ".nd2": ("Nikon ND2", "bioio-nd2")}
# An OME-Zarr image (NGFF 0.4 or 0.5) is a folder, a store of chunk files: an input of its own
# kind (pipelines/ngff.py), listed by the folder's name, looked at as a whole at intake.
STORE_SUFFIX = ".zarr"
IMAGE_SUFFIXES = frozenset({".png", STORE_SUFFIX, *VENDOR_FORMATS}) | TIFF_SUFFIXES
# What instruments and scanners write that the jobs do not read (yet): said by name.
_INSTRUMENT_FORMATS = {
    ".lif": "Leica LIF", ".vsi": "Olympus VSI", ".mrxs": "3DHISTECH MRXS",
    ".scn": "Leica SCN", ".ims": "Imaris",
}  # fmt: skip
_EXPORT = "export the images as OME-TIFF (e.g. Fiji: File > Save As > OME-TIFF), TIFF or PNG"


def input_format_problem(path: str) -> tuple[str, str] | None:
    """(what, hint) when an input named ``path`` is in a format the jobs do not read; None
    when they do (PNG or TIFF, 8 or 16 bit, grey, RGB or multi-channel; Aperio SVS, Hamamatsu
    NDPI; an OME-Zarr store; CZI and ND2 where their bioio reader is installed, which only the
    job can tell)."""
    suffix = PurePosixPath(path).suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return None
    if suffix in _INSTRUMENT_FORMATS:
        return f"is a {_INSTRUMENT_FORMATS[suffix]} file, which watchd does not read", _EXPORT
    named = f"is a '{suffix}' file" if suffix else "has no suffix"
    return f"{named}; watchd reads PNG and TIFF images", "save the image as .png or .tif"


def file_stem(path: str) -> str:
    """An input's file name without its last suffix: what pairs an image with its mask."""
    return PurePosixPath(path).stem


def truths_of(inputs: Sequence[InputFile]) -> dict[str, InputFile]:
    """{image path: its mask} of an inference batch's ground truth: a mask pairs with the image
    of the same file stem, as for training, where no other image or mask has that stem."""
    stems: dict[tuple[str, Role], list[InputFile]] = {}
    for item in inputs:
        stems.setdefault((file_stem(item.path), item.role), []).append(item)
    found = {}
    for (stem, role), images in stems.items():
        masks = stems.get((stem, Role.MASK), [])
        if role is Role.IMAGE and len(images) == 1 and len(masks) == 1:
            found[images[0].path] = masks[0]
    return found


def is_store(path: str) -> bool:
    """Whether the input named ``path`` is an OME-Zarr store (a folder), not a file."""
    return PurePosixPath(path).suffix.lower() == STORE_SUFFIX


def model_names(registry: Path) -> list[str]:
    """The models of a registry: its folders named by the rule ([] where it cannot be read;
    the rest of its layout is :mod:`models.catalog`'s)."""
    try:
        return sorted(
            p.name for p in registry.iterdir() if p.is_dir() and not model_name_problem(p.name)
        )
    except OSError:
        return []


def registered(registry: Path, name: str) -> tuple[list[int], dict[str, int]]:
    """A model's published version numbers (ascending) and its aliases, as the registry's
    folders and ``aliases.json`` say; both empty for a model not there, or unreadable."""
    if model_name_problem(name):
        return [], {}
    try:
        found = (VERSION_DIR.fullmatch(p.name) for p in (registry / name).iterdir())
        versions = sorted(int(match.group(1)) for match in found if match)
    except OSError:
        return [], {}
    try:
        data = json.loads((registry / name / ALIASES_FILE).read_text(encoding="utf-8"))
        aliases = {key: int(value) for key, value in data.items() if key in ALIASES}
    except (OSError, ValueError, TypeError, AttributeError):
        aliases = {}
    return versions, aliases


def unregistered(registry: Path, name: str, version: str) -> str:
    """Why the registry cannot give the model ``name`` at ``version`` ('latest', 'best' or a
    number), or '' when it can: what a job would fail with, said before it runs."""
    versions, aliases = registered(registry, name)
    if not versions:
        known = ", ".join(model_names(registry)) or "none"
        return f"no model named {name!r} in the registry (models there: {known})"
    text = str(version).strip().lower()
    number = aliases.get(text, versions[-1] if text == LATEST else None)
    if text.isdigit():
        number = int(text)
    if number in versions:
        return ""
    listed = ", ".join(map(str, versions))
    named = "".join(f", {key} = {value}" for key, value in sorted(aliases.items()))
    return f"model {name!r} has no version {text!r} (versions: {listed}{named})"


def model_name_problem(name: str) -> str:
    """What is wrong with ``name`` as a model's name ('' when nothing is): it names a folder
    of the registry, so it is one safe path component."""
    if MODEL_NAME.fullmatch(name) and ".." not in name:
        return ""
    return f"must be {MODEL_NAME_RULE}, without '..'"


GpuCompile = Literal["off", "compile", "graphs"]  # inference's gpu_compile


@dataclass(frozen=True)
class InferenceDefaults:
    """An inference batch's parameters where its manifest does not set them."""

    threshold: float = 0.5  # a pixel is foreground above this sigmoid probability
    min_object_area: int = 0  # smaller connected components are removed, in pixels
    # touching objects are cut apart where their neck is narrower than this share of the
    # thinner one's width (pipelines/instances.py); 0: objects are connected components
    split_neck: float = 0.93
    batch_size: int = 1  # images at once on the CPU
    tile_size: int = 512  # window of tiled inference, in pixels
    tile_overlap: int = 64
    max_whole_pixels: int = 2048 * 2048  # larger images are segmented tile by tile
    # images at once on a GPU; 0: as many as make 8 Mpx, within half the GPU's free memory
    gpu_batch_size: int = 0  # (pipelines/inference/placement.py)
    mixed_precision: bool = True  # on a GPU, fp16 or bf16 where the first batch agrees
    # on a GPU, the full batches of one size through torch.compile ("compile") or a captured
    # CUDA graph ("graphs") where their masks agree (pipelines/inference/device.py); ignored
    # on the CPU
    gpu_compile: GpuCompile = "off"
    channel: int | str | None = None  # a multi-channel TIFF's plane: its name or number
    # a slide's windows over glass only (its smallest level's grey within this of the glass's)
    # are not run through the net (pipelines/tissue.py); 0: every window runs
    glass_tolerance: float = 0.05


INFERENCE = InferenceDefaults()


def inference_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` over the defaults: a spec written by hand may leave any of them out."""
    return {**dataclasses.asdict(INFERENCE), **params}


@dataclass(frozen=True)
class AugmentDefaults:
    """How training batches vary each training image (pipelines/augment.py), where the manifest
    does not say; a strength 0 (or false) turns one off. Validation images are never varied."""

    augment_flips: bool = True  # mirrored up-down and left-right, each at even odds
    augment_turns: bool = True  # turned by a random quarter turn
    augment_intensity: float = 0.2  # grey × (1 ± up to this), plus up to ±half of it
    augment_gamma: float = 0.4  # grey ** e^(± up to this)
    augment_blur: float = 1.0  # Gaussian blur of up to this sigma, in pixels
    augment_noise: float = 0.03  # Gaussian noise of up to this standard deviation (grey 0-1)
    augment_vignetting: float = 0.3  # uneven light: darker away from a centre, by up to this


AUGMENT = AugmentDefaults()


def augment_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The augmentation parameters of ``params``, over the defaults."""
    defaults = dataclasses.asdict(AUGMENT)
    return {name: params.get(name, value) for name, value in defaults.items()}
