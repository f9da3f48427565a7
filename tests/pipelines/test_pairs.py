"""Pairing training images with masks, and reading them all with every problem reported."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from daemon.contract.jobspec import InputFile, Role
from pipelines.job import InputError
from pipelines.pairs import load_dataset, pair_inputs, split


def image(path: str) -> InputFile:
    return InputFile(path, role=Role.IMAGE)


def mask(path: str) -> InputFile:
    return InputFile(path, role=Role.MASK)


def test_images_pair_with_the_mask_of_the_same_stem_whatever_its_extension() -> None:
    pairs, problems = pair_inputs(
        [image("images/b.png"), mask("masks/a.tif"), image("images/a.png"), mask("masks/b.png")]
    )
    assert problems == []
    assert [(p.image.path, p.mask.path) for p in pairs] == [
        ("images/a.png", "masks/a.tif"),
        ("images/b.png", "masks/b.png"),
    ]


def test_unpaired_and_ambiguous_files_are_all_reported() -> None:
    pairs, problems = pair_inputs(
        [
            image("images/a.png"),
            mask("masks/a.png"),
            image("images/lonely.png"),
            mask("masks/orphan.png"),
            image("plate1/x.png"),
            image("plate2/x.png"),
            mask("masks/x.png"),
        ]
    )
    assert [p.stem for p in pairs] == ["a"]
    rendered = [p.render() for p in problems]
    assert any("'images/lonely.png'" in r and "no mask named 'lonely'" in r for r in rendered)
    assert any("'masks/orphan.png'" in r and "no image named 'orphan'" in r for r in rendered)
    assert any("2 images share the file name stem 'x'" in r for r in rendered)


def test_split_is_seeded_and_keeps_one_of_each() -> None:
    train, val = split(10, 0.25, seed=3)
    assert (train, val) == split(10, 0.25, seed=3)
    assert len(val) == 2 and sorted(train + val) == list(range(10))
    assert split(2, 0.0, seed=0)[1] and split(2, 0.99, seed=0)[0]


def test_every_bad_input_is_reported_before_training(synth: ModuleType, tmp_path: Path) -> None:
    synth.make_batch(tmp_path, "training", count=4, size=32, seed=0)
    synth.make_batch(tmp_path / "big", "training", count=1, size=40, seed=0)
    (tmp_path / "masks" / "img_0001.png").write_bytes(b"")
    (tmp_path / "big" / "masks" / "img_0000.png").replace(tmp_path / "masks" / "img_0002.png")
    inputs = [image(f"images/img_000{i}.png") for i in range(4)]
    inputs += [mask(f"masks/img_000{i}.png") for i in range(3)]
    inputs[0] = InputFile("images/img_0000.png", sha256="0" * 64, role=Role.IMAGE)
    with pytest.raises(InputError) as caught:
        load_dataset(tmp_path, inputs)
    rendered = "\n".join(p.render() for p in caught.value.problems)
    assert "input 'images/img_0000.png': sha256 is" in rendered
    assert "input 'masks/img_0001.png': the file is empty" in rendered
    assert "input 'masks/img_0002.png': the mask is 40×40 pixels" in rendered
    assert "input 'images/img_0003.png': no mask named 'img_0003'" in rendered
    assert len(caught.value.problems) == 4
