"""Training data: pair each image with its ground-truth mask and load them all, checked.

An image pairs with the mask of the same file stem (``images/a.png`` ↔ ``masks/a.tif``).
Every input is read before training starts, so a bad batch fails in seconds with the complete
list of what is wrong (unpaired files, ambiguous stems, unreadable files, checksum mismatches,
masks of the wrong size) instead of failing at epoch 40 on the first one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from daemon.contract.jobspec import InputFile, Problem, Role
from daemon.contract.safeopen import Folder
from pipelines.images import read_image, where
from pipelines.job import InputError
from pipelines.quality import truth_objects


@dataclass(frozen=True)
class Pair:
    image: InputFile
    mask: InputFile

    @property
    def stem(self) -> str:
        return PurePosixPath(self.image.path).stem


@dataclass(frozen=True)
class TrainingData:
    """Loaded pairs: images float32 (H, W) in [0, 1], masks boolean of the same shape, and the
    masks' objects (ids 1…N, 0 outside: :func:`pipelines.quality.truth_objects`)."""

    pairs: tuple[Pair, ...]
    images: tuple[np.ndarray, ...]
    masks: tuple[np.ndarray, ...]
    objects: tuple[np.ndarray, ...]


def _by_stem(items: Sequence[InputFile], role: str) -> tuple[dict[str, InputFile], list[Problem]]:
    groups: dict[str, list[InputFile]] = defaultdict(list)
    for item in items:
        groups[PurePosixPath(item.path).stem].append(item)
    unique = {stem: group[0] for stem, group in groups.items() if len(group) == 1}
    problems = [
        Problem(
            where(group[0]),
            f"{len(group)} {role}s share the file name stem {stem!r}: "
            + ", ".join(repr(item.path) for item in group),
            "images and masks are paired by file name; give each a unique name",
        )
        for stem, group in groups.items()
        if len(group) > 1
    ]
    return unique, problems


def pair_inputs(inputs: Sequence[InputFile]) -> tuple[list[Pair], list[Problem]]:
    """Pair images with masks by file stem; report unpaired and ambiguous files."""
    images, problems = _by_stem([i for i in inputs if i.role is Role.IMAGE], "image")
    masks, mask_problems = _by_stem([i for i in inputs if i.role is Role.MASK], "mask")
    problems += mask_problems
    pairs = [Pair(image, masks[stem]) for stem, image in sorted(images.items()) if stem in masks]
    hint = "every training image needs a mask with the same file name stem"
    problems += [
        Problem(where(image), f"no mask named {stem!r}.* for this image", hint)
        for stem, image in sorted(images.items())
        if stem not in masks
    ]
    problems += [
        Problem(where(mask), f"no image named {stem!r}.* for this mask", hint)
        for stem, mask in sorted(masks.items())
        if stem not in images
    ]
    return pairs, problems


def _load_pair(
    batch_dir: Folder, pair: Pair, channel: Any = None
) -> tuple[np.ndarray | None, np.ndarray | None, list[Problem]]:
    """Read both files of a pair (the image's plane ``channel``; the mask as decoded),
    collecting the problems of each."""
    loaded: list[np.ndarray | None] = []
    problems: list[Problem] = []
    for item, plane in ((pair.image, channel), (pair.mask, None)):
        try:
            loaded.append(read_image(batch_dir, item, plane))
        except InputError as exc:
            loaded.append(None)
            problems += exc.problems
    image, mask = loaded
    if image is not None and mask is not None and image.shape != mask.shape:
        problems.append(
            Problem(
                where(pair.mask),
                f"the mask is {mask.shape[1]}×{mask.shape[0]} pixels, its image "
                f"{pair.image.path!r} is {image.shape[1]}×{image.shape[0]}",
                "a mask must have the size of its image",
            )
        )
    return image, mask, problems


def load_dataset(
    batch_dir: Folder, inputs: Sequence[InputFile], channel: Any = None
) -> TrainingData:
    """Pair and read every input (the images' plane ``channel``); raise InputError listing
    every problem found."""
    pairs, problems = pair_inputs(inputs)
    images: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    objects: list[np.ndarray] = []
    for pair in pairs:
        image, mask, pair_problems = _load_pair(batch_dir, pair, channel)
        problems += pair_problems
        if image is not None and mask is not None:
            images.append(image)
            masks.append(mask > 0)
            objects.append(compact(truth_objects(mask)))
    if len(pairs) < 2 and not problems:
        problems.append(
            Problem(
                "inputs",
                f"{len(pairs)} image/mask pair(s); training needs at least 2",
                "add more annotated images",
            )
        )
    if problems:
        raise InputError(f"{len(problems)} problem(s) with the training inputs", problems)
    return TrainingData(tuple(pairs), tuple(images), tuple(masks), tuple(objects))


def compact(ids: np.ndarray) -> np.ndarray:
    """``ids`` in the smallest unsigned type that holds them (most masks: a byte a pixel)."""
    return ids.astype(np.min_scalar_type(int(ids.max(initial=0))))


def split(count: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices for training and validation: a seeded shuffle, at least one of each."""
    order = np.random.default_rng(seed).permutation(count).tolist()
    val_count = min(max(1, round(count * val_fraction)), count - 1)
    return sorted(order[val_count:]), sorted(order[:val_count])
