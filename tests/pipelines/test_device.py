"""Where an inference job runs its net, how many images at once, in what precision and whether
compiled (pipelines/inference/placement.py, pure), and the device stage on this GPU-less
machine."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from daemon.contract.jobspec import JobSpec, ModelRef, Pipeline, Resources
from models import registry
from models.unet import UNet
from pipelines.inference.device import DeviceStage
from pipelines.inference.masks import Rules
from pipelines.inference.placement import (
    AGREEMENT,
    BFLOAT,
    COUNT_AGREEMENT,
    FULL,
    HALF,
    TF32,
    Placement,
    choose_device,
    compile_plan,
    decided,
    precision_verdict,
    sized_batch,
)
from pipelines.instances import components

PARAMS = {"batch_size": 1, "threshold": 0.5, "min_object_area": 0}
GIB = 2**30


@pytest.mark.parametrize(
    ("gpus", "environ", "cuda", "device", "why"),
    [
        (0, {}, 4, "cpu", "no GPU was given to this job"),
        (0, {"CUDA_VISIBLE_DEVICES": "2"}, 1, "cpu", "no GPU was given to this job"),
        (1, {"CUDA_VISIBLE_DEVICES": ""}, 4, "cpu", "hides every GPU"),
        (1, {"CUDA_VISIBLE_DEVICES": "-1"}, 4, "cpu", "hides every GPU"),
        (1, {}, 0, "cpu", "CUDA shows none"),
        (1, {"CUDA_VISIBLE_DEVICES": "3"}, 1, "cuda:0", "CUDA_VISIBLE_DEVICES=3"),  # Slurm's
        (2, {}, 2, "cuda:0", "every GPU visible"),
    ],
)
def test_the_job_runs_on_the_gpu_it_was_given_and_says_why_not_otherwise(
    gpus: int, environ: dict[str, str], cuda: int, device: str, why: str
) -> None:
    where = choose_device(gpus, environ, cuda, PARAMS)
    assert where.device == device and why in where.reason
    assert where.cuda is (device != "cpu")
    if where.cuda:  # sized by the images and the GPU's memory; every faster precision tried
        assert (where.batch_size, where.candidates()) == (0, (HALF, BFLOAT, TF32))
    else:
        assert (where.batch_size, where.candidates()) == (1, ())


def test_the_gpu_batch_and_precision_follow_the_parameters() -> None:
    params = {**PARAMS, "batch_size": 4, "gpu_batch_size": 64, "mixed_precision": False}
    where = choose_device(1, {}, 1, params)
    assert (where.batch_size, where.candidates()) == (64, (TF32,))
    assert choose_device(0, {}, 1, params).batch_size == 4


@pytest.mark.parametrize(
    ("pixels", "bytes_per_pixel", "free", "given", "expected"),
    [
        (256 * 256, 400, 100 * GIB, 0, 128),  # 8 Mpx of 256² images
        (1024 * 1024, 400, 100 * GIB, 0, 8),
        (4096 * 4096, 400, 100 * GIB, 0, 1),  # one image is more than 8 Mpx: still one
        (256 * 256, 400, 2 * GIB, 0, 40),  # half of 2 GiB holds 40 at 26 MB each
        (256 * 256, 400, 1, 0, 1),  # never none
        (64 * 64, 400, 100 * GIB, 0, 1024),  # never more than 1024
        (256 * 256, 400, 1, 16, 16),  # the manifest's gpu_batch_size, whatever the memory
    ],
)
def test_a_gpu_batch_is_sized_by_its_images_pixels_and_the_gpus_free_memory(
    pixels: int, bytes_per_pixel: float, free: int, given: int, expected: int
) -> None:
    assert sized_batch(pixels, bytes_per_pixel, free, given) == expected


def _masks(seed: int, flips: int, blob: bool = False) -> list[np.ndarray]:
    """Two 100×100 masks with a square object each; ``flips`` pixels of the square's inside
    flipped in the first (objects unchanged), or a lone new pixel far from it (``blob``)."""
    masks = [np.zeros((100, 100), dtype=bool) for _ in range(2)]
    for mask in masks:
        mask[20:60, 20:60] = True
    rows = np.random.default_rng(seed).choice(np.arange(30, 50), size=flips, replace=False)
    masks[0][rows, 40] = False
    if blob:
        masks[0][90, 90] = True
    return masks


def test_a_faster_precision_is_kept_when_its_masks_agree_within_the_tolerance() -> None:
    full = _masks(0, 0)
    count = lambda mask: int(components(mask, 0).max())  # noqa: E731
    same = precision_verdict(HALF, full, _masks(0, 0), count)
    assert (same.agreement, same.counts_equal, same.accepted) == (1.0, True, True)
    close = precision_verdict(HALF, full, _masks(1, 15), count)  # 15 of 20,000 pixels
    assert close.agreement == pytest.approx(1 - 15 / 20_000) and close.accepted
    far = precision_verdict(HALF, full, _masks(1, 20), count)  # 0.999 is the line
    assert far.agreement == 1 - 20 / 20_000 == AGREEMENT and far.accepted
    worse_masks = _masks(2, 20)
    worse_masks[1][0:3, 0:3] = True
    worse = precision_verdict(BFLOAT, full, worse_masks, count)
    assert worse.agreement < AGREEMENT and not worse.accepted
    new_object = precision_verdict(TF32, full, _masks(3, 0, blob=True), count)
    assert new_object.agreement > AGREEMENT and not new_object.counts_equal
    assert new_object.counted_alike == 1 and not new_object.accepted
    assert "as many objects in 1 of 2 images (need 0.99): not kept" in new_object.said()
    assert decided([worse, new_object, close]) == HALF
    assert decided([worse, new_object]) == decided([]) == FULL
    with pytest.raises(ValueError, match="1 masks in full precision against 2"):
        precision_verdict(HALF, full[:1], full, count)


def test_one_image_in_a_hundred_may_count_a_speck_more_in_a_faster_precision() -> None:
    """A lone pixel flipped into a new object in one image of 100 is within the tolerance
    (COUNT_AGREEMENT); in two of them, or in one of 99, it is not."""
    count = lambda mask: int(components(mask, 0).max())  # noqa: E731
    full = [_masks(0, 0)[1] for _ in range(100)]
    specked = _masks(0, 0, blob=True)[0]

    def with_specks(images: int, specks: int) -> list[np.ndarray]:
        return [specked if i < specks else full[0] for i in range(images)]

    one = precision_verdict(HALF, full, with_specks(100, 1), count)
    assert (one.counted_alike, one.count_agreement, one.accepted) == (99, COUNT_AGREEMENT, True)
    assert not one.counts_equal and "as many objects in 99 of 100 images" in one.said()
    assert not precision_verdict(HALF, full, with_specks(100, 2), count).accepted
    assert not precision_verdict(HALF, full[:99], with_specks(99, 1), count).accepted


@pytest.fixture(scope="module")
def net() -> UNet:
    torch.manual_seed(0)
    return UNet(depth=2, width=4).eval().to(memory_format=torch.channels_last)


def test_on_the_cpu_the_stage_gives_the_masks_and_confidences_the_job_always_made(
    net: UNet,
) -> None:
    """Threshold of the sigmoid, and the mean of |2p - 1|, from numpy as before; batches come
    back in the order submitted; no precision is checked (full precision on the CPU)."""
    images = np.random.default_rng(0).random((5, 32, 32), dtype=np.float32)
    where = choose_device(1, {}, 0, PARAMS)  # CUDA shows no GPU (on a GPU node too)
    assert where.device == "cpu"
    torch.set_num_threads(2)
    stage = DeviceStage(net, where, 0.5, Rules(0, 0.0, False))
    assert stage.batch_size((32, 32)) == 1
    stage.submit([images[0]], "first")
    stage.submit(list(images[1:]), "rest")
    assert torch.get_num_threads() == 2
    (first, masks_1, sure_1), (rest, masks_4, sure_4) = stage.done()
    assert (first, rest) == ("first", "rest") and stage.done() == [] and not stage.busy
    with torch.inference_mode():
        probabilities = torch.sigmoid(net(torch.from_numpy(images)[:, None]))[:, 0].numpy()
    np.testing.assert_array_equal(np.concatenate([masks_1, masks_4]), probabilities > 0.5)
    expected = [float(np.abs(2 * p - 1).mean()) for p in probabilities]
    np.testing.assert_allclose(np.concatenate([sure_1, sure_4]), expected, rtol=1e-6)
    np.testing.assert_array_equal(stage.probabilities(images[:2]), probabilities[:2])
    assert stage.summary() == {"device": "cpu", "precision": FULL, "checks": [],
                               "compile": "off", "compile_checks": []}  # fmt: skip
    assert Placement("cpu", 1, True, "").candidates() == ()


def test_past_torchs_limit_of_compiled_graphs_a_size_runs_eager_and_says_so(
    net: UNet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process compiles the net once per size, precision and model; past torch's limit (8;
    here 1) torch would run it eager and the summary would still say compiled. A resident
    device serving many jobs gets there. The size past it runs eager under its own name.
    (Compiled here by dynamo alone, which keeps the count: inductor's code generation would
    only take time.)"""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", False)
    stage = DeviceStage(net, Placement("cpu", 2, False, ""), 0.5, Rules(0, 0.0, False))
    stage.compile = "compile"  # (on the CPU the job leaves it off: compile_plan)
    rng = np.random.default_rng(2)
    try:
        with torch.inference_mode():
            for side in (32, 48):
                images = torch.from_numpy(rng.random((2, 1, side, side), dtype=np.float32))
                stage.fast[(side, side)] = stage._build(images, (side, side))
    finally:
        torch._dynamo.reset()
    assert stage.fast[(32, 32)] is not None and stage.fast[(48, 48)] is None
    first, second = stage.summary()["compile_checks"]
    assert first["shape"] == "2×32×32" and first["kept"]
    assert second == {"shape": "2×48×48", "kept": False,
                      "error": "this process has compiled the net 1 times, torch's limit"}  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on a GPU node)")
def test_on_a_gpu_more_batches_than_its_pinned_slots_come_back_each_with_its_own_masks(
    net: UNet,
) -> None:
    """The main process may submit more batches than :data:`IN_FLIGHT` before it asks for
    any: each still comes back, in order, with the masks of its own images (not those of the
    batch that took its pinned buffers next): the masks of each batch submitted alone."""
    from pipelines.inference.device import IN_FLIGHT

    rng = np.random.default_rng(1)
    batches = [rng.random((n, 64, 64), dtype=np.float32) for n in (2, 4, 4, 3, 4, 4, 1)]
    assert len(batches) > IN_FLIGHT
    where = choose_device(1, {}, torch.cuda.device_count(),
                          {**PARAMS, "gpu_batch_size": 4, "mixed_precision": False})  # fmt: skip

    def through(stage: DeviceStage, wait_each: bool) -> list[tuple[int, np.ndarray]]:
        found = []
        for number, images in enumerate(batches):
            stage.submit(list(images), number)
            while wait_each and stage.busy:
                found += [(tag, masks.copy()) for tag, masks, _ in stage.done(wait=True)]
        while stage.busy:
            found += [(tag, masks.copy()) for tag, masks, _ in stage.done(wait=True)]
        return found

    alone = through(DeviceStage(net, where, 0.5, Rules(0, 0.0, False)), wait_each=True)
    together = through(DeviceStage(net, where, 0.5, Rules(0, 0.0, False)), wait_each=False)
    assert [tag for tag, _ in together] == list(range(len(batches)))
    for (_, masks), (_, expected) in zip(together, alone, strict=True):
        differ = np.count_nonzero(masks != expected)
        assert differ <= masks.size // 1000, f"{differ} of {masks.size} pixels differ"


def test_gpu_compile_is_used_on_a_gpu_ignored_on_the_cpu_and_a_bad_value_refused() -> None:
    """The manifest refuses a value it does not know; a spec written by hand with one fails
    the job with the values it could have had."""
    for mode in ("compile", "graphs"):
        on_gpu = choose_device(1, {}, 1, {**PARAMS, "gpu_compile": mode})
        used, said = compile_plan(on_gpu)
        assert (on_gpu.compile, used) == (mode, mode)
        assert f"gpu_compile {mode!r}: full batches of one size run" in said
        on_cpu = choose_device(0, {}, 1, {**PARAMS, "gpu_compile": mode})
        assert compile_plan(on_cpu) == (
            "off",
            f"gpu_compile {mode!r} ignored: the net runs on the CPU, eager",
        )
    assert compile_plan(choose_device(1, {}, 1, PARAMS)) == (
        "off",
        "gpu_compile: off, the net runs eager",
    )
    with pytest.raises(ValueError, match="gpu_compile 'fast': must be one of off, compile, graphs"):
        choose_device(1, {}, 1, {**PARAMS, "gpu_compile": "fast"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that CUDA must not show")
def test_on_the_cpu_a_job_with_gpu_compile_writes_the_masks_it_writes_without(
    tmp_path: Path, synth: ModuleType, job_spec: Callable[..., JobSpec],
    manifest_inputs: Callable[..., tuple], run: Callable[..., object],
) -> None:  # fmt: skip
    """Asked for a GPU it does not get, the job says the setting is ignored and runs eager."""
    torch.manual_seed(0)
    net = UNet(depth=2, width=4)
    registry.register(tmp_path / "registry", "tiny", net.state_dict(),
                      {"architecture": net.architecture()})  # fmt: skip
    masks = {}
    for mode in ("off", "graphs"):
        batch_dir = tmp_path / mode
        files = synth.make_batch(batch_dir, "inference", count=3, size=48, seed=5)
        spec = job_spec(batch_dir, Pipeline.INFER, manifest_inputs(batch_dir, files),
                        registry=tmp_path / "registry", model=ModelRef("tiny"),
                        params={**PARAMS, "gpu_compile": mode},
                        resources=Resources(cpus=1, gpus=1))  # fmt: skip
        job = run(spec)
        assert job.returncode == 0, job.log
        assert "inference on cpu" in job.log
        said = "gpu_compile 'graphs' ignored" if mode == "graphs" else "gpu_compile: off"
        assert said in job.log
        found = sorted(p for p in (batch_dir / "results").rglob("*.png") if "masks" in p.parts)
        assert len(found) == 3
        masks[mode] = [path.read_bytes() for path in found]
    assert masks["graphs"] == masks["off"]
