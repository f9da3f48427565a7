"""The per-shard ledger of inference: which images are done, so a re-run skips them.

``work_dir/ledger/shard-NNNN.jsonl`` (in the spool, the service's own): one JSON line per
image whose mask was written, appended once the mask is durable (masks are made durable
together: :mod:`pipelines.inference.durable`): the input's path and sha256, the model's sha256,
a hash of the inference parameters, and the image's table row. A re-run of the shard (a retry
after a crash, an operator's requeue) takes an image's row from the ledger instead of
segmenting it again when all of these still hold: same path, same input bytes (the manifest's
sha256, or the file's; an OME-Zarr store's state), same model, same parameters, and the mask is
still there (in the owner's results folder, looked at through the held run folder). A torn
last line (the job was killed while appending) is ignored: that image is simply done again.
The ledger is read and appended through the held work folder: what is not a plain file at its
name is not read, and is replaced by the ledger's own file when the first line is appended.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

from daemon.contract.checksums import sha256_of_stream
from daemon.contract.heldfolder import HeldFolder, UnsafeEntry
from daemon.contract.jobspec import InputFile
from daemon.contract.names import is_store
from daemon.contract.safeopen import Folder, RefusedInput, open_input
from daemon.contract.stores import MAX_STORE_ENTRIES, store_state
from pipelines.layout import LEDGER_DIR

log = logging.getLogger("pipelines")


def params_hash(params: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(params), sort_keys=True).encode()).hexdigest()[:16]


def _hash_input(batch_dir: Folder, relative: str) -> str:
    """The input's sha256; an OME-Zarr store's state (its files' names, sizes and times: what
    its segmentation recorded, :mod:`pipelines.ngff`)."""
    if is_store(relative) and isinstance(batch_dir, HeldFolder):
        walked = store_state(batch_dir, relative, MAX_STORE_ENTRIES)
        if walked.problem:
            raise OSError(walked.problem)
        return walked.state
    with open_input(batch_dir, relative) as handle:
        return sha256_of_stream(handle)


class Ledger:
    """The done images of one shard, read at start; :meth:`record` appends as images finish."""

    def __init__(
        self, work: HeldFolder, name: str, model_sha256: str, params: Mapping[str, Any]
    ) -> None:
        """The ledger ``ledger/<name>`` of the held work folder ``work``."""
        self.work, self.name = work, name
        self.key = {"model_sha256": model_sha256, "params": params_hash(params)}
        self.entries: dict[str, dict[str, Any]] = {}
        self._handle: IO[str] | None = None
        for line in self._lines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash
            if isinstance(entry, dict) and all(entry.get(k) == v for k, v in self.key.items()):
                self.entries[entry["path"]] = entry

    def _lines(self) -> list[str]:
        """The ledger's lines; none if it is missing or not a plain file (a planted entry)."""
        relative = f"{LEDGER_DIR}/{self.name}"
        try:
            with self.work.open_read(relative) as handle:
                return handle.read().decode("utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []
        except UnsafeEntry as exc:
            if exc.relative != relative:
                raise  # not a folder where ledger/ goes: refused
            log.warning("ledger not read: %s", exc)
            return []

    def done_row(
        self, item: InputFile, batch_dir: Folder, mask_present: Callable[[str, bool], bool]
    ) -> dict[str, Any] | None:
        """The recorded row of ``item`` if it is done with these very inputs and its mask is
        there (``mask_present(path, tiled)``, asked only of a recorded image), else None."""
        entry = self.entries.get(item.path)
        if entry is None or not mask_present(item.path, str(entry["row"].get("tiled")) == "1"):
            return None
        try:
            digest = item.sha256.lower() if item.sha256 else _hash_input(batch_dir, item.path)
        except (OSError, RefusedInput):
            return None  # segmented again: reading it then says what is wrong
        return dict(entry["row"]) if digest == entry["input_sha256"] else None

    def record(self, path: str, input_sha256: str, row: Mapping[str, Any]) -> None:
        self.record_all([(path, input_sha256, row)])

    def record_all(self, done: Iterable[tuple[str, str, Mapping[str, Any]]]) -> None:
        """Append a line for each (path, input sha256, table row), in one write: call it only
        once their masks are durable."""
        if self._handle is None:
            self._handle = self._open()
        lines = [
            json.dumps({"path": path, "input_sha256": digest, **self.key, "row": dict(row)},
                       ensure_ascii=False) + "\n"
            for path, digest, row in done
        ]  # fmt: skip
        self._handle.write("".join(lines))
        self._handle.flush()

    def _open(self) -> IO[str]:
        """The ledger, open for appending; a planted link, FIFO or hard link at its name is
        removed first (never followed), so the ledger is a file of its own."""
        with self.work.folder(LEDGER_DIR, create=True) as folder:
            if _planted(folder, self.name):
                log.warning("ledger: replacing %s (not a file of its own)", self.name)
                folder.unlink(self.name)
            fd = folder.open_append(self.name)
        return os.fdopen(fd, "a", encoding="utf-8")

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _planted(folder: HeldFolder, name: str) -> bool:
    """Whether ``name`` in ``folder`` is there but not a plain file of one link (a folder is not
    removed: appending to it is refused)."""
    try:
        st = folder.lstat(name)
    except FileNotFoundError:
        return False
    plain = stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    return not plain and not stat.S_ISDIR(st.st_mode)
