"""The manifest document as written: the pydantic models of its sections, with every bound and
default. Pure.

daemon/core/manifest.py parses a manifest's text against ``ManifestModel`` into the Manifest the
daemon uses; docs/manifest.schema.json is generated from it by ``watchctl manifest --schema``
(so a docstring here is a description there).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from email.errors import HeaderParseError
from email.headerregistry import Address
from typing import Annotated, Any, Literal

import pydantic
from pydantic import AfterValidator, Field

from daemon.contract.jobspec import Role
from daemon.contract.names import AUGMENT, INFERENCE, GpuCompile, model_name_problem
from daemon.core.sweep import SweepModel
from daemon.core.visible import hidden_characters

FORMAT_VERSION = 1
MAX_INPUTS = 1_000_000
MAX_PATTERNS = 1000

SHA256_RE = r"^[0-9a-fA-F]{64}$"


class Kind(enum.Enum):
    TRAINING = "training"
    INFERENCE = "inference"
    SWEEP = "sweep"  # several trainings over a search space ([sweep]); the best is registered

    @property
    def trains(self) -> bool:
        """Whether the batch trains (image/mask pairs, no model version to name)."""
        return self is not Kind.INFERENCE


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=False)


# Which plane of a multi-channel TIFF to segment (OME-TIFF, ImageJ): a channel's name as the
# instrument wrote it, or its number from 0; files of one channel ignore it.
Channel = (
    Annotated[int, Field(ge=0, le=1023)]
    | Annotated[str, Field(min_length=1, max_length=256)]
    | None
)


class TrainingParams(_Strict):
    """Parameters of a training batch; every one has a default and bounds."""

    epochs: Annotated[int, Field(ge=1, le=500)] = 20
    batch_size: Annotated[int, Field(ge=1, le=256)] = 8
    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-3
    val_fraction: Annotated[float, Field(ge=0.05, le=0.5)] = 0.2
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    depth: Annotated[int, Field(ge=2, le=6)] = 3
    width: Annotated[int, Field(ge=4, le=128)] = 16
    patience: Annotated[int, Field(ge=1, le=100)] = 5
    best_metric: Literal["val_dice", "val_iou", "val_object_f1"] = "val_dice"
    best_margin: Annotated[float, Field(ge=0, le=0.5)] = 0.0
    channel: Channel = INFERENCE.channel  # the images' plane, as for inference
    # how each training image is varied (validation images never are); 0 or false: not
    augment_flips: bool = AUGMENT.augment_flips
    augment_turns: bool = AUGMENT.augment_turns
    augment_intensity: Annotated[float, Field(ge=0, le=1)] = AUGMENT.augment_intensity
    augment_gamma: Annotated[float, Field(ge=0, le=2)] = AUGMENT.augment_gamma
    augment_blur: Annotated[float, Field(ge=0, le=10)] = AUGMENT.augment_blur
    augment_noise: Annotated[float, Field(ge=0, le=0.5)] = AUGMENT.augment_noise
    augment_vignetting: Annotated[float, Field(ge=0, le=0.9)] = AUGMENT.augment_vignetting


class InferenceParams(_Strict):
    """Parameters of an inference batch."""

    threshold: Annotated[float, Field(gt=0, lt=1)] = INFERENCE.threshold
    min_object_area: Annotated[int, Field(ge=0, le=10**8)] = INFERENCE.min_object_area
    split_neck: Annotated[float, Field(ge=0, lt=1)] = INFERENCE.split_neck
    batch_size: Annotated[int, Field(ge=1, le=256)] = INFERENCE.batch_size
    tile_size: Annotated[int, Field(ge=64, le=8192)] = INFERENCE.tile_size
    tile_overlap: Annotated[int, Field(ge=0, le=1024)] = INFERENCE.tile_overlap
    max_whole_pixels: Annotated[int, Field(ge=1, le=2**31)] = INFERENCE.max_whole_pixels
    gpu_batch_size: Annotated[int, Field(ge=0, le=1024)] = INFERENCE.gpu_batch_size
    mixed_precision: bool = INFERENCE.mixed_precision
    gpu_compile: GpuCompile = INFERENCE.gpu_compile
    channel: Channel = INFERENCE.channel
    glass_tolerance: Annotated[float, Field(ge=0, le=1)] = INFERENCE.glass_tolerance

    @pydantic.field_validator("tile_overlap")
    @classmethod
    def _overlap_below_half(cls, overlap: int, info: pydantic.ValidationInfo) -> int:
        """Windows advance by tile_size - tile_overlap pixels: an overlap of half a window or
        more would segment every pixel four times or more (at 64/63, some 4000 times)."""
        size = info.data.get("tile_size")  # absent when tile_size itself is wrong
        if isinstance(size, int) and overlap >= size // 2:
            raise ValueError(
                f"must be less than half of tile_size ({size}): at most {size // 2 - 1}"
            )
        return overlap


PARAMS_BY_KIND: Mapping[Kind, type[_Strict]] = {
    Kind.TRAINING: TrainingParams,
    Kind.INFERENCE: InferenceParams,
    Kind.SWEEP: TrainingParams,
}


def _one_plain_line(value: str) -> str:
    """Text shown in the status file, ``watchctl`` and the log: one line, no control codes (a
    newline would forge a line of the status file, an escape code act on a terminal)."""
    found = hidden_characters(value)
    if found:
        raise ValueError(
            "must be one line of plain text, without control or formatting characters "
            f"(it contains {', '.join(found)})"
        )
    return value


PlainLine = Annotated[str, AfterValidator(_one_plain_line)]


def is_one_address(value: str) -> bool:
    """Whether ``value`` is exactly one e-mail address (``a@example.org,root`` is two: a mail
    to it would go to root too), with no space or control character (a line break would start
    another header)."""
    if not re.fullmatch(r"[^@\s]+@[^@\s]+", value) or not value.isprintable():
        return False
    try:
        return Address(addr_spec=value).addr_spec == value
    except (ValueError, IndexError, HeaderParseError):  # IndexError: the parser's own slip
        return False


def _email(value: str) -> str:
    if not is_one_address(value):
        raise ValueError("must be one e-mail address, such as name@example.org")
    return value


class OwnerModel(_Strict):
    name: Annotated[PlainLine, Field(min_length=1, max_length=200)]
    email: (
        Annotated[
            str,
            Field(max_length=200, description="One e-mail address, such as name@example.org"),
            AfterValidator(_email),
        ]
        | None
    ) = None


def _model_name(value: str) -> str:
    if problem := model_name_problem(value):
        raise ValueError(problem)
    return value


def _sha256(value: str) -> str:
    if not re.match(SHA256_RE, value):
        raise ValueError("must be 64 hexadecimal digits (the output of sha256sum)")
    return value.lower()


class ModelSection(_Strict):
    name: Annotated[str, AfterValidator(_model_name)]
    version: str | int | None = None


class FileEntry(_Strict):
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    size: Annotated[int, Field(ge=0)] | None = None
    sha256: Annotated[str, AfterValidator(_sha256)] | None = None
    role: Role = Role.IMAGE


class PatternEntry(_Strict):
    glob: Annotated[str, Field(min_length=1, max_length=4096)]
    role: Role = Role.IMAGE
    count: Annotated[int, Field(ge=1, le=MAX_INPUTS)] | None = None


class ResourcesSection(_Strict):
    """What a batch asks of the cluster, instead of the site's defaults. The site's bounds
    (``executor.slurm.max_*`` in the daemon's config) are checked when the batch is taken in."""

    time_minutes: Annotated[int, Field(ge=1, le=365 * 24 * 60)] | None = None
    memory_mb: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    gpus: Annotated[int, Field(ge=0, le=1024)] | None = None
    tasks: Annotated[int, Field(ge=1, le=1024)] | None = None


class ManifestModel(_Strict):
    """The manifest document as written (the JSON schema in docs/ is generated from this)."""

    watchd: Literal[1]
    kind: Kind
    title: Annotated[PlainLine, Field(max_length=500)] = ""
    owner: OwnerModel
    model: ModelSection
    params: dict[str, Any] = {}
    files: Annotated[list[FileEntry], Field(max_length=MAX_INPUTS)] = []
    patterns: Annotated[list[PatternEntry], Field(max_length=MAX_PATTERNS)] = []
    resources: ResourcesSection = ResourcesSection()
    sweep: SweepModel | None = None
