"""The per-shard ledger of inference: which images are done, so a re-run skips them.

``run_dir/ledger/shard-NNNN.jsonl``: one JSON line per image whose mask was written, appended
after the mask is in place: the input's path and sha256, the model's sha256, a hash of the
inference parameters, and the image's table row. A re-run of the shard (a retry after a crash,
an operator's requeue) takes an image's row from the ledger instead of segmenting it again when
all of these still hold: same path, same input bytes (the manifest's sha256, or the file's),
same model, same parameters, and the mask is still there. A torn last line (the job was killed
while appending) is ignored: that image is simply done again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from daemon.checksums import sha256_of_stream
from daemon.jobspec import InputFile
from daemon.safeopen import Folder, RefusedInput, open_input


def params_hash(params: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(params), sort_keys=True).encode()).hexdigest()[:16]


def _hash_input(batch_dir: Folder, relative: str) -> str:
    with open_input(batch_dir, relative) as handle:
        return sha256_of_stream(handle)


class Ledger:
    """The done images of one shard, read at start; :meth:`record` appends as images finish."""

    def __init__(self, path: Path, model_sha256: str, params: Mapping[str, Any]) -> None:
        self.path = path
        self.key = {"model_sha256": model_sha256, "params": params_hash(params)}
        self.entries: dict[str, dict[str, Any]] = {}
        self._handle: IO[str] | None = None
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash
            if isinstance(entry, dict) and all(entry.get(k) == v for k, v in self.key.items()):
                self.entries[entry["path"]] = entry

    def done_row(self, item: InputFile, batch_dir: Folder, mask: Path) -> dict[str, Any] | None:
        """The recorded row of ``item`` if it is done with these very inputs, else None."""
        entry = self.entries.get(item.path)
        if entry is None or not mask.is_file():
            return None
        try:
            digest = item.sha256.lower() if item.sha256 else _hash_input(batch_dir, item.path)
        except (OSError, RefusedInput):
            return None  # segmented again: reading it then says what is wrong
        return dict(entry["row"]) if digest == entry["input_sha256"] else None

    def record(self, path: str, input_sha256: str, row: Mapping[str, Any]) -> None:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open)
        entry = {"path": path, "input_sha256": input_sha256, **self.key, "row": dict(row)}
        self._handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
