"""Where an inference job runs its net (pipelines/device.py): the rule, on this GPU-less machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.unet import UNet
from pipelines.device import choose_device
from pipelines.infer import ON_CPU, precision_check, predict

PARAMS = {"batch_size": 1, "threshold": 0.5, "min_object_area": 0}


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
    if where.cuda:
        assert (where.batch_size, where.mixed_precision) == (16, True)
    else:
        assert (where.batch_size, where.mixed_precision) == (1, False)


def test_the_gpu_batch_and_precision_follow_the_parameters() -> None:
    params = {**PARAMS, "batch_size": 4, "gpu_batch_size": 64, "mixed_precision": False}
    where = choose_device(1, {}, 1, params)
    assert (where.batch_size, where.mixed_precision) == (64, False)
    assert choose_device(0, {}, 1, params).batch_size == 4


def test_on_this_machine_the_net_stays_on_the_cpu_and_no_precision_check_runs() -> None:
    torch.manual_seed(0)
    net = UNet(depth=2, width=4).eval()
    images = np.random.default_rng(0).random((2, 32, 32), dtype=np.float32)
    where = choose_device(1, {}, torch.cuda.device_count(), PARAMS)
    assert where.device == "cpu"  # no CUDA here: the GPU path is reviewed, not run
    assert precision_check(net, images, where, PARAMS) is where
    assert np.array_equal(predict(net, images, where), predict(net, images, ON_CPU))
