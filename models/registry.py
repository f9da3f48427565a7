"""The model registry: publish and load weights; the catalogue itself is :mod:`models.catalog`.

Loading reads ``weights.pt`` once, checks its sha256 against the metadata, and unpickles with
``torch.load(weights_only=True)`` from those same bytes: nothing else is ever unpickled. A
missing, truncated or changed file (hash mismatch), or one that holds anything but tensors, is
refused with a :class:`ModelError` naming what was expected.
"""

from __future__ import annotations

import hashlib
import io
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from daemon.contract.atomicfile import write_bytes
from models.catalog import (
    WEIGHTS_FILE,
    BestRule,
    ModelError,
    ModelVersion,
    check_name,
    find,
    list_versions,
    publish,
    read_aliases,
    resolve,
    update_aliases,
)

__all__ = [
    "BestRule",
    "ModelError",
    "ModelVersion",
    "check_name",
    "find",
    "list_versions",
    "load",
    "load_file",
    "publish",
    "read_aliases",
    "register",
    "resolve",
]


def load(model: ModelVersion) -> dict[str, torch.Tensor]:
    """Read and verify the weights of ``model``; only tensors are ever unpickled."""
    return load_file(
        model.weights_path, model.sha256, f"model {model.name!r} version {model.version}"
    )


def load_file(path: Path, sha256: str, where: str) -> dict[str, torch.Tensor]:
    """Read ``path``, check its sha256, unpickle tensors only (``where`` names it in errors)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelError(f"{where}: cannot read {path} ({exc})") from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise ModelError(
            f"{where}: {path.name} has sha256 {actual} ({len(data)} bytes), the registry "
            f"recorded {sha256}: the file was truncated or changed after publication"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling failure means: refuse this file
        raise ModelError(f"{where}: refused to load {path.name} ({exc})") from exc
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ModelError(f"{where}: {path.name} is not a state_dict of tensors")
    return state


def state_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def register(
    registry: Path,
    name: str,
    state: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    *,
    val_dice: float | None = None,
    rule: BestRule | None = None,
) -> ModelVersion:
    """Publish ``state`` as the next version of ``name`` and update the aliases.

    ``metadata`` is stored as given, plus ``name``, ``version``, ``sha256``, ``size`` and
    ``val_dice``; ``rule`` (default: higher val_dice, no margin) decides whether the new
    version becomes ``best``. Returns the published version.
    """
    registry = Path(registry)
    model_dir = registry / check_name(name)
    model_dir.mkdir(parents=True, exist_ok=True)
    data = state_bytes(state)
    record = {**metadata, "name": name, "val_dice": val_dice}
    record.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    # os.mkdir honours the umask (mkdtemp would make the version private to this user).
    staging = model_dir / f".tmp-version-{secrets.token_hex(8)}"
    staging.mkdir()
    try:
        write_bytes(staging / WEIGHTS_FILE, data)
        version = publish(staging, model_dir, record)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    update_aliases(model_dir, version, rule or BestRule())
    return resolve(registry, name, str(version))
