"""The report as a person sees it: rendered by a real headless Chromium (Debian's package)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from browser import chromium, render
from PIL import Image

from daemon.contract.jobspec import Pipeline

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import InferredBatch, JobRun

needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="chromium is not installed (scripts/setup-env installs it as root)"
)


def _variety(png: bytes) -> tuple[int, float]:
    """(distinct colours, share of non-white pixels) of a screenshot."""
    with Image.open(io.BytesIO(png)) as image:
        pixels = np.asarray(image.convert("RGB"))
    colours = len(np.unique(pixels.reshape(-1, 3), axis=0))
    return colours, float((pixels.min(axis=2) < 245).mean())


@needs_chromium
def test_the_detector_sees_console_errors_and_network_requests(tmp_path: Path) -> None:
    """A page that logs an error and asks the network: both are caught (the check is real)."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!DOCTYPE html><title>bad</title><img src='http://127.0.0.1:9/x.png'>"
        "<script>console.error('boom')</script>"
    )
    rendered = render(page, full_height=False)
    assert "console: boom" in rendered.errors
    assert "http://127.0.0.1:9/x.png" in rendered.requests


@needs_chromium
def test_the_inference_report_renders_in_chromium_without_errors_or_network(
    inferred: InferredBatch, job_spec: Callable[..., Any], run: Callable[..., JobRun]
) -> None:
    source = inferred.shards[0].spec
    spec = job_spec(inferred.batch_dir, Pipeline.REPORT, inferred.inputs,
                    registry=Path(source.registry_dir), model=source.model,
                    params=source.params, job_name="report")  # fmt: skip
    job = run(spec)
    assert job.returncode == 0, job.log
    report = inferred.batch_dir / "results" / "report.html"
    rendered = render(report)
    (report.parent / "report-screenshot.png").write_bytes(rendered.screenshot)
    assert rendered.errors == []
    assert [url for url in rendered.requests if not url.startswith(("file:", "data:"))] == []
    assert rendered.title == "test batch — watchd report"
    colours, ink = _variety(rendered.screenshot)
    assert colours > 200 and ink > 0.02, (colours, ink)  # text, tables and pictures, not blank
