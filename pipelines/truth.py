"""An inference batch's ground truth: the objects found in each image against its true ones.

An inference batch may carry masks (inputs of role ``mask``, a ``masks/`` folder beside
``images/``), paired with the images by file stem as for training. The report job then reads,
for each image segmented whole that has one, the true mask (through the held batch folder,
checked against the manifest like any input) and the mask the inference job wrote (through
the held run folder, read no further than such a mask can be long), and scores the objects
found, the 8-connected components of that mask, against the true ones
(:mod:`pipelines.quality`). Images segmented window by window are not scored (their masks are
label images too large to hold whole).

A truth that cannot be scored (unreadable, of another size than its image, its image's mask
missing) is a note in the report, not a failed report: the masks were the owner's addition.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile, Role
from daemon.contract.names import truths_of
from pipelines.images import UnreadableImage, decode, read_image
from pipelines.instances import components
from pipelines.job import InputError, log
from pipelines.layout import MASKS_DIR, QUALITY_COLUMNS, mask_name
from pipelines.quality import ObjectScore, dice, score_objects, score_row, total, truth_objects

_MASK_SLACK = 1 << 20  # bytes a written mask may hold beyond one byte a pixel (its headers)


@dataclass
class Scored:
    """The images scored against their truth, and those that could not be."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    scores: list[ObjectScore] = field(default_factory=list)
    shared: int = 0  # foreground pixels in both masks, over every image scored
    foreground: int = 0  # foreground pixels of the found and the true masks, summed
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """What summary.json says of it: the pooled scores, the pixels' Dice, the notes."""
        pixels = 1.0 if self.foreground == 0 else 2 * self.shared / self.foreground
        return {**total(self.scores).figures(), "dice": round(pixels, 4),
                "table": "quality.csv", "not_scored": self.notes}  # fmt: skip

    def csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, QUALITY_COLUMNS, lineterminator="\n",
                                quoting=csv.QUOTE_ALL)  # fmt: skip
        writer.writeheader()
        writer.writerows(self.rows)
        return buffer.getvalue()


def score_batch(
    inputs: Sequence[InputFile], rows: Sequence[dict[str, str]], batch: HeldFolder,
    run: HeldFolder,
) -> Scored | None:  # fmt: skip
    """Every table row with a true mask scored, in the table's order; None without masks."""
    if not any(item.role is Role.MASK for item in inputs):
        return None
    paired = truths_of(inputs)  # an image without a mask is simply not scored
    scored = Scored()
    used = {mask.path for mask in paired.values()}
    unpaired = [item for item in inputs if item.role is Role.MASK and item.path not in used]
    scored.notes += [f"{item.path}: no image, or more than one, has its file name (stem)"
                     for item in unpaired]  # fmt: skip
    for row in rows:
        mask = paired.get(row["path"])
        if mask is None:
            continue
        if row.get("tiled") == "1":
            scored.notes.append(f"{row['path']}: segmented window by window, not scored")
            continue
        try:
            true_ids, found = _masks(batch, run, row, mask)
        except _NotScored as exc:
            scored.notes.append(f"{row['path']}: {exc}")
            continue
        _add(scored, row["path"], mask.path, true_ids, found)
    if scored.notes:
        log.warning("%d image(s) with ground truth not scored, e.g. %s", len(scored.notes),
                    scored.notes[0])  # fmt: skip
    return scored


class _NotScored(Exception):
    pass


def _masks(
    batch: HeldFolder, run: HeldFolder, row: dict[str, str], mask: InputFile
) -> tuple[np.ndarray, np.ndarray]:
    """(true ids, found ids) of one image, or _NotScored saying why not."""
    try:
        truth = read_image(batch, mask)
    except InputError as exc:
        raise _NotScored("; ".join(problem.render() for problem in exc.problems)) from exc
    height, width = int(row["height"]), int(row["width"])
    if truth.shape != (height, width):
        raise _NotScored(f"its mask {mask.path!r} is {truth.shape[1]}×{truth.shape[0]} pixels, "
                         f"the image {width}×{height}")  # fmt: skip
    try:
        found = written_mask(run, row) > 0.5
    except (OSError, UnreadableImage) as exc:
        written = f"{MASKS_DIR}/{mask_name(row['path'])}"
        raise _NotScored(f"{written} cannot be read ({exc})") from exc
    return truth_objects(truth), components(found, 0)


def written_mask(run: HeldFolder, row: dict[str, str]) -> np.ndarray:
    """The mask the inference job wrote for ``row``'s image, through the held run folder, read
    no further than such a mask can be long, and only if it has no other hard link: one with
    another link was put there, and may be a file its owner may not read (an NFS server links
    what anyone names; fs.protected_hardlinks = 0). OSError or UnreadableImage otherwise."""
    limit = int(row["height"]) * int(row["width"]) + _MASK_SLACK
    with run.open_read(f"{MASKS_DIR}/{mask_name(row['path'])}", sole=True) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnreadableImage("larger than a mask of its image can be", "")
    return decode(data)


def _add(scored: Scored, path: str, mask: str, true_ids: np.ndarray, found: np.ndarray) -> None:
    score = score_objects(true_ids, found)
    shared = int(((true_ids > 0) & (found > 0)).sum())
    both = int((true_ids > 0).sum()) + int((found > 0).sum())
    scored.scores.append(score)
    scored.shared += shared
    scored.foreground += both
    dice_value = dice(found > 0, true_ids > 0)
    scored.rows.append({"path": path, "mask": mask, **score_row(score, dice_value)})
