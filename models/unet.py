"""U-Net for binary segmentation of grey images, and its loss; torch only.

The registry stores the state_dict of this :class:`UNet`, and its metadata the constructor
arguments (:meth:`UNet.architecture`): inference rebuilds the net from torch alone, without
Lightning (which costs 1.5 s of imports per job). Training wraps it in
:class:`models.segmenter.UNetModule`.

The network standardises each input image itself (zero mean, unit variance per image): 8-bit,
16-bit and dim 12-bit-in-16 images reach the first convolution alike, and whoever loads the
weights needs no separate preprocessing step to get the same answers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_EPS = 1e-6


def _block(in_channels: int, out_channels: int) -> nn.Sequential:
    """Two 3×3 convolutions, each followed by batch norm and ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


def standardize(images: Tensor) -> Tensor:
    """Zero mean and unit variance per image of an (N, C, H, W) batch."""
    mean = images.mean(dim=(-2, -1), keepdim=True)
    std = images.std(dim=(-2, -1), keepdim=True)
    return (images - mean) / (std + _EPS)


class UNet(nn.Module):
    """U-Net with ``depth`` 2× down-sampling steps; level ``i`` has ``width * 2**i`` channels.

    Input (N, 1, H, W) of any H and W: the forward pass pads to a multiple of ``2**depth``
    (reflecting the border) and crops the logits back to (N, 1, H, W).
    """

    def __init__(self, depth: int = 4, width: int = 16, in_channels: int = 1) -> None:
        super().__init__()
        if depth < 1 or width < 1:
            raise ValueError(f"depth and width must be positive, got {depth} and {width}")
        self.depth = depth
        self.width = width
        self.in_channels = in_channels
        widths = [width * 2**level for level in range(depth + 1)]
        self.down = nn.ModuleList()
        previous = in_channels
        for channels in widths[:-1]:
            self.down.append(_block(previous, channels))
            previous = channels
        self.bottom = _block(widths[-2], widths[-1])
        self.upsample = nn.ModuleList()
        self.up = nn.ModuleList()
        for channels in reversed(widths[:-1]):
            self.upsample.append(nn.ConvTranspose2d(channels * 2, channels, 2, stride=2))
            self.up.append(_block(channels * 2, channels))
        self.head = nn.Conv2d(width, 1, 1)

    def architecture(self) -> dict[str, int]:
        """The constructor arguments, as recorded in the registry to rebuild the net."""
        return {"depth": self.depth, "width": self.width, "in_channels": self.in_channels}

    def forward(self, images: Tensor) -> Tensor:
        height, width = images.shape[-2:]
        x = self._pad(standardize(images))
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for upsample, block, skip in zip(self.upsample, self.up, reversed(skips), strict=True):
            x = block(torch.cat([upsample(x), skip], dim=1))
        return self.head(x)[..., :height, :width]

    def _pad(self, images: Tensor) -> Tensor:
        multiple = 2**self.depth
        height, width = images.shape[-2:]
        pad_h, pad_w = -height % multiple, -width % multiple
        if not pad_h and not pad_w:
            return images
        # Reflection needs the pad to be smaller than the side; tiny images replicate instead.
        mode = "reflect" if pad_h < height and pad_w < width else "replicate"
        return F.pad(images, (0, pad_w, 0, pad_h), mode=mode)


def dice_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Soft Dice loss over the whole batch (1 − Dice of the sigmoid probabilities)."""
    probabilities = torch.sigmoid(logits)
    intersection = (probabilities * targets).sum()
    total = probabilities.sum() + targets.sum()
    return 1 - (2 * intersection + 1) / (total + 1)


def segmentation_loss(logits: Tensor, masks: Tensor) -> Tensor:
    """Binary cross-entropy plus soft Dice loss: BCE for per-pixel calibration, Dice for overlap."""
    return F.binary_cross_entropy_with_logits(logits, masks) + dice_loss(logits, masks)
