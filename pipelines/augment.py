"""How a training image is varied each time a batch draws it, so that the net learns the
spheroids and not one microscope's lamp, camera or focus.

Geometric changes move the mask with the image: mirrored up-down and left-right at even odds
(``augment_flips``), turned by a random quarter turn (``augment_turns``; half turns only for a
patch that is not square, which must keep its shape to share a batch). Changes of the light
touch the image alone, each at a strength drawn anew from none to its parameter, in this order:
uneven light, a vignette around a centre anywhere in the middle half of the image, darkening by
up to ``augment_vignetting`` at the far corner; a camera curve, grey ** e^g with g within
± ``augment_gamma``; gain and offset, grey × (1 ± ``augment_intensity``) ± half of it, clipped to
0–1 as a sensor saturates; a Gaussian blur of sigma up to ``augment_blur`` pixels (out of focus);
Gaussian noise of standard deviation up to ``augment_noise``, clipped again.

Random numbers come from torch's generator, which the fit seeds (``L.seed_everything``): with
only the flips on, the draws are those of the flips before this module existed, so such a
training is what it was. Validation images are never varied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from daemon.contract.names import augment_params

_SHARPEST = 0.3  # a blur of smaller sigma is no blur at 1 pixel: skipped


def _uniform(high: float, low: float | None = None) -> float:
    """A draw from torch's generator, within ``low`` (default: −``high``) and ``high``."""
    low = -high if low is None else low
    return low + (high - low) * float(torch.rand(()))


@dataclass(frozen=True)
class Augmentations:
    flips: bool = False
    turns: bool = False
    intensity: float = 0.0
    gamma: float = 0.0
    blur: float = 0.0
    noise: float = 0.0
    vignetting: float = 0.0

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> Augmentations:
        """The training parameters' augmentations (the defaults where they say nothing)."""
        values = augment_params(params)
        return cls(**{name.removeprefix("augment_"): value for name, value in values.items()})

    @property
    def light(self) -> bool:
        return any((self.intensity, self.gamma, self.blur, self.noise, self.vignetting))

    def __call__(self, image: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """A varied copy of ``image`` (H, W) grey in [0, 1], and its ``mask`` (H, W) moved
        alike."""
        if self.flips:
            for dim in (0, 1):
                if torch.rand(()) < 0.5:
                    image, mask = image.flip(dim), mask.flip(dim)
        if self.turns:
            square = image.shape[0] == image.shape[1]
            turns = int(torch.randint(4, ())) if square else 2 * int(torch.randint(2, ()))
            image, mask = torch.rot90(image, turns, (0, 1)), torch.rot90(mask, turns, (0, 1))
        if self.light:
            image = self._lit(image)
        return image, mask

    def _lit(self, image: Tensor) -> Tensor:
        if self.vignetting:
            image = image * vignette(image.shape, _uniform(self.vignetting, 0), _uniform(0.25),
                                     _uniform(0.25))  # fmt: skip
        if self.gamma:
            image = image.clamp(0, 1) ** math.exp(_uniform(self.gamma))
        if self.intensity:
            gain, offset = 1 + _uniform(self.intensity), _uniform(self.intensity / 2)
            image = (image * gain + offset).clamp(0, 1)
        if self.blur:
            image = blurred(image, _uniform(self.blur, 0))
        if self.noise:
            image = image + torch.randn(image.shape) * _uniform(self.noise, 0)
        return image.clamp(0, 1)


def vignette(shape: tuple[int, ...], depth: float, up: float, right: float) -> Tensor:
    """A gain (H, W): 1 at a centre ``up`` and ``right`` of the middle (shares of the image's
    height and width), falling with the squared distance to 1 − ``depth`` at the farthest
    corner."""
    height, width = shape
    yy = torch.linspace(-0.5, 0.5, height)[:, None] - up
    xx = torch.linspace(-0.5, 0.5, width)[None, :] - right
    squared = yy**2 + xx**2
    return 1 - depth * squared / squared.max().clamp_min(1e-6)


def blurred(image: Tensor, sigma: float) -> Tensor:
    """``image`` (H, W) under a Gaussian blur of ``sigma`` pixels (reflected at its edges)."""
    if sigma < _SHARPEST:
        return image
    radius = min(math.ceil(3 * sigma), min(image.shape) - 1)
    if radius < 1:
        return image
    steps = torch.arange(-radius, radius + 1, dtype=image.dtype)
    kernel = torch.exp(-(steps**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    padded = F.pad(image[None, None], (radius, radius, radius, radius), mode="reflect")
    rows = F.conv2d(padded, kernel.view(1, 1, -1, 1))
    return F.conv2d(rows, kernel.view(1, 1, 1, -1))[0, 0]
