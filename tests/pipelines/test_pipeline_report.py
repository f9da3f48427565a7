"""Real report jobs: merged table, summary.json and a self-contained report.html."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.etree import ElementTree

import numpy as np
import tifffile
from jobrun import work_dir_for
from labelimages import zarr_levels
from PIL import Image
from zarr.core.sync import cleanup_resources

from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import ErrorKind, InputFile, ModelRef, Pipeline
from pipelines.layout import TABLE_COLUMNS, label_image_name, table_csv
from pipelines.omezarr import LABEL_NAME, overview_step
from pipelines.page import render
from pipelines.report import inference_summary, precision_checks
from pipelines.tiles import TiledResult, segment_tiled, tiled_row

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import InferredBatch, JobRun, TrainedModel


def assert_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert "http" not in page and 'src="//' not in page
    assert "<script" not in page and "<link" not in page
    sources = re.findall(r'src="([^"]*)"', page)
    assert sources
    for src in sources:
        if src.startswith("data:image/svg+xml;base64,"):  # drawn by us: nothing it runs or loads
            svg = ElementTree.fromstring(base64.b64decode(src.split(",", 1)[1]))
            tags = {element.tag.rsplit("}", 1)[-1] for element in svg.iter()}
            assert tags <= {"svg", "rect", "line", "text"}, tags
            assert not any(key.endswith("href") for element in svg.iter() for key in element.attrib)
        else:
            assert src.startswith("data:image/png;base64,"), src[:40]


def report_spec(
    batch_dir: Path,
    kind: str,
    job: JobRun,
    job_spec: Callable[..., Any],
    inputs: tuple[InputFile, ...] | None = None,
) -> Any:
    """A report job for the batch ``job`` belongs to (``inputs``: all of the batch's)."""
    source = job.spec
    return job_spec(
        batch_dir,
        Pipeline.REPORT,
        inputs or source.inputs,
        registry=Path(source.registry_dir),
        model=source.model,
        params=source.params,
        job_name="report",
        batch_kind=kind,
    )


def test_inference_report_merges_tables_and_summarises(
    inferred: InferredBatch, job_spec: Callable[..., Any], run: Callable[..., JobRun]
) -> None:
    job = run(
        report_spec(inferred.batch_dir, "inference", inferred.shards[0], job_spec, inferred.inputs)
    )
    assert job.returncode == 0 and job.result is not None and job.result.ok, job.log
    run_dir = inferred.batch_dir / "results"
    with open(run_dir / "table.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    paths = [row["path"] for row in rows]
    assert paths == sorted(item.path for item in inferred.inputs)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["inference"]["images"] == len(inferred.inputs)
    assert summary["inference"]["objects"] == sum(int(row["objects"]) for row in rows)
    assert summary["inference"]["model"]["name"] == inferred.model.name
    assert summary["inference"]["model"]["version"] == 1
    assert summary["manifest_sha256"] == inferred.shards[0].spec.manifest_sha256
    assert sorted(j["job"] for j in summary["jobs"]) == ["infer-0000", "infer-0001"]
    assert summary["inference"]["precision"] == {"fp32": len(inferred.inputs)}
    assert [(c["job"], c["device"], c["precision"], c["checks"])
            for c in summary["inference"]["precision_checks"]] == [
        ("infer-0000", "cpu", "fp32", []), ("infer-0001", "cpu", "fp32", [])]  # fmt: skip
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert f"<th>net precision</th><td>fp32: {len(inferred.inputs)} image(s)</td>" in page
    assert_self_contained(page)
    assert page.count("data:image/png;base64,") >= 1  # the overlays
    assert page.count("data:image/svg+xml;base64,") == 1  # the histogram
    assert "it&#39;s a &#34;test&#34;.png" in page and "plate 2 ü" in page  # escaped by Jinja


def test_training_report_shows_curves_and_the_registered_model(
    trained: TrainedModel, job_spec: Callable[..., Any], run: Callable[..., JobRun]
) -> None:
    batch_dir = Path(trained.run.spec.batch_dir)
    job = run(report_spec(batch_dir, "training", trained.run, job_spec))
    assert job.returncode == 0, job.log
    summary = json.loads((batch_dir / "results" / "summary.json").read_text(encoding="utf-8"))
    assert summary["training"]["model"]["version"] == 1
    assert summary["training"]["epochs_run"] == 2
    assert "inference" not in summary
    page = (batch_dir / "results" / "report.html").read_text(encoding="utf-8")
    assert_self_contained(page)
    assert page.count("data:image/png;base64,") == 2 + 3  # two charts, best/worst/random previews
    assert "best: " in page and "worst: " in page and "(Dice " in page and "true)" in page
    assert "spheroids version 1" in page
    assert summary["training"]["validation"] == "training/validation.csv"
    copied = batch_dir / "results" / "training" / "validation.csv"  # for the owner
    assert copied.read_bytes() == (trained.run.work_dir / "training" / "validation.csv").read_bytes()
    metrics = summary["training"]["model"]["metrics"]
    assert f"<th>validation: F1 at IoU 0.5</th><td>{metrics['val_object_f1']:.4g}</td>" in page
    assert 'id="validation-objects"' in page and page.count("<td>images/img_") == 4


def with_masks_folder(inferred: InferredBatch, tmp_path: Path) -> Path:
    """A copy of the inferred batch (its work folder too), with an empty masks/ for truths."""
    batch_dir = tmp_path / "with truth"
    shutil.copytree(inferred.batch_dir, batch_dir)
    shutil.copytree(work_dir_for(inferred.batch_dir), work_dir_for(batch_dir))
    (batch_dir / "masks").mkdir()
    return batch_dir


def test_an_inference_batch_with_masks_beside_its_images_is_scored_against_them(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    manifest_inputs: Callable[..., Any],
) -> None:
    """Masks paired by file name: each image that has one is scored (quality.csv, the summary,
    the report's section); a mask of the wrong size and one whose stem two images share are
    notes, not failures. Scored against the very masks it wrote, a batch scores perfectly."""
    batch_dir = with_masks_folder(inferred, tmp_path)
    results = batch_dir / "results"
    for name in ('it\'s a "test".png', "img_0002.png"):  # their own masks, as truth
        shutil.copy(results / "masks" / "images" / name, batch_dir / "masks" / name)
    shutil.copy(results / "masks" / "images" / "img_0001.png", batch_dir / "masks")  # 2 images
    Image.new("L", (10, 10)).save(batch_dir / "masks" / "img_0000.png")  # the TIFF is 72²
    masks = manifest_inputs(batch_dir, sorted((batch_dir / "masks").iterdir()), checksums=True)
    job = run(report_spec(batch_dir, "inference", inferred.shards[0], job_spec,
                          (*inferred.inputs, *masks)))  # fmt: skip
    assert job.returncode == 0, job.log
    with open(results / "table.csv", newline="", encoding="utf-8") as handle:
        objects = {row["path"]: int(row["objects"]) for row in csv.DictReader(handle)}
    with open(results / "quality.csv", newline="", encoding="utf-8") as handle:
        scored = list(csv.DictReader(handle))
    assert [row["path"] for row in scored] == ["images/img_0002.png", 'images/it\'s a "test".png']
    for row in scored:
        assert int(row["objects_true"]) == int(row["objects_found"]) == objects[row["path"]]
        assert (row["f1_50"], row["count_error"], row["dice"]) == ("1.0", "0", "1.0")
    truth = json.loads((results / "summary.json").read_text())["inference"]["ground_truth"]
    assert (truth["images"], truth["f1_50"], truth["count_error"], truth["dice"]) == (2, 1, 0, 1)
    assert truth["not_scored"] == [
        "masks/img_0001.png: no image, or more than one, has its file name (stem)",
        "plate 2 ü/images/img_0000.tif: its mask 'masks/img_0000.png' is 10×10 pixels, the "
        "image 72×72",
    ]
    page = (results / "report.html").read_text(encoding="utf-8")
    assert 'id="ground-truth"' in page and "<th>F1 at IoU 0.5</th><td>1</td>" in page
    assert "<th>count error (Σ |found − true| ÷ true)</th><td>0.0 %</td>" in page


def test_a_written_mask_swapped_for_a_hard_link_is_not_scored_and_never_read(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    manifest_inputs: Callable[..., Any],
) -> None:
    """The masks an inference job wrote lie in the owner's run folder: one swapped for a hard
    link to a file the owner may not read (where the kernel lets them make one: an NFS server,
    fs.protected_hardlinks = 0) is neither scored against its truth nor drawn as an overlay.
    Its file is not read (its atime as it was); the score says why, naming no byte of it."""
    batch_dir = with_masks_folder(inferred, tmp_path)
    written = batch_dir / "results" / "masks" / "images" / "img_0002.png"
    shutil.copy(written, batch_dir / "masks")
    canary = f"CANARY-{os.urandom(8).hex()}"
    secret = tmp_path / "service-only" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(canary + "\n")
    secret.chmod(0o600)
    written.unlink()
    os.link(secret, written)
    os.utime(secret, ns=(946_684_800 * 10**9, secret.stat().st_mtime_ns))
    before = secret.stat().st_atime_ns
    masks = manifest_inputs(batch_dir, sorted((batch_dir / "masks").iterdir()), checksums=True)
    job = run(report_spec(batch_dir, "inference", inferred.shards[0], job_spec,
                          (*inferred.inputs, *masks)))  # fmt: skip
    assert job.returncode == 0, job.log
    assert secret.stat().st_atime_ns == before, "the secret was read"
    truth = json.loads((batch_dir / "results" / "summary.json").read_text())
    [why] = truth["inference"]["ground_truth"]["not_scored"]
    assert why.startswith("images/img_0002.png: masks/images/img_0002.png cannot be read")
    assert "has other hard links" in why
    for path in [p for p in batch_dir.rglob("*") if p.is_file() and p != written]:
        assert canary[:8].encode() not in path.read_bytes(), path


def test_a_missing_shard_table_fails_the_report_as_internal(
    inferred: InferredBatch,
    tmp_path: Path,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
) -> None:
    batch_dir = tmp_path / "batch"
    shutil.copytree(inferred.batch_dir, batch_dir)
    shutil.copytree(work_dir_for(inferred.batch_dir), work_dir_for(batch_dir))
    (work_dir_for(batch_dir) / "parts" / "table-0001.csv").unlink()
    for name in ("report.html", "summary.json", "table.csv"):
        (batch_dir / "results" / name).unlink(missing_ok=True)
    job = run(report_spec(batch_dir, "inference", inferred.shards[0], job_spec, inferred.inputs))
    assert job.returncode == 1, job.log
    error = job.result.error  # type: ignore[union-attr]
    assert error is not None and error.kind is ErrorKind.INTERNAL
    assert "no table row for 2 of 5 images" in error.message and error.traceback
    assert not (batch_dir / "results" / "report.html").exists()


def test_the_report_clears_away_what_killed_writes_left_and_nothing_else(
    inferred: InferredBatch,
    job_spec: Callable[..., Any],
    run: Callable[..., JobRun],
    tmp_path: Path,
) -> None:
    """A shard killed while writing a mask leaves a temporary (``.tmp-watchd-<16 hex>``); its
    retry writes the mask anew. The report, run once every shard has ended, removes the stray; a link of that name
    is neither followed nor removed, and the masks stay."""
    masks = inferred.batch_dir / "results" / "masks"
    stray = next(masks.rglob("*.png")).parent / ".tmp-watchd-0123456789abcdef"
    stray.write_bytes(b"half a mask")
    outside = tmp_path / "keep.png"
    outside.write_bytes(b"not the job's")
    link = masks / ".tmp-watchd-fedcba9876543210"
    link.symlink_to(outside)
    lookalike = masks / ".tmp-img.png.k1ll3d"  # an input's mask could be named so
    lookalike.write_bytes(b"a mask")
    before = sorted(masks.rglob("*.png"))
    try:
        job = run(
            report_spec(
                inferred.batch_dir, "inference", inferred.shards[0], job_spec, inferred.inputs
            )
        )
        assert job.returncode == 0, job.log
        assert not stray.exists()
        assert "removed 1 temporary file(s) left by interrupted writes" in job.log
        assert link.is_symlink() and outside.read_bytes() == b"not the job's"
        assert sorted(masks.rglob("*.png")) == before
        assert lookalike.read_bytes() == b"a mask"
    finally:
        link.unlink()
        lookalike.unlink()


HOSTILE = '<img src=x onerror="alert(1)">&'


def test_every_value_from_the_batch_is_escaped_by_the_template() -> None:
    """Title, folder, parameters, file names and captions come from the batch's owner: the
    template escapes each (autoescaping), so none becomes markup."""
    summary = {
        "batch": {"id": 1, "revision": 1, "kind": "inference", "title": HOSTILE, "dir": HOSTILE},
        "manifest_sha256": "0" * 64,
        "params": {HOSTILE: HOSTILE},
        "generated_at": "now",
        "code_version": "test",
        "jobs": [{"job": HOSTILE, "pipeline": "infer", "ok": True, "elapsed_s": 1.5}],
    }
    row = {column: "1" for column in TABLE_COLUMNS} | {"path": f"{HOSTILE}.png", "tiled": "0"}
    model = {"name": HOSTILE, "version": 1, "sha256": "0" * 64}
    inference = {
        "summary": {
            "images": 1, "images_with_objects": 1, "objects": 1, "model": model,
            "area_px_of_images_with_objects": {"mean": 1.0, "median": 1.0},
        },
        "rows": [row, row | {"tiled": "1"}],
        "overlays": [(HOSTILE, "data:image/png;base64,AAAA")],
        "slides": [(HOSTILE, "data:image/png;base64,AAAA")],
        "histogram": "data:image/png;base64,AAAA",
    }  # fmt: skip
    page = render(summary, {"inference": inference})
    assert "<img src=x" not in page and 'onerror="' not in page
    escaped = "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;&amp;"
    assert (
        page.count(escaped) >= 9
    )  # title ×2, folder, parameter, paths ×2, captions ×2, job, model
    assert '<td class="num">1</td>' in page and "<td>–</td>" in page  # a job's missing host


SLIDE_SHAPE = (2600, 2200)  # over 2048 rows: an overview of every 2nd pixel, 1300 × 1100


def _slide_pixels() -> np.ndarray:
    """Bright discs on a dark slide, some touching, some on window borders."""
    rng = np.random.default_rng(11)
    pixels = np.full(SLIDE_SHAPE, 30, dtype=np.uint8)
    rows, cols = np.ogrid[: SLIDE_SHAPE[0], : SLIDE_SHAPE[1]]
    for _ in range(60):
        y, x, r = (
            rng.integers(0, SLIDE_SHAPE[0]),
            rng.integers(0, SLIDE_SHAPE[1]),
            rng.integers(8, 60),
        )
        pixels[(rows - y) ** 2 + (cols - x) ** 2 < r * r] = rng.integers(140, 255)
    return pixels


def _segmented(masks: HeldFolder, image: Path, relative: str) -> TiledResult:
    """``image`` segmented window by window into its label image under ``masks`` by a net that
    thresholds each pixel (as a job does; zarr's threads are stopped after)."""

    def net(tiles: np.ndarray) -> np.ndarray:
        return np.where(tiles > 0.5, 0.95, 0.05).astype(np.float32)

    *folders, name = label_image_name(relative).split("/")
    try:
        with masks.folder("/".join(folders), create=True) as held:
            return segment_tiled(image, held, name, net, 0.5, 30, window=300, overlap=40, batch=4)
    finally:
        cleanup_resources()


def _table_row(relative: str, result: TiledResult) -> dict[str, Any]:
    row = {column: "" for column in TABLE_COLUMNS} | tiled_row(result)
    row |= {"path": relative, "model_name": "spheroids", "model_version": 1}
    return {column: row[column] for column in TABLE_COLUMNS}


def _pictures(page: str) -> dict[str, Image.Image]:
    """The page's pictures by their alt text."""
    found = {}
    for uri, alt in re.findall(r'<img src="data:image/png;base64,([^"]*)" alt="([^"]*)">', page):
        found[html.unescape(alt)] = Image.open(io.BytesIO(base64.b64decode(uri))).convert("RGB")
    return found


def test_a_slide_is_shown_as_its_overview_with_its_objects_a_planted_link_is_not_followed(
    tmp_path: Path, job_spec: Callable[..., Any], run: Callable[..., JobRun]
) -> None:
    """An image segmented window by window is drawn from its label image: the overview at
    most 1024 pixels across (here 1300 × 1100 reduced), every object pixel tinted orange and
    every other pixel grey. A second slide whose label image the owner replaced by a link to
    the first's gets a warning and no picture; the report succeeds."""
    batch_dir = tmp_path / "drop folder"
    (batch_dir / "slides ü").mkdir(parents=True)
    pixels = _slide_pixels()
    names = ["slides ü/slide 'one'.tif", "slides ü/slide two.tif"]
    for name in names:
        tifffile.imwrite(batch_dir / name, pixels, tile=(256, 256), compression="zlib")
    masks = batch_dir / "results" / "masks"
    masks.mkdir(parents=True)
    with HeldFolder.open(masks) as held:
        result = _segmented(held, batch_dir / names[0], names[0])
    first = masks / label_image_name(names[0])
    (masks / label_image_name(names[1])).symlink_to(first.name)
    rows = [_table_row(name, result) for name in names]
    parts = work_dir_for(batch_dir) / "parts"
    parts.mkdir(parents=True)
    (parts / "table-0000.csv").write_text(table_csv(rows), "utf-8")
    inputs = tuple(InputFile(name, (batch_dir / name).stat().st_size) for name in names)
    spec = job_spec(batch_dir, Pipeline.REPORT, inputs, registry=tmp_path / "registry",
                    model=ModelRef("spheroids"), params={}, job_name="report")  # fmt: skip
    job = run(spec)
    assert job.returncode == 0, job.log
    assert f"no slide overview for {names[1]}" in job.log and "symbolic link" in job.log
    page = (batch_dir / "results" / "report.html").read_text(encoding="utf-8")
    assert_self_contained(page)
    assert "Slide overview</h3>" in page and "(1 shown of 2)" in page
    objects = f"{result.objects} object(s), 2,200 × 2,600 px"
    slides = {alt: image for alt, image in _pictures(page).items() if objects in alt}
    assert list(slides) == [f"{names[0]}: {objects}" + (
        f", {result.windows_run} windows run, 0 skipped as glass"
        if "windows_run" in TABLE_COLUMNS else "")]  # fmt: skip
    picture = np.asarray(next(iter(slides.values())), dtype=np.int16)
    step = overview_step(*SLIDE_SHAPE)
    assert step == 2 and picture.shape == (1024, 866, 3)  # the 1300 × 1100 overview, reduced
    level = zarr_levels(first, f"labels/{LABEL_NAME}")[1]  # every 2nd pixel, as the overview
    centres = [(2 * np.arange(shown) + 1) * side // (2 * shown)  # the pixel under each centre
               for side, shown in zip(level.shape, (1024, 866), strict=True)]  # fmt: skip
    objects_shown = level[np.ix_(*centres)] > 0
    red, green, blue = picture[..., 0], picture[..., 1], picture[..., 2]
    assert objects_shown.sum() > 1000 and result.objects > 10
    assert (red > blue)[objects_shown].all()  # objects: orange over grey
    assert ((red == green) & (green == blue))[~objects_shown].all()  # the rest: grey
    assert len(np.unique(red[~objects_shown])) > 1  # ... and not blank: the overview itself


def test_windows_run_and_skipped_as_glass_are_summed_and_shown_where_the_table_has_them() -> None:
    """Rows of slides carry the windows the net ran on and those skipped as glass: the summary
    sums them and the page says so; a table from before they were counted has neither."""
    base = {column: "1" for column in TABLE_COLUMNS} | {"model_version": "1"}
    rows = [
        base | {"path": "a.tif", "tiled": "1", "windows_run": "1000", "windows_glass": "5000"},
        base | {"path": "b.tif", "tiled": "1", "windows_run": "234", "windows_glass": "678"},
        base | {"path": "c.png", "tiled": "0", "windows_run": "", "windows_glass": ""},
    ]
    summary = inference_summary(rows)
    assert summary["windows"] == {"run": 1234, "glass": 5678}
    meta = {"batch": {"id": 1, "revision": 1, "kind": "inference", "title": "t", "dir": "d"},
            "manifest_sha256": "0", "generated_at": "now", "code_version": "test"}  # fmt: skip
    part = {"summary": summary, "rows": rows, "overlays": [], "slides": [],
            "histogram": "data:image/png;base64,AAAA"}  # fmt: skip
    page = render(meta, {"inference": part})
    assert (
        "<th>window by window</th><td>1,234 windows run, 5,678 skipped as glass (no tissue)</td>"
        in page
    )
    older = [{k: v for k, v in row.items() if not k.startswith("windows_")} for row in rows]
    assert "windows" not in inference_summary(older)
    page = render(meta, {"inference": part | {"summary": inference_summary(older)}})
    assert "<th>window by window</th>" not in page and "Slide overview</h3>" in page


def test_the_precision_each_image_was_made_in_and_the_checks_that_decided_it_are_shown() -> None:
    """A GPU job kept fp16 after its first batch agreed with fp32 well enough; the summary
    counts the images per precision and the page says which checks were tried and how they
    agreed, and, for a job with gpu_compile, how each size's compiled batch did."""
    base = {column: "1" for column in TABLE_COLUMNS} | {"model_version": "1", "tiled": "0"}
    rows = [
        base | {"path": f"{i}.png", "precision": p} for i, p in enumerate(["fp16"] * 2 + ["fp32"])
    ]
    summary = inference_summary(rows)
    assert summary["precision"] == {"fp16": 2, "fp32": 1}
    checks = [{"precision": "fp16", "agreement": 0.99987, "counts_equal": True, "images": 128,
               "kept": True}]  # fmt: skip
    compiled = {"compile": "graphs", "compile_checks": [
        {"shape": "128×256×256", "seconds": 0.4, "agreement": 0.99995, "counts_equal": True,
         "kept": True},
        {"shape": "8×1024×1024", "kept": False, "error": "capture refused"}]}  # fmt: skip
    specked = [{"precision": "fp16", "agreement": 0.99999, "counts_equal": False,
                "counted_alike": 127, "images": 128, "kept": True}]  # fmt: skip
    jobs = [{"job": "infer-0000", "inference": {"device": "cuda:0", "precision": "fp16",
                                                "checks": specked}},
            {"job": "infer-0001", "inference": {"device": "cuda:0", "precision": "fp16",
                                                "checks": checks} | compiled},
            {"job": "infer-0002", "inference": {"device": "cuda:0", "precision": "fp16",
                                                "checks": specked, "resident": {
                                                    "pid": 7, "decided_by": "infer-0000"}}},
            {"job": "infer-0003", "inference": {"device": "cuda:0", "precision": "fp32",
                                                "checks": checks, "resident": {
                                                    "ended_during_the_job": True}}},
            {"job": "report"}]  # fmt: skip
    summary["precision_checks"] = precision_checks(jobs)
    meta = {"batch": {"id": 1, "revision": 1, "kind": "inference", "title": "t", "dir": "d"},
            "manifest_sha256": "0", "generated_at": "now", "code_version": "test"}  # fmt: skip
    part = {"summary": summary, "rows": rows, "overlays": [], "slides": [],
            "histogram": "data:image/png;base64,AAAA"}  # fmt: skip
    page = render(meta, {"inference": part})
    assert "<th>net precision</th><td>fp16: 2 image(s), fp32: 1 image(s)</td>" in page
    assert (
        "<th>precision checks (first batch against fp32)</th><td>infer-0000 on cuda:0: fp16 "
        "0.99999 of pixels, same object counts in 127 of 128 images (kept) → fp16; "
        "infer-0001 on cuda:0: fp16 "
        "0.99987 of pixels, same object counts (kept) → fp16; gpu_compile graphs: "
        "128×256×256 0.99995 (compiled), 8×1024×1024 failed (eager); "
        "infer-0002 on cuda:0: fp16 0.99999 of pixels, same object counts in 127 of 128 images "
        "(kept) → fp16 (as infer-0000 decided on the resident device); "
        "infer-0003 on cuda:0: fp16 0.99987 of pixels, same object counts (kept) → fp32 (its "
        "resident device ended during the job: the rest on its own net)</td>"
    ) in page


def test_the_reports_histogram_is_an_svg_drawn_to_its_counts() -> None:
    """The object-size histogram is SVG text (no rendering on the report's path): one bar per
    bin, left to right, each as tall as its count against the highest, all as wide; the title
    and the axis label escaped; no values give empty axes."""
    from pipelines import figures

    values = np.random.default_rng(2).normal(100.0, 20.0, 500)
    counts, _ = np.histogram(values, bins=20)
    svg = ElementTree.fromstring(figures.histogram("size <µm²>", values, "area & more"))
    bars = [e for e in svg.iter() if e.tag.endswith("rect") and e.get("fill") == "#1f77b4"]
    assert len(bars) == 20
    xs = [float(bar.get("x", "")) for bar in bars]
    assert xs == sorted(xs)
    widths = {round(float(bar.get("width", "")), 1) for bar in bars}
    assert len(widths) == 1
    heights = np.array([float(bar.get("height", "")) for bar in bars])
    assert np.allclose(heights / heights.max(), counts / counts.max(), atol=0.01)
    texts = [e.text for e in svg.iter() if e.tag.endswith("text")]
    assert "size <µm²>" in texts and "area & more" in texts and "images" in texts
    empty = ElementTree.fromstring(figures.histogram("none", [], "area"))
    assert not [e for e in empty.iter() if e.tag.endswith("rect") and e.get("fill") == "#1f77b4"]
    assert figures.svg_uri(b"<svg/>") == "data:image/svg+xml;base64,PHN2Zy8+"
