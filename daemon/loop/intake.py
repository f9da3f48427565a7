"""Intake: a batch folder was touched; read its manifest and record what it means.

The same folder with the same manifest content as its latest revision is the same batch,
whatever the rescans, restarts or repeated drops. A changed manifest becomes a new revision
(also one changed back to an earlier revision's content: its owner wants it run again); an
active older revision is cancelled through an intent, as an operator's cancel would be. A
manifest that does not parse becomes a failed batch with every problem listed, unless it was
written moments ago (it may still be being written): then it is looked at again once it has
settled.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from daemon.contract.errors import ManifestError
from daemon.contract.heldfolder import FOLDER_REPLACED, HeldFolder
from daemon.contract.jobspec import Identity, Problem
from daemon.core.manifest import (
    MANIFEST_NAME,
    RESULTS_DIR,
    Manifest,
    manifest_sha256,
    parse_manifest,
)
from daemon.core.owners import Owner
from daemon.core.records import Batch, IntentAction, NewBatch
from daemon.core.states import BatchState
from daemon.site.owners import owner_of
from daemon.store import Store
from daemon.watcher import FolderSeen, stat_signature

log = structlog.get_logger("watchd.intake")

RUN_NAME_TRIES = 3  # a random part that exists already: drawn again (32 bits: never in practice)


@dataclass(frozen=True)
class Seen:
    """A batch folder as intake found it: its identity and owner (None for a folder not read)
    and its manifest's stat signature."""

    root: Path
    folder: str
    identity: Identity | None
    signature: str
    owner: Owner | None = None


@dataclass(frozen=True)
class LookAgain:
    """Look at this folder again at ``at``: its manifest is invalid but still fresh, or the
    folder or its manifest cannot be read by the service (yet: its owner may set the ACLs)."""

    root: Path
    folder: str
    at: float


@dataclass(frozen=True)
class Looked:
    """What one look at a folder did: the batch it recorded or found again (its status file is
    due, and its folder is watched while it is under way), and when to look again."""

    taken: Batch | None = None
    again: LookAgain | None = None


class Intake:
    def __init__(
        self,
        store: Store,
        *,
        max_manifest_bytes: int,
        settle_seconds: float,
        limits: Callable[[Manifest], Sequence[Problem]] | None = None,
        retry_seconds: float = 30.0,
        admits: Callable[[Owner], Problem | None] | None = None,
    ) -> None:
        """``limits``: the site's rules beyond the manifest format (e.g. the cluster's bounds
        on resources); a manifest that breaks one is refused like an invalid one.
        ``retry_seconds``: how often a folder or manifest the service may not read is looked
        at again. ``admits``: why the site refuses a folder's owner (None: it does not)."""
        self.store = store
        self.limits = limits
        self.admits = admits
        self.max_bytes = max_manifest_bytes
        self.settle = settle_seconds
        self.retry = retry_seconds
        self._taken: Batch | None = None

    def changed(self, root: Path, found: Sequence[FolderSeen]) -> list[str]:
        """The folders among some a scan found whose manifest is not the one last taken in (by
        its stat). The signatures are asked of the store and not kept: the daemon's memory does
        not grow with the number of folders on the share."""
        known = self.store.manifest_stats(str(root), [seen.folder for seen in found])
        return [seen.folder for seen in found if known.get(seen.folder) != seen.manifest_stat]

    def look(self, root: Path, folder: str, now: float) -> Looked:
        """Read the folder's manifest if it changed; record a batch (or a failure) for it."""
        self._taken = None
        again = self._look(root, folder, now)
        return Looked(self._taken, again)

    def _look(self, root: Path, folder: str, now: float) -> LookAgain | None:
        path = root / folder
        try:
            st = os.lstat(path / MANIFEST_NAME)
        except PermissionError as exc:  # the folder: whether it holds a manifest is unknown
            return self._unreadable(
                root, folder, UNREADABLE_FOLDER, _folder_unreadable(exc, self.retry), now
            )
        except OSError:  # no manifest (yet), or the folder is gone
            known = self.store.manifest_stats(str(root), [folder]).get(folder)
            if known == UNREADABLE_FOLDER:  # readable now: its manifest may come any moment,
                return LookAgain(root, folder, now + self.retry)  # unseen by a watch it lacks
            return None
        signature = stat_signature(st)
        if self.store.manifest_stats(str(root), [folder]).get(folder) == signature:
            return None
        refusal = _refusal(root, folder, st)
        if refusal is not None:
            self._record_refusal(root, folder, signature, refusal, now)
            return None
        try:
            identity, owner, data = _read(root, folder, self.max_bytes)
        except PermissionError as exc:
            return self._unreadable(
                root, folder, f"{signature}:unreadable", _unreadable(exc, self.retry), now
            )
        except OSError as exc:  # the share failing: try again at the next look
            log.warning("manifest unreadable", root=str(root), folder=folder, error=str(exc))
            return None
        return self._take(Seen(root, folder, identity, signature, owner), data, st.st_mtime, now)

    def _take(self, seen: Seen, data: bytes, mtime: float, now: float) -> LookAgain | None:
        sha = manifest_sha256(data)
        latest = self.store.latest_revision(str(seen.root), seen.folder)
        if latest is not None and latest.manifest_sha256 == sha and not _cut_off(latest, seen):
            self.store.set_manifest_stat(latest.id, seen.signature, seen.identity)
            log.info("manifest unchanged", batch_id=latest.id, folder=seen.folder)
            self._taken = latest  # the folder may be a fresh copy: its status file is due again
            return None
        stranger = self.admits(seen.owner) if self.admits and seen.owner else None
        try:
            manifest: Manifest | None = parse_manifest(data, max_bytes=self.max_bytes)
            problems: tuple[Problem, ...] = ()
            if self.limits is not None and manifest is not None:
                problems = tuple(self.limits(manifest))
                manifest = None if problems else manifest
            if stranger is not None and manifest is not None:
                manifest, problems = None, (stranger,)
        except ManifestError as exc:
            if now - mtime < self.settle:
                return LookAgain(seen.root, seen.folder, mtime + self.settle)
            manifest, problems = None, exc.problems
        refused_owner = stranger is not None and problems == (stranger,)
        why = "owner refused: not in the site's [accounts]" if refused_owner else "manifest refused"
        self._record(seen, data, sha, manifest, problems, now, why)
        return None

    def _record(
        self,
        seen: Seen,
        data: bytes,
        sha: str,
        manifest: Manifest | None,
        problems: tuple[Problem, ...],
        now: float,
        refused: str = "manifest refused",
    ) -> None:
        root, folder = seen.root, seen.folder
        previous = self.store.latest_revision(str(root), folder)
        new = NewBatch(
            root=str(root),
            folder=folder,
            manifest_sha256=sha,
            manifest_text=data.decode("utf-8", "replace"),
            manifest_stat=seen.signature,
            kind=manifest.kind if manifest else None,
            title=manifest.title if manifest else "",
            owner=manifest.owner_name if manifest else "",
            contact=manifest.owner_email if manifest else None,
            run_dir=_run_dir(seen.root, seen.folder, now, sha, made=manifest is not None),
            folder_device=seen.identity.device if seen.identity else None,
            folder_inode=seen.identity.inode if seen.identity else None,
            root_inode=seen.identity.root if seen.identity else None,
            owner_uid=seen.owner.uid if seen.owner else None,
            owner_gid=seen.owner.gid if seen.owner else None,
            owner_user=seen.owner.user if seen.owner else "",
            owner_group=seen.owner.group if seen.owner else "",
        )
        with self.store.atomic():
            if manifest is not None:
                batch = self.store.create_batch(new, BatchState.WAITING, "manifest accepted", now)
            else:
                batch = self.store.create_batch(new, BatchState.FAILED, refused, now, problems)
            if previous is not None:
                self._supersede(previous, batch, _replaced(previous, seen), now)
        log.info(
            "batch recorded",
            batch_id=batch.id,
            folder=folder,
            revision=batch.revision,
            state=batch.state.value,
            problems=[p.render() for p in problems],
        )
        self._taken = batch

    def _supersede(self, previous: Batch, batch: Batch, replaced: bool, now: float) -> None:
        """Cancel the folder's previous revision, as an operator's cancel would: its owner
        changed the manifest, or replaced the whole folder (a folder of the same name that is
        not the one it was taken in from; its jobs refuse to read the new one)."""
        self.store.stop_watching_inputs(previous.root, previous.folder)
        what = FOLDER_REPLACED if replaced else "manifest changed"
        self.store.note(
            batch.id, f"{what}: revision {batch.revision} replaces {previous.revision}", now
        )
        if not previous.state.terminal:
            why = f"superseded by revision {batch.revision}"
            why = f"{FOLDER_REPLACED}; {why}" if replaced else why
            self.store.add_intent(IntentAction.CANCEL, previous.id, now, f"watchd ({why})")

    def _unreadable(
        self, root: Path, folder: str, signature: str, problem: Problem, now: float
    ) -> LookAgain:
        """A folder or manifest the service may not read: its owner (or the operator) must set
        the ACLs. Said once in the store, so in watchctl and the log (and in the folder's
        status file where the folder can be written), under a signature no stat gives, and
        looked at again every ``retry_seconds``: a chmod or setfacl changes no size nor mtime,
        so nothing else would notice the fix before the next catch-up scan."""
        if self._record_refusal(root, folder, signature, problem, now, "unreadable by watchd"):
            log.warning("batch folder unreadable", root=str(root), folder=folder,
                        problem=problem.render(), retry_seconds=self.retry)  # fmt: skip
        return LookAgain(root, folder, now + self.retry)

    def _record_refusal(
        self,
        root: Path,
        folder: str,
        signature: str,
        problem: Problem,
        now: float,
        reason: str = "manifest refused",
    ) -> bool:
        """A folder or manifest we must not read: record the refusal without reading it
        (unless it is recorded already); whether it was recorded now."""
        sha = hashlib.sha256(f"refused:{signature}".encode()).hexdigest()
        latest = self.store.latest_revision(str(root), folder)
        if latest is not None and latest.manifest_sha256 == sha:
            return False
        seen = Seen(root, folder, None, signature)
        self._record(seen, b"", sha, None, (problem,), now, reason)
        return True


def _refusal(root: Path, folder: str, st: os.stat_result) -> Problem | None:
    """Why a folder's manifest must not be read at all, or None."""
    if not inside_root(root, folder):
        return Problem(
            f"batch folder '{folder}'",
            f"is a link to {os.path.realpath(root / folder)}, outside the drop root",
            "copy the folder itself onto the share",
        )
    if stat.S_ISLNK(st.st_mode):
        return Problem(MANIFEST_NAME, "is a symbolic link", "copy the manifest file itself")
    if not stat.S_ISREG(st.st_mode):
        return Problem(MANIFEST_NAME, "is not a regular file")
    return None


UNREADABLE_FOLDER = "unreadable"  # the signature of a folder the service may not look into


def _unreadable(exc: OSError, retry: float) -> Problem:
    return Problem(
        MANIFEST_NAME,
        f"cannot be read by the watchd service: {exc.strerror}",
        "make it readable for the service (e.g. chmod a+r manifest.toml, or the ACLs of "
        f"docs/install.md, step 3); watchd reads it again every {retry:g} s",
    )


def _folder_unreadable(exc: OSError, retry: float) -> Problem:
    return Problem(
        "batch folder",
        f"cannot be read by the watchd service: {exc.strerror}",
        "give the watchd service access as the drop root's default ACLs would have "
        "(docs/install.md, step 3; its troubleshooting names the setfacl commands); "
        f"watchd looks again every {retry:g} s",
    )


def _read(root: Path, folder: str, max_bytes: int) -> tuple[Identity, Owner, bytes]:
    """The batch folder's identity and owner (as the share reports it) and at most
    ``max_bytes + 1`` bytes of its manifest (enough for the parser to say it is too big), all
    from the one folder held for it: a manifest or folder swapped for a link or a FIFO after
    the first look is never read (nor waited on).
    """
    with HeldFolder.batch(root, folder) as held, held.open_read(MANIFEST_NAME) as handle:
        return held.identity(), owner_of(os.fstat(held.fd)), handle.read(max_bytes + 1)


def _replaced(previous: Batch, seen: Seen) -> bool:
    """Whether the folder seen now is another than the one ``previous`` was taken in from."""
    if previous.identity is None or seen.identity is None:
        return False
    return not previous.identity.same(seen.identity)


def _cut_off(previous: Batch, seen: Seen) -> bool:
    """Whether ``previous`` had jobs out on a folder now replaced: they cannot go on (they hold
    the old folder, and never read the new one), so even the same manifest is a new revision.
    Before any job ran, or once the batch ended, a folder dropped again with the same manifest
    is the same batch, which then refers to the new folder."""
    return previous.state is BatchState.RUNNING and _replaced(previous, seen)


def _run_dir(root: Path, folder: str, now: float, sha: str, *, made: bool) -> str:
    """The run folder of a new batch: made now for an accepted manifest, named only for a
    refused one (no job of it will run)."""
    if made:
        return make_run_dir(root, folder, now, sha)
    return str(root / folder / RESULTS_DIR / _run_name(now, sha))


def make_run_dir(root: Path, folder: str, now: float, sha: str) -> str:
    """Make the batch's run folder ``results/<name>`` (by the rule of
    :mod:`daemon.contract.heldfolder`) and return its path. The name sorts by time but has a random
    part, so its owner cannot plant it in advance; mkdir fails on a name that exists, and another
    is drawn. If it cannot be made now (folder not writable, a link planted as ``results``), the
    path is returned all the same: the first job's preparation meets the problem and fails the
    batch with it."""
    name = _run_name(now, sha)
    try:
        with HeldFolder.batch(root, folder) as held, held.folder(RESULTS_DIR, create=True) as out:
            for _ in range(RUN_NAME_TRIES):
                try:
                    out.mkdir(name)
                    break
                except FileExistsError:
                    name = _run_name(now, sha)
    except (OSError, ValueError) as exc:
        log.warning("run folder not made", root=str(root), folder=folder, error=str(exc))
    return str(root / folder / RESULTS_DIR / name)


def _run_name(now: float, sha: str) -> str:
    """UTC second, manifest prefix and 32 random bits: sorted by time, never guessed."""
    stamp = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{sha[:8]}-{secrets.token_hex(4)}"


def inside_root(root: Path, folder: str) -> bool:
    """Whether ``root/folder`` is a real folder directly inside ``root`` (safe to write into)."""
    path = root / folder
    return not os.path.islink(path) and os.path.dirname(os.path.realpath(path)) == os.path.realpath(
        root
    )
