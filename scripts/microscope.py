"""How another microscope, lamp or day changes a synthetic DMA picture (scripts/synth.py).

A :class:`Look` holds the knobs; all zero is the generator's own picture, byte for byte (no
random number is drawn for it). Each knob is a strength, drawn per image from its own stream
(so turning one on changes nothing else of the image):

- ``illumination``: uneven light: a gain ramp across the image in a random direction (from
  1 − a to 1 + a) and a vignette darkening the corners by up to a;
- ``noise``: sensor noise: Gaussian, its standard deviation up to n (on the 0–1 grey scale);
- ``contrast``: another camera curve: a gamma of e^±c (its sign random, its size c/2 to c),
  then the grey levels squeezed about their mean by (1 − c/2);
- ``touching`` (the scene, not the picture: see :func:`synth.touching_pair`): the share of
  images whose spheroids are two in contact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Look:
    illumination: float = 0.0
    noise: float = 0.0
    contrast: float = 0.0
    touching: float = 0.0

    def __post_init__(self) -> None:
        for name in ("illumination", "noise", "contrast", "touching"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be within 0 and 1, not {value}")

    @property
    def shifts(self) -> bool:
        """Whether the picture is changed (not only the scene)."""
        return bool(self.illumination or self.noise or self.contrast)


DEFAULT = Look()


def shifted(rng: np.random.Generator, image: np.ndarray, look: Look) -> np.ndarray:
    """``image`` (float32 grey in [0, 1]) as ``look``'s microscope shows it, in [0, 1]."""
    size = image.shape[0]
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1) - 0.5
    out = image.astype(np.float32)
    if look.illumination:
        angle = rng.uniform(0, 2 * np.pi)
        ramp = 2 * (yy * np.sin(angle) + xx * np.cos(angle))  # -1 … 1 across the image
        corners = 2 * (yy**2 + xx**2)  # 0 at the centre, 1 in the corners
        strength = rng.uniform(0.5, 1.0) * look.illumination
        out = out * (1 + strength * ramp) * (1 - strength * corners)
    if look.contrast:
        gamma = np.exp(rng.choice((-1, 1)) * rng.uniform(0.5, 1.0) * look.contrast)
        out = np.clip(out, 0, 1) ** gamma
        mean = float(out.mean())
        out = mean + (out - mean) * (1 - look.contrast / 2)
    if look.noise:
        out = out + rng.normal(0, rng.uniform(0.5, 1.0) * look.noise, out.shape)
    return np.clip(out, 0, 1).astype(np.float32)
