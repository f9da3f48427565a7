"""Hostile batch folders, as a data owner who means harm (or is only careless) would make them:
links (out of the folder, to the model registry, to a canary file only the service may read,
dangling, looping) and FIFOs anywhere, including pre-planted under ``results/`` at the names
the daemon will use; long and odd names; deep and wide trees; huge, deeply nested and
``**``-heavy manifests; and, while the batch runs (scripts/intruder.py does it, as the expert):
inputs or outputs swapped for links and FIFOs, links, FIFOs and forged files put under every
name in the run folder that a job or the report reads (or read before issue 25), races on the
jobs' files in the spool, and forged leases.

A folder is described by a frozen ``Hostile`` (what hypothesis draws and prints when it finds a
violation), and made on disk by ``build``. The fuzz test and scripts/fuzz_campaign.py share both.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import os
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
from hypothesis import strategies as st
from PIL import Image

MODEL = "spheroid-unet"
SWEPT = "fuzz-swept"  # what a sweep batch registers: the registry's MODEL stays as it was
MANIFEST = "manifest.toml"
STATUS = "watchd-status.txt"
# What a planted entry is: a link to a file or folder of the sentinel tree (outside the drop
# root), to the registry or a model's weights in it, a dangling or self-looping link, a FIFO.
KINDS = ("file-out", "dir-out", "registry", "weights", "dangling", "loop", "fifo")
# ... or, for the canary: a link to it, a hard link to it (the kernel refuses an expert one, a
# file not theirs: fs.protected_hardlinks), a file whose content names it where a job would
# read a path (scripts/intruder.py's forged files, which name the trap folder for a folder).
CANARY_KINDS = ("canary", "canary-hard", "forged")
RACE_KINDS = ("forged", "forged", "fifo", "canary", "file-out")
# Every name under a run folder that a job or the report reads, or read before the jobs' files
# moved into the spool (issue 25); {job}: each job's name, {image}: an input's mask.
RUN_NAMES = (
    "masks", "masks/{image}", "objects", "table.csv", "summary.json", "report.html",
    "training", "training/model.json", "training/metrics.csv", "training/previews",
    "training/previews/index.json", "training/previews/img.png", "training/wandb",
    "sweep", "sweep/trials.csv", "sweep/sweep.json",
    "trials", "trials/{job}", "trials/{job}/candidate.json", "trials/{job}/candidate.pt",
    "trials/{job}/metrics.csv",
    "parts", "parts/table-0000.csv", "parts/table-9999.csv", "parts/table-regions.csv",
    "ledger", "ledger/shard-0000.jsonl", "regions",
    "jobs", "jobs/{job}", "jobs/{job}/spec.json", "jobs/{job}/result.json",
    "jobs/{job}/progress.json", "jobs/{job}/log.txt", "jobs/{job}/launch.json", "jobs/slurm",
    "logs", "logs/{job}.log",
)  # fmt: skip
# What the races swap: the job's files and a sweep trial's candidate, at their old names.
RACE_NAMES = tuple(n for n in RUN_NAMES if n.startswith(("jobs/{job}/", "trials/{job}/")))
# The jobs of a batch (b<id>-<job>), by kind: one inference shard and the report; a sweep's
# two trials, the sweep job and the report.
JOBS = {"inference": ("infer-0000", "report"),
        "sweep": ("trial-0000", "trial-0001", "sweep", "report")}  # fmt: skip
# What the races attack in the spool (the expert must be refused): a job's files, a trial's
# candidate, the drop root's lease.
SPOOL_TARGETS = ("spec.json", "launch.json", "log.txt", "result.json", "progress.json",
                 "candidate.json", "candidate.pt", "lease")  # fmt: skip
# Forged leases (scripts/intruder.py::lease_bytes): none is a lease a daemon may honour.
LEASE_KINDS = (
    "future", "string", "nan", "infinity", "negative-pid", "bool-pid", "stale",
    "huge-pid-here", "other-root", "list", "empty-object", "not-json", "huge", "nested",
    "folder", "link", "fifo",
)  # fmt: skip
LEASE_PLACES = ("drop", "spool")  # the drop root's old lease name, the root's lease in the spool
# Where under a run folder something is planted: the run folder itself, its jobs/, a job's
# folder, a job's log, and the folders the inference job writes into.
LEVELS = ("run", "jobs", "job", "log", "masks", "ledger", "parts")
MANIFESTS = ("good", "globstar", "huge", "nested", "link", "fifo")
SWAPS = ("image-link", "image-fifo", "log-link", "log-fifo", "masks-link")
ODD = [
    "plain", "with space", "quote ' and \" both", "cr\rin it", "new\nline", "ümlaut ß",
    unicodedata.normalize("NFD", "café NFD"), "漢字", "-dash", "a;b&c|d",
]  # fmt: skip
SCREEN = ["[/]", "[bold]markup", "\x1b[31mred\x1b[0m", "\x1b]0;title\x07"]  # for the terminal
# What a name that a batch can run with has none of (the manifest's schema refuses them in an
# owner and a title: daemon/core/manifest_schema.py's PlainLine): the families of issue 25 draw
# such names, so that most batches run jobs.
HIDDEN = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")
RUNNABLE = [n for n in ODD if n.isprintable()]


@dataclass(frozen=True)
class Plant:
    """Something odd at ``path`` (relative to the batch folder, or a LEVEL under results)."""

    path: str
    kind: str
    listed: bool = False  # named as an input in the manifest


@dataclass(frozen=True)
class Swap:
    """Replace something with a link or FIFO ``after`` seconds into the run."""

    after: float
    what: str


@dataclass(frozen=True)
class Inside:
    """``kind`` put at ``name`` (one of RUN_NAMES) in each run folder, ``at`` seconds after the
    run folder appeared; put there again every few tenths of a second if ``again`` (a race
    with the jobs)."""

    name: str
    kind: str
    at: float = 0.0
    again: bool = False


@dataclass(frozen=True)
class Lease:
    """A lease forged ``after`` seconds into the run: ``kind`` (LEASE_KINDS) at ``where``
    (LEASE_PLACES)."""

    after: float
    kind: str
    where: str


@dataclass(frozen=True)
class Hostile:
    name: str
    owner: str
    title: str
    images: tuple[str, ...]
    plants: tuple[Plant, ...] = ()
    results: tuple[Plant, ...] = ()  # at the run's predicted names (Plant.path is a LEVEL)
    manifest: str = "good"
    depth: int = 0  # folders nested under deep/, an image at the bottom
    width: int = 0  # empty files in wide/
    swaps: tuple[Swap, ...] = ()
    inside: tuple[Inside, ...] = ()  # put in the run folder once it is there
    races: tuple[str, ...] = ()  # SPOOL_TARGETS the expert tries to swap in the spool
    leases: tuple[Lease, ...] = ()
    kind: str = "inference"  # or "sweep": two tiny trials, whose candidates are raced


def to_json(case: tuple[Hostile, ...]) -> list[dict[str, Any]]:
    return [asdict(h) for h in case]


def from_json(data: list[dict[str, Any]]) -> tuple[Hostile, ...]:
    """The case :func:`to_json` wrote (lists back to tuples, nested records to dataclasses)."""
    nested = {"plants": Plant, "results": Plant, "swaps": Swap, "inside": Inside, "leases": Lease}
    return tuple(
        Hostile(**{
            key: tuple(nested[key](**v) for v in value) if key in nested
            else tuple(value) if isinstance(value, list) else value
            for key, value in item.items()
        })
        for item in data
    )  # fmt: skip


@dataclass(frozen=True)
class Scale:
    """How big the draws get: small for CI, larger for the campaign."""

    folders: int = 2
    images: int = 3
    plants: int = 4
    depth: int = 12
    width: int = 200
    huge_bytes: int = 2 << 20
    nesting: int = 5000
    inside: int = 8  # things put in a run folder


@dataclass(frozen=True)
class Outside:
    """What links point at: the sentinel tree beside the drop root, the registry, the canary (a
    file only the service may read) and the trap (a folder forged specs send the jobs to)."""

    sentinel: Path
    registry: Path
    canary: Path
    trap: Path

    def target(self, kind: str, link: Path) -> Path:
        if kind.startswith("canary"):
            return self.canary
        if kind == "file-out":
            return self.sentinel / "secret.png"
        if kind == "dir-out":
            return self.sentinel / "notes"
        if kind == "registry":
            return self.registry
        if kind == "weights":
            return next(iter(sorted(self.registry.rglob("weights.pt"))), self.registry)
        if kind == "dangling":
            return self.sentinel / "nothing here"
        return link  # "loop": a link to itself


# -- strategies ------------------------------------------------------------------------------------


def fits(name: str, limit: int = 255) -> bool:
    return name not in ("", ".", "..") and "/" not in name and len(os.fsencode(name)) <= limit


def names(suffix: str = "", limit: int = 255, odd: list[str] = ODD) -> st.SearchStrategy[str]:
    """A file or folder name: odd (quotes, CR, LF, NFD, ...), random, or long (to 255 bytes);
    without control or formatting characters where none of ``odd`` has one."""
    room = limit - len(suffix)
    hidden = () if any(not n.isprintable() for n in odd) else HIDDEN
    random = st.text(
        st.characters(codec="utf-8", exclude_characters="/\0", exclude_categories=hidden),
        min_size=1, max_size=30,
    )  # fmt: skip
    long = st.integers(min_value=room - 60, max_value=room).map(lambda n: "L" * n)
    return (
        st.one_of(st.sampled_from(odd), random, long)
        .map(lambda n: n + suffix)
        .filter(lambda n: fits(n) and not n.startswith("."))
    )


def plants(
    under_results: bool, odd: list[str], kinds: tuple[str, ...] = KINDS, listed: float = 0.5
) -> st.SearchStrategy[Plant]:
    """A plant; named as an input (which refuses the batch) with probability ``listed``."""
    where = st.lists(names(".png", 120, odd), min_size=1, max_size=3).map("/".join)
    if under_results:
        where = where.map(lambda p: f"results/{p}")
    elif "canary" in kinds:  # the status file the daemon writes, named every way too
        where = st.one_of(where, st.just(STATUS))
    named = (
        st.booleans()
        if listed == 1 / 2
        else st.integers(1, round(1 / listed)).map(lambda n: n == 1)
    )
    return st.builds(Plant, where, st.sampled_from(kinds), named)


# What an ``inside`` family puts in the run folder: at which names, of which kinds.
INSIDE = {
    "names": (RUN_NAMES, KINDS),
    "canary": (RUN_NAMES, CANARY_KINDS),
    "races": (RACE_NAMES, RACE_KINDS),
}


def hostile(
    scale: Scale, *, results: bool, manifests: tuple[str, ...] = ("good",), screen: bool = False,
    inside: str = "", canary: bool = False, races: bool = False, leases: bool = False,
    runnable: bool = False,
) -> st.SearchStrategy[Hostile]:  # fmt: skip
    """One hostile folder; ``results``: also plant links and FIFOs under results/ (at the run's
    predicted names and at random ones) and swap outputs while the batch runs; ``screen``:
    names, owner and title may carry terminal escapes and rich markup; ``inside``: put things
    in the run folder once it is there (a key of INSIDE); ``canary``: inputs may be links to
    the canary; ``races``: race the jobs' files in the spool, and sometimes make the folder a
    sweep (its trials' candidates raced too); ``leases``: forge leases; ``runnable``: names,
    owner and title without control or formatting characters (most batches run jobs)."""
    odd = RUNNABLE if runnable else ODD + SCREEN if screen else ODD
    level_plants = st.builds(Plant, st.sampled_from(LEVELS), st.sampled_from(KINDS))
    swaps = SWAPS if results else SWAPS[:2]
    kinds = (*KINDS, "canary") if canary else KINDS
    listed = 1 / 8 if runnable else 1 / 2
    return st.builds(
        Hostile,
        name=names(limit=200, odd=odd),
        owner=st.sampled_from(odd),
        title=st.sampled_from(odd),
        images=st.lists(names(".png", odd=odd), min_size=1, max_size=scale.images, unique=True).map(
            lambda found: tuple(f"images/{n}" for n in found)
        ),
        plants=st.lists(
            st.one_of(plants(False, odd, kinds, listed), plants(True, odd, kinds, listed))
            if results or canary
            else plants(False, odd, listed=listed),
            max_size=scale.plants,
        ).map(tuple),
        results=st.lists(level_plants, min_size=1, max_size=3).map(tuple)
        if results
        else st.just(()),
        manifest=st.sampled_from(manifests),
        depth=st.integers(0, scale.depth),
        width=st.integers(0, scale.width),
        swaps=st.lists(
            st.builds(Swap, st.floats(0.5, 8.0), st.sampled_from(swaps)), max_size=2
        ).map(tuple),
        inside=_inside(scale, inside),
        races=_races() if races else st.just(()),
        leases=_leases() if leases else st.just(()),
        kind=st.sampled_from(("inference", "inference", "sweep"))
        if races
        else st.just("inference"),
    )


def _races() -> st.SearchStrategy[tuple[str, ...]]:
    return st.lists(st.sampled_from(SPOOL_TARGETS), min_size=1, unique=True).map(tuple)


def _leases() -> st.SearchStrategy[tuple[Lease, ...]]:
    one = st.builds(Lease, st.floats(0.2, 6.0), st.sampled_from(LEASE_KINDS),
                    st.sampled_from(LEASE_PLACES))  # fmt: skip
    return st.lists(one, min_size=1, max_size=4).map(tuple)


def _inside(scale: Scale, family: str) -> st.SearchStrategy[tuple[Inside, ...]]:
    if not family:
        return st.just(())
    where, kinds = INSIDE[family]
    again = st.just(True) if family == "races" else st.booleans()
    one = st.builds(Inside, st.sampled_from(where), st.sampled_from(kinds), st.floats(0.0, 4.0),
                    again)  # fmt: skip
    return st.lists(one, min_size=1, max_size=scale.inside).map(tuple)


def scenarios(scale: Scale, **options: object) -> st.SearchStrategy[tuple[Hostile, ...]]:
    """A few hostile folders dropped at once (distinct names)."""
    one = hostile(scale, **options)  # type: ignore[arg-type]
    return st.lists(one, min_size=1, max_size=scale.folders, unique_by=_nfc_name).map(tuple)


def _nfc_name(case: Hostile) -> str:
    return unicodedata.normalize("NFC", case.name)


# -- on disk ---------------------------------------------------------------------------------------


def png(seed: int = 0, size: int = 32, levels: int = 255) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, levels, (size, size), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels * (255 // (levels - 1)) if levels < 255 else pixels).save(out, "PNG")
    return out.getvalue()


MASK = png(1, levels=2)  # a sweep's masks: 0 and 255
SWEEP_IMAGES = 6
# A sweep of two tiny trials (a second or two of training each), registered under SWEPT.
SWEEP: dict[str, object] = {
    "model": {"name": SWEPT},
    "params": {"epochs": 1, "batch_size": 4, "depth": 2, "width": 4, "learning_rate": 0.01},
    "sweep": {"method": "grid", "metric": "val_dice", "space": {"width": [4, 8]}},
}


def build(
    root: Path, case: Hostile, outside: Outside, scale: Scale, *, stamps: list[str], batches: int
) -> Path:
    """Make the folder under ``root``, manifest last; plant under results/ at the names a run
    started at any of ``stamps`` by a batch numbered up to ``batches`` would use."""
    folder = root / case.name
    folder.mkdir()
    image = png()
    for relative in sweep_images(case) or case.images:
        write(folder / relative, image)
    for relative in sweep_masks(case):
        write(folder / relative, MASK)
    deep = folder.joinpath("deep", *["d"] * case.depth)
    write(deep / "bottom.png", image)
    for i in range(case.width):
        write(folder / "wide" / f"f{i:05d}.png", b"")
    for plant in case.plants:
        place(folder, plant.path.split("/"), plant.kind, outside)
    data = manifest(case, image, scale)
    for stamp in stamps:
        run = f"results/{stamp}-{hashlib.sha256(data).hexdigest()[:8]}"
        for plant in case.results:
            for path in level_paths(run, plant.path, batches):
                place(folder, path.split("/"), plant.kind, outside)
    put_manifest(folder, case.manifest, data, outside)
    return folder


def run_stamps(start: float, seconds: int) -> list[str]:
    """The run-folder stamps of the seconds from ``start`` on, as daemon/loop/intake.py names run
    folders today (UTC second, then the manifest's sha256 prefix)."""
    moments = (dt.datetime.fromtimestamp(start + s, dt.UTC) for s in range(-1, seconds))
    return sorted({m.strftime("%Y%m%dT%H%M%SZ") for m in moments})


def level_paths(run: str, level: str, batches: int) -> Iterator[str]:
    """The paths of a LEVEL in a run, for every job the first ``batches`` batches would have
    (named as daemon/core/jobplan.py names them: one inference shard and the report each)."""
    if level == "run":
        yield run
    elif level in ("masks", "ledger", "parts", "jobs"):
        yield f"{run}/{level}"
    else:
        for batch in range(1, batches + 1):
            for job in (f"b{batch:06d}-infer-0000", f"b{batch:06d}-report"):
                yield f"{run}/jobs/{job}" + ("/log.txt" if level == "log" else "")


def place(folder: Path, parts: list[str], kind: str, outside: Outside) -> None:
    """Plant ``kind`` at folder/parts unless something is there or on the way is not a real
    folder (never through a link of our own: that would write outside)."""
    here = folder
    for part in parts[:-1]:
        here = here / part
        if os.path.lexists(here) and (here.is_symlink() or not here.is_dir()):
            return
        here.mkdir(exist_ok=True)
    path = here / parts[-1]
    if not os.path.lexists(path):
        make_odd(path, kind, outside)


def make_odd(path: Path, kind: str, outside: Outside, target: Path | None = None) -> None:
    """A FIFO, a hard link to the canary, or a link of ``kind`` (``target``: the path it stands
    for, if not itself)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "canary-hard":
        os.link(outside.canary, path, follow_symlinks=False)
    else:
        os.symlink(outside.target(kind, target or path), path)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def sweep_images(case: Hostile) -> tuple[str, ...]:
    """A sweep's images: the drawn ones, and plain ones up to SWEEP_IMAGES (its trials hold
    one in five out for validation)."""
    plain = tuple(f"images/s{i}.png" for i in range(SWEEP_IMAGES - len(case.images)))
    return (*case.images, *plain) if case.kind == "sweep" else ()


def sweep_masks(case: Hostile) -> list[str]:
    """A sweep's masks (in the same order as its images), each named by its image's stem."""
    return [f"masks/{Path(p).stem}.png" for p in sweep_images(case)]


def manifest(case: Hostile, image: bytes, scale: Scale) -> bytes:
    """The manifest's bytes: the images with sizes and checksums (and a sweep's masks), the
    listed plants, then the variant's hostility."""
    entry = {"size": len(image), "sha256": hashlib.sha256(image).hexdigest()}
    images = sweep_images(case) or case.images
    files = [{"path": p, **entry} for p in images]
    files += [{"path": p, "role": "mask", "size": len(MASK)} for p in sweep_masks(case)]
    files += [{"path": p.path} for p in case.plants if p.listed]
    document: dict[str, object] = {
        "watchd": 1, "kind": case.kind, "title": case.title,
        "owner": {"name": case.owner, "email": "owner@example.org"},
        "model": {"name": MODEL, "version": "latest"}, "files": files,
    }  # fmt: skip
    if case.kind == "sweep":
        document.update(SWEEP)
    if case.manifest == "globstar":
        del document["files"]
        document["patterns"] = [{"glob": "/".join(["**"] * 8) + "/*.png", "count": 1}]
    text = tomli_w.dumps(document)
    if case.manifest == "huge":
        one = tomli_w.dumps({"files": files[:1]})
        text += one * (scale.huge_bytes // len(one))
    if case.manifest == "nested":
        text = "deep = " + "[" * scale.nesting + "]" * scale.nesting + "\n" + text
    return text.encode()


def put_manifest(folder: Path, variant: str, data: bytes, outside: Outside) -> None:
    """Written last, under another name and renamed in; or a link or FIFO in its place."""
    path = folder / MANIFEST
    if variant == "link":
        os.symlink(outside.sentinel / "notes" / "plan.txt", path)
    elif variant == "fifo":
        os.mkfifo(path)
    else:
        partial = folder / ".manifest.partial"
        partial.write_bytes(data)
        os.replace(partial, path)
