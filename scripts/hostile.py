"""Hostile batch folders, as a data owner who means harm (or is only careless) would make them:
links (out of the folder, to the model registry, dangling, looping) and FIFOs anywhere,
including pre-planted under ``results/`` at the names the daemon will use; long and odd names;
deep and wide trees; huge, deeply nested and ``**``-heavy manifests; and inputs or outputs
swapped for links and FIFOs while the batch runs.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tomli_w
from hypothesis import strategies as st
from PIL import Image

MODEL = "spheroid-unet"
MANIFEST = "manifest.toml"
# What a planted entry is: a link to a file or folder of the sentinel tree (outside the drop
# root), to the registry or a model's weights in it, a dangling or self-looping link, a FIFO.
KINDS = ("file-out", "dir-out", "registry", "weights", "dangling", "loop", "fifo")
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


@dataclass(frozen=True)
class Outside:
    """What links point at: the sentinel tree beside the drop root, and the registry."""

    sentinel: Path
    registry: Path

    def target(self, kind: str, link: Path) -> Path:
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
    """A file or folder name: odd (quotes, CR, LF, NFD, ...), random, or long (to 255 bytes)."""
    room = limit - len(suffix)
    random = st.text(
        st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=30
    )
    long = st.integers(min_value=room - 60, max_value=room).map(lambda n: "L" * n)
    return (
        st.one_of(st.sampled_from(odd), random, long)
        .map(lambda n: n + suffix)
        .filter(lambda n: fits(n) and not n.startswith("."))
    )


def plants(under_results: bool, odd: list[str]) -> st.SearchStrategy[Plant]:
    where = st.lists(names(".png", 120, odd), min_size=1, max_size=3).map("/".join)
    if under_results:
        where = where.map(lambda p: f"results/{p}")
    return st.builds(Plant, where, st.sampled_from(KINDS), st.booleans())


def hostile(
    scale: Scale, *, results: bool, manifests: tuple[str, ...] = ("good",), screen: bool = False
) -> st.SearchStrategy[Hostile]:
    """One hostile folder; ``results``: also plant links and FIFOs under results/ (at the run's
    predicted names and at random ones) and swap outputs while the batch runs; ``screen``:
    names, owner and title may carry terminal escapes and rich markup."""
    odd = ODD + SCREEN if screen else ODD
    level_plants = st.builds(Plant, st.sampled_from(LEVELS), st.sampled_from(KINDS))
    swaps = SWAPS if results else SWAPS[:2]
    return st.builds(
        Hostile,
        name=names(limit=200, odd=odd),
        owner=st.sampled_from(odd),
        title=st.sampled_from(odd),
        images=st.lists(names(".png", odd=odd), min_size=1, max_size=scale.images, unique=True).map(
            lambda found: tuple(f"images/{n}" for n in found)
        ),
        plants=st.lists(
            st.one_of(plants(False, odd), plants(True, odd)) if results else plants(False, odd),
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
    )


def scenarios(scale: Scale, **options: object) -> st.SearchStrategy[tuple[Hostile, ...]]:
    """A few hostile folders dropped at once (distinct names)."""
    one = hostile(scale, **options)  # type: ignore[arg-type]
    return st.lists(one, min_size=1, max_size=scale.folders, unique_by=_nfc_name).map(tuple)


def _nfc_name(case: Hostile) -> str:
    return unicodedata.normalize("NFC", case.name)


# -- on disk ---------------------------------------------------------------------------------------


def png(seed: int = 0, size: int = 32) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def build(
    root: Path, case: Hostile, outside: Outside, scale: Scale, *, stamps: list[str], batches: int
) -> Path:
    """Make the folder under ``root``, manifest last; plant under results/ at the names a run
    started at any of ``stamps`` by a batch numbered up to ``batches`` would use."""
    folder = root / case.name
    folder.mkdir()
    image = png()
    for relative in case.images:
        write(folder / relative, image)
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
    """A FIFO, or a link of ``kind`` (``target``: the path it stands for, if not itself)."""
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(outside.target(kind, target or path), path)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def manifest(case: Hostile, image: bytes, scale: Scale) -> bytes:
    """The manifest's bytes: the images with sizes and checksums, the listed plants, then the
    variant's hostility."""
    entry = {"size": len(image), "sha256": hashlib.sha256(image).hexdigest()}
    files = [{"path": p, **entry} for p in case.images]
    files += [{"path": p.path} for p in case.plants if p.listed]
    document: dict[str, object] = {
        "watchd": 1, "kind": "inference", "title": case.title,
        "owner": {"name": case.owner, "email": "owner@example.org"},
        "model": {"name": MODEL, "version": "latest"}, "files": files,
    }  # fmt: skip
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


# -- while it runs ---------------------------------------------------------------------------------


def swap(folder: Path, case: Hostile, what: str, outside: Outside) -> None:
    """Swap an input or an output for a link out of the folder or a FIFO (renamed over it, so
    there is no moment without the name)."""
    if what.startswith("image"):
        targets = [folder / case.images[0]]
    elif what.startswith("log"):
        targets = [p for p in real_files(folder / "results") if p.name == "log.txt"]
    else:
        targets = [p for p in real_dirs(folder / "results") if p.name == "masks"]
    for path in targets:
        replace_with(path, "fifo" if what.endswith("fifo") else _link_kind(what), outside)


def _link_kind(what: str) -> str:
    return "dir-out" if what == "masks-link" else "file-out"


def replace_with(path: Path, kind: str, outside: Outside) -> None:
    fresh = path.with_name(".swap-" + path.name[:200])
    if os.path.lexists(fresh):
        return
    make_odd(fresh, kind, outside, target=path)
    if path.is_dir() and not path.is_symlink():
        os.replace(path, path.with_name(path.name + ".moved"))
    os.replace(fresh, path)


def real_files(top: Path) -> list[Path]:
    """Regular files under ``top``, never through a link (os.walk does not follow them)."""
    return [Path(d) / f for d, _, files in os.walk(top) for f in files if _regular(Path(d) / f)]


def real_dirs(top: Path) -> list[Path]:
    return [
        Path(d) / n for d, dirs, _ in os.walk(top) for n in dirs if not (Path(d) / n).is_symlink()
    ]


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()
