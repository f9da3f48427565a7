"""Assembly job: the label images of slides that several inference jobs segmented in regions.

``python -m pipelines.assemble JOB_DIR``, after a batch's inference jobs, before its report.
For each image its ``regional`` param lists (the daemon lists the images it split), it reads
the records the regions' jobs left in ``regions/<image>.zarr/`` of the run's work folder in the
spool (:mod:`pipelines.tiles`), joins the objects that cross region borders, writes the label
image ``masks/<image>.ome.zarr`` (only the stored chunks are read and written) and the object
table ``objects/<image>.csv`` into the owner's results folder, and the image's table row into
the work folder (``parts/table-regions.csv``), then removes the image's regions (and
``regions/`` once every image is assembled). All regions must have read
the same file (size and modification time); a checksum the manifest gives is verified here,
once, not by every region's job.

No model is loaded: the job is I/O and bookkeeping, on one CPU.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from daemon.contract.checksums import sha256_of_stream
from daemon.contract.heldfolder import HeldFolder
from daemon.contract.jobspec import InputFile, JobSpec, Pipeline, Problem
from daemon.contract.names import inference_params
from pipelines.bounds import where
from pipelines.images import checksum_problem, open_item, reading
from pipelines.job import InputError, log, main, run_folder, work_folder
from pipelines.layout import (
    MASKS_DIR,
    PARTS_DIR,
    REGIONS_DIR,
    REGIONS_TABLE,
    label_image_name,
    objects_csv,
    objects_table_name,
    table_csv,
    work_folder_name,
)
from pipelines.omezarr import work_array
from pipelines.tiles import RegionRecord, assemble, region_record_name, tiled_row


def assemble_job(spec: JobSpec, job_dir: Path, batch: HeldFolder) -> dict[str, Any]:
    """Assemble every image the ``regional`` param lists; the job's result."""
    wanted = list(spec.params.get("regional", ()))
    items = {item.path: item for item in spec.inputs}
    min_area = int(inference_params(spec.params)["min_object_area"])
    rows, problems = [], []
    with run_folder(spec, batch) as run, work_folder(spec) as work:
        for path in wanted:
            try:
                rows.append(_assembled(batch, run, work, items[path], min_area))
            except InputError as exc:
                problems += exc.problems
        if problems:
            raise InputError(f"{len(problems)} problem(s) assembling the regions", problems)
        work.remove_tree(REGIONS_DIR)  # every slide's regions are gone: the folders above
        table = PurePosixPath(PARTS_DIR, REGIONS_TABLE)
        work.write_text(table, table_csv(rows))
    return {"images": len(rows), "objects": sum(int(r["objects"]) for r in rows),
            "table": str(table)}  # fmt: skip


def _records(regions: HeldFolder, item: InputFile) -> list[RegionRecord]:
    """The regions' records, all of them, of one read of one file (or OME-Zarr store)."""
    first = RegionRecord.from_bytes(_read(regions, region_record_name(0)))
    records = [first] + [
        RegionRecord.from_bytes(_read(regions, region_record_name(i)))
        for i in range(1, first.count)
    ]
    seen = {(r.meta["size"], r.meta["mtime_ns"], r.meta.get("state")) for r in records}
    if len(seen) > 1:
        raise InputError("changed", [Problem(
            where(item), "changed while its regions were segmented (its size or modification "
            "time differs between the regions' jobs)",
            "leave the file as it is, then ask an operator to retry the batch",
        )])  # fmt: skip
    return records


def _read(work: HeldFolder, name: str) -> bytes:
    try:
        with work.open_read(name) as handle:
            return handle.read()
    except FileNotFoundError:
        raise RuntimeError(
            f"{work.path / name} is missing: its region's job left no record"
        ) from None


def _assembled(
    batch: HeldFolder, run: HeldFolder, work: HeldFolder, item: InputFile, min_area: int
) -> dict[str, Any]:
    if item.sha256:
        with open_item(batch, item) as handle, reading(item):
            problem = checksum_problem(item, sha256_of_stream(handle))
        if problem is not None:
            raise InputError("checksum", [problem])
    work_name = work_folder_name(item.path)
    *above, name = PurePosixPath(item.path).parts
    with work.folder(work_name) as regions:
        records = _records(regions, item)
        meta = records[0].meta
        store, ids = work_array(regions, meta["height"], meta["width"])
        try:
            with run.folder(PurePosixPath(MASKS_DIR, *above), create=True) as masks:
                result = assemble(records, ids, masks, label_image_name(name), min_area,
                                  meta["height"], meta["width"])  # fmt: skip
        finally:
            store.close()
    run.write_text(objects_table_name(item.path), objects_csv(result.table))
    work.remove_tree(work_name)
    log.info("%s: %d regions assembled, %d objects", item.path, len(records), result.objects)
    precision = "/".join(sorted({r.meta.get("precision", "fp32") for r in records}))
    return {"path": item.path, **tiled_row(result), "precision": precision, **meta["provenance"]}


if __name__ == "__main__":
    main(Pipeline.ASSEMBLE, assemble_job)
