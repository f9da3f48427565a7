"""The U-Net: any image size, its own input normalisation, a finite training loss."""

from __future__ import annotations

import pytest
import torch

from models.segmenter import UNetModule
from models.unet import UNet, dice_loss, segmentation_loss


@pytest.mark.parametrize(
    ("depth", "height", "width"), [(1, 9, 9), (2, 64, 64), (3, 37, 53), (3, 5, 7)]
)
def test_logits_have_the_input_size_for_any_size(depth: int, height: int, width: int) -> None:
    net = UNet(depth=depth, width=4).eval()
    with torch.inference_mode():
        logits = net(torch.rand(2, 1, height, width))
    assert logits.shape == (2, 1, height, width)
    assert torch.isfinite(logits).all()


def test_brightness_and_contrast_do_not_change_the_prediction() -> None:
    """8-bit, 16-bit and dim images give the same answer: the net standardises its input."""
    torch.manual_seed(0)
    net = UNet(depth=2, width=4).eval()
    image = torch.rand(1, 1, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(net(image), net(image * 0.06 + 0.01), atol=1e-3, rtol=1e-3)


def test_architecture_rebuilds_an_identical_net() -> None:
    net = UNet(depth=3, width=6)
    again = UNet(**net.architecture())
    again.load_state_dict(net.state_dict())
    assert net.architecture() == {"depth": 3, "width": 6, "in_channels": 1}


def test_dice_loss_is_zero_for_a_perfect_confident_prediction() -> None:
    masks = (torch.rand(2, 1, 8, 8) > 0.5).float()
    assert dice_loss((masks * 2 - 1) * 50, masks) < 1e-3
    assert dice_loss(-(masks * 2 - 1) * 50, masks) > 0.99


def test_one_optimiser_step_gives_a_finite_loss() -> None:
    module = UNetModule(depth=2, width=4, learning_rate=1e-2)
    optimiser = module.configure_optimizers()
    images, masks = torch.rand(2, 1, 24, 24), (torch.rand(2, 1, 24, 24) > 0.7).float()
    loss = segmentation_loss(module(images), masks)
    loss.backward()
    optimiser.step()
    assert torch.isfinite(loss)
