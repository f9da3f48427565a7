"""The LightningModule that trains a :class:`models.unet.UNet`: loss, metrics, optimiser."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics.classification import BinaryF1Score, BinaryJaccardIndex

from models.unet import UNet, segmentation_loss


class UNetModule(L.LightningModule):
    """Trains a :class:`UNet` with BCE + Dice loss and Adam; logs loss, Dice and IoU.

    Batches are ``(images, masks)``, both float (N, 1, H, W), masks 0/1. Logged per epoch:
    ``train_loss``, ``val_loss``, ``val_dice`` and ``val_iou`` (pixels of the whole validation
    set, prediction = sigmoid > 0.5; Dice is the pixel F1 score). Under DDP the losses are
    averaged over the ranks and the torchmetrics states are gathered, so every rank logs the
    same numbers. ``depth`` and ``width`` shape the :class:`UNet`.
    """

    def __init__(self, depth: int = 4, width: int = 16, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = UNet(depth=depth, width=width)
        self.learning_rate = learning_rate
        self.val_dice = BinaryF1Score()
        self.val_iou = BinaryJaccardIndex()

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, masks = batch
        loss = segmentation_loss(self(images), masks)
        self.log(
            "train_loss", loss, on_step=False, on_epoch=True, batch_size=len(images), sync_dist=True
        )
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, masks = batch
        logits = self(images)
        loss = segmentation_loss(logits, masks)
        self.log("val_loss", loss, on_epoch=True, batch_size=len(images), sync_dist=True)
        probabilities = torch.sigmoid(logits)
        self.val_dice(probabilities, masks.int())
        self.val_iou(probabilities, masks.int())
        self.log("val_dice", self.val_dice, on_epoch=True, batch_size=len(images))
        self.log("val_iou", self.val_iou, on_epoch=True, batch_size=len(images))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)
