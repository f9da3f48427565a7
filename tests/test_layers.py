"""The import rules of docs/architecture.md, read from the code: each layer of ``daemon/``
imports only the layers below it, the daemon never imports the training stack, and the jobs
(``pipelines/``, ``models/``) import nothing of the daemon but its contract.

Every import counts, at the top of a module or inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Each layer, bottom up, with what it may import of the daemon besides itself.
BELOW: dict[str, frozenset[str]] = {
    "contract": frozenset(),
    "core": frozenset({"contract"}),
    "site": frozenset({"contract", "core"}),
    "store": frozenset({"contract", "core"}),
    "executors": frozenset({"contract", "core", "site"}),
    "watcher": frozenset({"contract", "core", "site"}),
    "loop": frozenset({"contract", "core", "site", "store", "executors", "watcher"}),
    "cli": frozenset({"contract", "core", "site", "store", "executors"}),
    "watchd": frozenset({"contract", "core", "site", "store", "executors", "cli", "loop"}),
}
TRAINING_STACK = frozenset({"torch", "lightning", "torchvision", "wandb", "pipelines", "models"})


def imported(path: Path, text: str | None = None) -> Iterator[tuple[int, str]]:
    """Every module a file imports (absolute names), with its line; ``text``: read it as the
    file's."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            if base == "daemon":  # from daemon import site: the layer is the name imported
                yield from ((node.lineno, f"daemon.{alias.name}") for alias in node.names)
            else:
                yield node.lineno, base


def layer_of(module: str) -> str:
    return module.split(".")[1]


def sources(top: str) -> list[Path]:
    return sorted((REPO / top).rglob("*.py"))


def crossings() -> list[str]:
    """The imports of daemon/ that cross a forbidden line, as 'file:line: what'."""
    found = []
    for path in sources("daemon"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if len(parts) < 2 or parts[1] == "__init__":
            continue
        mine = parts[1]
        assert mine in BELOW, f"{path}: a module outside the layers of docs/architecture.md"
        for line, module in imported(path):
            top = module.split(".")[0]
            where = f"{path.relative_to(REPO)}:{line}"
            if top in TRAINING_STACK:
                found.append(f"{where}: the daemon imports {module}")
            elif top == "daemon" and "." in module:
                theirs = layer_of(module)
                if theirs != mine and theirs not in BELOW[mine]:
                    found.append(f"{where}: {mine} imports {theirs} ({module})")
    return found


def test_each_layer_of_the_daemon_imports_only_the_layers_below_it() -> None:
    assert crossings() == []


@pytest.mark.parametrize("top", ["pipelines", "models"])
def test_the_jobs_import_nothing_of_the_daemon_but_its_contract(top: str) -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sources(top)
        for line, module in imported(path)
        if module == "daemon" or (module.startswith("daemon.") and layer_of(module) != "contract")
    ]
    assert found == []


def test_the_contract_stands_alone_and_the_daemon_loads_without_the_training_stack() -> None:
    """Importing every module of daemon/ loads no torch, Lightning, pipelines or models; importing
    the contract loads nothing else of the daemon (a job on a compute node needs only it)."""
    code = (
        "import importlib, pathlib, sys\n"
        "for p in sorted(pathlib.Path('daemon/contract').glob('*.py')):\n"
        "    importlib.import_module('.'.join(p.with_suffix('').parts).removesuffix('.__init__'))\n"
        "outside = sorted(m for m in sys.modules if m.startswith('daemon.')\n"
        "                 and not m.startswith('daemon.contract'))\n"
        "assert not outside, outside\n"
        "for p in sorted(pathlib.Path('daemon').rglob('*.py')):\n"
        "    importlib.import_module('.'.join(p.with_suffix('').parts).removesuffix('.__init__'))\n"
        "stack = sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:]))\n"
        "assert not stack, stack\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *sorted(TRAINING_STACK)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        ("pipelines.report", "['PIL', 'imagecodecs', 'scipy', 'skimage']"),
        ("pipelines.assemble", "['PIL', 'imagecodecs', 'scipy', 'zarr']"),
        ("pipelines.infer", "[]"),
        ("pipelines.inference.finish", "['PIL', 'imagecodecs', 'scipy', 'skimage']"),
        ("pipelines.inference.source", "['PIL', 'imagecodecs']"),
    ],
)
def test_each_job_and_process_starts_with_only_what_it_needs(module: str, expected: str) -> None:
    """The report and the assembly load no torch (seconds of a job's start); the report and the
    inference job no zarr (0.2–0.3 s) until a slide asks for it. The inference job's main
    process starts with neither torch nor its workers' libraries (Pillow, libpng, scipy,
    scikit-image): it starts the workers first, then each process imports what it needs, side
    by side (pipelines/infer.py). The workers' stages need no torch."""
    heavy = "{'torch', 'zarr', 'PIL', 'imagecodecs', 'scipy', 'skimage'}"
    code = f"import sys, {module}\nprint(sorted({heavy} & {{m.split('.')[0] for m in sys.modules}}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    assert done.stdout.strip() == expected, done.stderr


def test_the_rule_catches_a_crossing() -> None:
    """The reader sees imports inside functions and relative ones, as the rule needs."""
    text = "def f():\n    from daemon.store import Store\n    from ..loop import service\n"
    names = [name for _, name in imported(REPO / "daemon" / "core" / "states.py", text)]
    assert names == ["daemon.store", "daemon.loop"]
