"""sha256 of files, read in blocks: what a manifest's checksums, the ledger and the model
registry compare against."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import IO

BLOCK = 1 << 20


def sha256_of_stream(handle: IO[bytes]) -> str:
    """The sha256 of what is left to read in ``handle``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(BLOCK), b""):
        digest.update(block)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    """The sha256 of the file at ``path`` (follows links: only for paths watchd chose, never
    for a batch's inputs, which go through :func:`daemon.contract.safeopen.open_input`)."""
    with open(path, "rb") as handle:
        return sha256_of_stream(handle)
