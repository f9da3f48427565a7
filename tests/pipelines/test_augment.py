"""Training augmentations: what they change, what they leave, and the defaults they start from."""

from __future__ import annotations

import torch

from daemon.contract.names import AUGMENT
from pipelines.augment import Augmentations, blurred, vignette


def pattern(height: int = 24, width: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """An image with a bright square (its mask) off the centre, so moves show."""
    image = torch.full((height, width), 0.2)
    image[2:9, 3:12] = 0.8
    return image, (image > 0.5).float()


def test_the_defaults_turn_every_augmentation_on() -> None:
    augmentations = Augmentations.of({})
    assert augmentations.flips and augmentations.turns and augmentations.light
    assert augmentations == Augmentations.of(
        {name: getattr(AUGMENT, name) for name in vars(AUGMENT)}
    )
    assert Augmentations.of({"augment_noise": 0, "augment_turns": False}).noise == 0


def test_flips_alone_draw_what_the_flips_of_before_drew() -> None:
    """With only the flips on, a seeded training sees the very images it saw before the
    other augmentations existed (the old loop, written out here)."""
    image, mask = pattern()
    flips = Augmentations(flips=True)
    torch.manual_seed(3)
    new = [flips(image, mask) for _ in range(8)]
    torch.manual_seed(3)
    for got_image, got_mask in new:
        old_image, old_mask = image, mask
        for dim in (0, 1):
            if torch.rand(()) < 0.5:
                old_image, old_mask = old_image.flip(dim), old_mask.flip(dim)
        assert torch.equal(got_image, old_image) and torch.equal(got_mask, old_mask)


def test_geometry_moves_the_mask_with_the_image_and_light_leaves_the_mask() -> None:
    image, mask = pattern()
    torch.manual_seed(0)
    every = Augmentations.of({"augment_intensity": 0.5, "augment_noise": 0.1})
    for _ in range(20):
        varied, moved = every(image, mask)
        assert varied.shape == image.shape and 0 <= varied.min() <= varied.max() <= 1
        assert torch.equal(moved.sum(), mask.sum())  # a flip or turn of the same square
        inside, outside = varied[moved > 0].mean(), varied[moved == 0].mean()
        assert inside > outside  # the square went where its mask went
    geometry = Augmentations(flips=True, turns=True)
    torch.manual_seed(1)
    turned = {tuple(geometry(image, mask)[1].nonzero()[0].tolist()) for _ in range(40)}
    assert len(turned) >= 6  # corners the square was moved to, by flips and turns


def test_a_patch_that_is_not_square_keeps_its_shape() -> None:
    image, mask = pattern(16, 30)
    turns = Augmentations(turns=True)
    torch.manual_seed(2)
    assert {turns(image, mask)[0].shape for _ in range(20)} == {(16, 30)}


def test_nothing_asked_changes_nothing_and_each_light_change_has_its_effect() -> None:
    image, mask = pattern()
    assert Augmentations()(image, mask)[0] is image
    assert blurred(image, 0.1) is image
    soft = blurred(image, 1.5)
    assert soft.shape == image.shape and soft.max() < image.max()
    assert abs(float(soft.mean() - image.mean())) < 0.01  # blurring keeps the mean
    gain = vignette((24, 24), 0.3, 0.0, 0.0)
    assert float(gain[12, 12]) > 0.99 and abs(float(gain.min()) - 0.7) < 1e-5
