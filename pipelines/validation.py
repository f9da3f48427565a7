"""The kept weights on the validation images: the objects they find, as inference finds them.

After the fit (on rank 0), each validation image goes through the net once and its
probabilities through the inference job's own object step
(:func:`pipelines.instances.label_objects`) at the inference defaults (``threshold``,
``min_object_area``, ``split_neck`` of :data:`daemon.contract.names.INFERENCE`): the mask and
the objects an inference batch with default parameters would get. Against the image's true
objects (:func:`pipelines.quality.truth_objects` of its mask) each scores its objects and the
Dice of that mask; pooled over the validation images, the object scores are registered with
the version (:func:`metrics`).

Into the training folder: ``validation.csv`` (one row per validation image,
:data:`VALIDATION_COLUMNS`) and ``previews/`` (the best, the worst and a random image by Dice,
the objects found in orange, the true outlines in cyan).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass

import numpy as np
import torch

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.names import INFERENCE
from models.unet import UNet
from pipelines import figures
from pipelines.instances import label_objects
from pipelines.layout import PREVIEW_INDEX, PREVIEWS_DIR, VALIDATION_COLUMNS, VALIDATION_FILE
from pipelines.pairs import TrainingData
from pipelines.quality import ObjectScore, dice, score_objects, score_row, total


@dataclass(frozen=True)
class Checked:
    """One validation image: where it sits in the data, its objects' scores and the Dice of
    the mask they make, and that mask."""

    index: int
    objects: ObjectScore
    dice: float
    found: np.ndarray


@torch.inference_mode()
def evaluate(net: UNet, data: TrainingData, indices: list[int]) -> list[Checked]:
    """Each of the images ``indices`` through the net (one at a time: sizes may differ, on
    the device the net is on) and the inference defaults' object step."""
    net.eval()
    device = next(net.parameters()).device
    checked = []
    for index in indices:
        image = torch.from_numpy(data.images[index])[None, None].to(device)
        probabilities = torch.sigmoid(net(image))[0, 0].float().cpu().numpy()
        found = label_objects(probabilities, INFERENCE.threshold, INFERENCE.min_object_area,
                              INFERENCE.split_neck)  # fmt: skip
        score = score_objects(data.objects[index], found)
        checked.append(Checked(index, score, dice(found > 0, data.masks[index]), found))
    return checked


def metrics(checked: list[Checked]) -> dict[str, float | int | None]:
    """The pooled object scores, as registered with the version's other metrics."""
    figures = total(c.objects for c in checked).figures()
    return {
        "val_object_f1": figures["f1_50"],
        "val_matched_iou": figures["mean_matched_iou"],
        "val_count_error": figures["count_error"],
        "val_objects": figures["objects_true"],
        "val_objects_found": figures["objects_found"],
        "val_objects_matched": figures["matched"],
    }


def validation_csv(data: TrainingData, checked: list[Checked]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, VALIDATION_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for one in checked:
        writer.writerow({"image": data.pairs[one.index].image.path,
                         **score_row(one.objects, one.dice)})  # fmt: skip
    return buffer.getvalue()


def preview_picks(scores: list[float], seed: int) -> list[tuple[str, int]]:
    """(label, position) of the best, the worst and one random other score."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    picks = [("best", order[-1])]
    if len(order) > 1:
        picks.append(("worst", order[0]))
    rest = order[1:-1]
    if rest:
        picks.append(("random", rest[int(np.random.default_rng(seed).integers(len(rest)))]))
    return picks


def write(data: TrainingData, checked: list[Checked], training: HeldFolder, seed: int) -> None:
    """``validation.csv`` and the previews, into the held training folder."""
    training.write_text(VALIDATION_FILE, validation_csv(data, checked))
    entries = []
    for label, position in preview_picks([c.dice for c in checked], seed):
        one = checked[position]
        stem = data.pairs[one.index].stem
        picture = figures.overlay(data.images[one.index], one.found > 0, data.masks[one.index])
        training.write_bytes(f"{PREVIEWS_DIR}/{stem}.png", figures.png_bytes(picture))
        entries.append({"file": f"{stem}.png", "pick": label, "dice": round(one.dice, 4),
                        "objects_true": one.objects.true,
                        "objects_found": one.objects.found})  # fmt: skip
    index = json.dumps({"previews": entries}, indent=2, sort_keys=True, ensure_ascii=False)
    training.write_text(f"{PREVIEWS_DIR}/{PREVIEW_INDEX}", index + "\n")
