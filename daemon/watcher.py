"""Notice manifests appearing under the drop roots; put immutable events on the service's queue.

A batch is a folder directly under a drop root holding ``manifest.toml``. Only what is needed
to see manifests appear is watched: the root itself and each batch folder. inotify where events
arrive; where they do not (network filesystems), watchdog's polling observer with a listing that
stops at the manifest. Events get lost (overflow, outages, a daemon that was down), so a
catch-up scan runs at start-up and every ``rescan_seconds``. Watcher threads only enqueue; the
service thread decides.

With inotify, the folders a waiting batch's inputs land in are watched too (at most
:data:`MAX_INPUT_WATCHES` per batch, never below them): a file landing there is not an event on
the queue (a copy of 50,000 files would wake the loop 50,000 times) but a mark the service
takes at each tick (:meth:`Watcher.arrived`), which brings the batch's next check forward
however far its checks had backed off.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import BaseObserver
from watchdog.observers.inotify_c import (
    CallbackId,
    InotifyConstants,
    InotifyEvent,
    InotifyFD,
    WatchDescriptor,
)
from watchdog.observers.polling import PollingObserverVFS

from daemon.core.manifest import MANIFEST_NAME, RESULTS_DIR, STATUS_NAME
from daemon.site.config import ObserverMode, RootSection
from daemon.site.mounts import choose_mode, filesystem_type

log = structlog.get_logger("watchd.watcher")


@dataclass(frozen=True)
class FolderTouched:
    """Something happened to a batch folder or its manifest: look at it."""

    root: Path
    folder: str


@dataclass(frozen=True)
class RootLost:
    """A drop root disappeared (deleted, unmounted): watching it stopped until it is back."""

    root: Path


@dataclass(frozen=True)
class Wake:
    """Not the filesystem's: work the loop waits for is ready (a check of a batch's inputs,
    done off the loop thread); the loop picks it up at once instead of at its next tick."""


WatchEvent = FolderTouched | RootLost | Wake


MAX_INPUT_WATCHES = 64  # folders of one batch's inputs watched, at most
_NOT_INPUTS = frozenset({MANIFEST_NAME.encode(), STATUS_NAME.encode(), RESULTS_DIR.encode()})


@dataclass(frozen=True, slots=True)
class FolderSeen:
    """One batch folder found by a scan, with its manifest's stat signature ('' if none)."""

    folder: str
    manifest_stat: str
    is_symlink: bool = False


def stat_signature(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def scan_root(root: Path) -> Iterator[FolderSeen]:
    """Every folder directly under ``root`` that holds a manifest (or that the service may
    not look into, with no signature); two stats per folder.

    Never lists a batch folder's content. Streams: the folders are not all held at once, so a
    scan of a share with many thousand folders costs no more memory than one of a few.
    Raises OSError when the root itself cannot be read.
    """
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=True):
                continue
            try:
                st = os.lstat(os.path.join(entry.path, MANIFEST_NAME))
            except PermissionError:  # a folder the service may not look into: intake says so
                yield FolderSeen(entry.name, "", entry.is_symlink())
                continue
            except OSError:
                continue
            yield FolderSeen(entry.name, stat_signature(st), entry.is_symlink())


class _DepthOneInotify:
    """inotify watches on a root and on folders directly under it, none deeper.

    A callback of watchdog's InotifyFD thread, which reads one inotify descriptor for all of
    them; events go to the queue as FolderTouched. A folder is watched from the moment it
    appears until its batch has ended and the service lets it go (:meth:`release`): the watches,
    here and in the kernel, grow with the batches under way, not with every folder ever dropped.
    A manifest changed in a folder no longer watched is found by the catch-up scan.
    """

    ROOT_MASK = (
        InotifyConstants.IN_CREATE
        | InotifyConstants.IN_MOVED_TO
        | InotifyConstants.IN_DELETE_SELF
        | InotifyConstants.IN_MOVE_SELF
        | InotifyConstants.IN_ONLYDIR
    )
    FOLDER_MASK = (
        InotifyConstants.IN_CLOSE_WRITE
        | InotifyConstants.IN_MOVED_TO
        | InotifyConstants.IN_ONLYDIR
        | InotifyConstants.IN_DONT_FOLLOW
    )

    def __init__(
        self,
        fd: InotifyFD,
        root: Path,
        events: queue.Queue[WatchEvent],
        unwatched: Collection[str] = (),
    ) -> None:
        """``unwatched``: folders not to watch (their batch has ended)."""
        self.fd, self.root, self.events = fd, root, events
        self.id = CallbackId(id(self))
        self.lock = threading.Lock()  # taken before watchdog's own lock, never after
        self.folders: dict[WatchDescriptor, str] = {}
        self.wds: dict[str, WatchDescriptor] = {}
        self.inodes: dict[WatchDescriptor, tuple[int, int]] = {}  # what each watch is on
        self.inputs: dict[WatchDescriptor, str] = {}  # a folder of inputs → its batch folder
        self.input_wds: dict[str, dict[str, WatchDescriptor]] = {}  # batch folder → its
        self.landed: set[str] = set()  # batch folders where inputs landed since taken
        self.alive = False
        self.root_wd: WatchDescriptor | None = None
        try:
            mask = self.ROOT_MASK
            self.root_wd = self.fd.add_callback(os.fsencode(root), mask, self, self.id)  # type: ignore[arg-type]
            with os.scandir(root) as entries:
                for entry in entries:
                    if entry.name not in unwatched and entry.is_dir(follow_symlinks=False):
                        self._watch(entry.name)
        except OSError:
            self.close()  # no half-built watch left registered
            raise
        self.alive = True

    def follow(self, folder: str) -> None:
        """Watch ``folder`` (again); nothing if it is gone or already watched (a folder that
        replaced the watched one under its name is watched instead)."""
        with contextlib.suppress(OSError):  # gone: nothing to watch
            self._watch(folder)

    def release(self, folder: str) -> None:
        """Stop watching ``folder`` (and the folders of its inputs)."""
        with self.lock:
            inputs = self.input_wds.pop(folder, {})
            for input_wd in inputs.values():
                self.inputs.pop(input_wd, None)
                self.inodes.pop(input_wd, None)
            gone = list(inputs.values())
            wd = self.wds.pop(folder, None)
            if wd is not None:
                self.folders.pop(wd, None)
                self.inodes.pop(wd, None)
                gone.append(wd)
            self.fd.remove_callbacks([(w, self.id) for w in gone])

    def watch_inputs(self, folder: str, inside: Collection[str]) -> None:
        """Watch the folders ``inside`` (relative, below the batch folder) that ``folder``'s
        inputs land in; one missing or a link is left to the checks' schedule."""
        for sub in sorted(inside)[:MAX_INPUT_WATCHES]:
            path = os.path.join(os.fsencode(self.root), os.fsencode(folder), os.fsencode(sub))
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            inode = (st.st_dev, st.st_ino)
            with self.lock:
                known = folder not in self.wds or sub in self.input_wds.get(folder, {})
                if known or not stat.S_ISDIR(st.st_mode) or inode in self.inodes.values():
                    continue  # (a folder watched already: a second callback would replace it)
                try:
                    wd = self.fd.add_callback(path, self.FOLDER_MASK, self, self.id)  # type: ignore[arg-type]
                except OSError:
                    continue
                self.inputs[wd] = folder
                self.inodes[wd] = inode
                self.input_wds.setdefault(folder, {})[sub] = wd

    def take_landed(self) -> set[str]:
        """The batch folders where inputs landed since the last call."""
        with self.lock:
            landed, self.landed = self.landed, set()
        return landed

    def watching(self) -> frozenset[str]:
        with self.lock:
            return frozenset(self.wds)

    def _watch(self, folder: str) -> None:
        """Watch ``folder``, or renew its watch if the name now leads to another folder than
        the one watched (moved away and replaced): inotify watches an inode, not a name."""
        path = os.path.join(os.fsencode(self.root), os.fsencode(folder))
        st = os.stat(path, follow_symlinks=False)
        inode = (st.st_dev, st.st_ino)
        with self.lock:
            old = self.wds.get(folder)
            if old is not None and self.inodes.get(old) == inode:
                return
            wd = self.fd.add_callback(path, self.FOLDER_MASK, self, self.id)  # type: ignore[arg-type]
            if old is not None and old != wd:
                self.folders.pop(old, None)
                self.inodes.pop(old, None)
                self.fd.remove_callbacks([(old, self.id)])
            self.folders[wd] = folder
            self.wds[folder] = wd
            self.inodes[wd] = inode

    def on_event(self, event: InotifyEvent) -> None:
        if event.wd == self.root_wd:
            self._root_event(event)
            return
        with self.lock:
            folder = self.folders.get(event.wd)
            inputs_of = self.inputs.get(event.wd)
            if event.name not in _NOT_INPUTS and (folder or inputs_of):
                self.landed.add(folder or inputs_of or "")
        if folder is not None and event.name == MANIFEST_NAME.encode():
            self.events.put(FolderTouched(self.root, folder))

    def _root_event(self, event: InotifyEvent) -> None:
        if event.is_delete_self or event.is_move_self:
            self.alive = False
            self.events.put(RootLost(self.root))
            return
        if not event.is_directory or not event.name:
            return
        folder = os.fsdecode(event.name)
        try:
            self._watch(folder)
        except OSError:
            return  # gone again already
        # The manifest may have been written before the watch was in place: look once.
        self.events.put(FolderTouched(self.root, folder))

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        with self.lock:
            folder = self.folders.pop(wd, None)
            self.inodes.pop(wd, None)
            if folder is not None and self.wds.get(folder) == wd:
                del self.wds[folder]
            inputs_of = self.inputs.pop(wd, None)
            if inputs_of is not None:
                subs = self.input_wds.get(inputs_of, {})
                for sub in [s for s, w in subs.items() if w == wd]:
                    del subs[sub]
        if wd == self.root_wd and self.alive:
            self.alive = False
            self.events.put(RootLost(self.root))

    def on_queue_overflow(self) -> None:
        # Events were dropped: a scan of the root finds what they would have said. This runs
        # on watchdog's reader thread, which must not die: a root that fails is reported lost.
        try:
            for seen in scan_root(self.root):
                self.events.put(FolderTouched(self.root, seen.folder))
        except OSError:
            self.alive = False
            self.events.put(RootLost(self.root))

    def close(self) -> None:
        with self.lock:
            wds = [*self.folders, *self.inputs, *([] if self.root_wd is None else [self.root_wd])]
            self.folders.clear()
            self.wds.clear()
            self.inodes.clear()
            self.inputs.clear()
            self.input_wds.clear()
            self.fd.remove_callbacks([(wd, self.id) for wd in wds])


class ManifestListing:
    """A listdir for watchdog's polling observer that lists the root's folders and, inside
    each, only the manifest: a poll costs a few stats per batch, however many images.

    The folders of ended batches are left out (:meth:`release`), as the inotify watches leave
    them: a poll costs a few stats per folder without a manifest or with a batch under way,
    not per folder ever dropped; a manifest changed in a folder left out is found by the
    catch-up scan. The set is swapped whole, never changed in place: the observer's thread
    reads it while the service's thread sets it."""

    def __init__(self, root: Path, released: Collection[str] = ()) -> None:
        self.root = os.fspath(root)
        self.released = frozenset(released)

    def release(self, folder: str) -> None:
        self.released = self.released | {folder}

    def follow(self, folder: str) -> None:
        self.released = self.released - {folder}

    def __call__(self, path: str | None) -> Iterator[os.DirEntry[str]]:
        if path is None or os.path.normpath(path) == self.root:
            released = self.released
            with os.scandir(self.root) as entries:
                yield from [
                    e for e in entries if e.name not in released and e.is_dir(follow_symlinks=False)
                ]
            return
        if os.path.lexists(os.path.join(path, MANIFEST_NAME)):
            yield _Named(MANIFEST_NAME)  # type: ignore[misc]


@dataclass(frozen=True)
class _Named:
    name: str


class _PollingHandler(FileSystemEventHandler):
    def __init__(self, root: Path, events: queue.Queue[WatchEvent]) -> None:
        self.root, self.events = root, events

    def on_any_event(self, event: FileSystemEvent) -> None:
        for raw in (event.src_path, event.dest_path):
            path = Path(os.fsdecode(raw)) if raw else None
            if path is None:
                continue
            if path == self.root and event.event_type == "deleted":
                self.events.put(RootLost(self.root))
            elif path.parent == self.root and event.is_directory:
                self.events.put(FolderTouched(self.root, path.name))
            elif path.name == MANIFEST_NAME and path.parent.parent == self.root:
                self.events.put(FolderTouched(self.root, path.parent.name))


class Watcher:
    """Watches every drop root in the mode its configuration (or its filesystem) calls for."""

    def __init__(
        self,
        roots: Sequence[RootSection],
        events: queue.Queue[WatchEvent],
        ended: Callable[[Path], Collection[str]] = lambda root: (),
    ) -> None:
        """``ended``: the folders of a root whose batch has ended, not watched when it is armed."""
        self.roots = tuple(roots)
        self.events = events
        self.ended = ended
        self.modes: dict[Path, ObserverMode] = {}
        self._fd: InotifyFD | None = None
        self._inotify: dict[Path, _DepthOneInotify] = {}
        self._polling: dict[Path, BaseObserver] = {}
        self._listings: dict[Path, ManifestListing] = {}

    def start(self, skip: Collection[Path] = ()) -> dict[Path, ObserverMode]:
        """Start watching every root that exists now but those in ``skip`` (another daemon
        holds them); the mode chosen for each."""
        for root in self.roots:
            if root.path not in skip:
                self.arm(root)
        return dict(self.modes)

    def arm(self, root: RootSection) -> bool:
        """(Re)start watching ``root``; False if it cannot be watched now (missing, unreadable).

        inotify that runs out of watches or instances (the kernel's limits) falls back to
        polling for this root, and says so."""
        self._disarm(root.path)
        if root.path not in self.modes:
            self.modes[root.path] = choose_mode(root.observer, filesystem_type(root.path))
        try:
            if self.modes[root.path] is ObserverMode.INOTIFY:
                try:
                    self._arm_inotify(root)
                    return True
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EMFILE):
                        raise
                    log.warning("inotify limit reached; polling this root instead",
                                root=str(root.path), error=str(exc))  # fmt: skip
                    self.modes[root.path] = ObserverMode.POLLING
            self._arm_polling(root)
        except OSError:
            self._disarm(root.path)
            return False
        return True

    def _arm_inotify(self, root: RootSection) -> None:
        if self._fd is None or not self._fd.is_alive():
            self._fd = InotifyFD()
            self._fd.start()
        self._inotify[root.path] = _DepthOneInotify(
            self._fd, root.path, self.events, self.ended(root.path)
        )

    def follow(self, root: Path, folder: str) -> None:
        """Watch a batch folder again: a batch in it is under way."""
        watch = self._inotify.get(root) or self._listings.get(root)
        if watch is not None:
            watch.follow(folder)

    def release(self, root: Path, folder: str) -> None:
        """Stop watching (or polling) a batch folder whose batch has ended; the catch-up scan
        still looks."""
        watch = self._inotify.get(root) or self._listings.get(root)
        if watch is not None:
            watch.release(folder)

    def watch_inputs(self, root: Path, folder: str, inside: Collection[str]) -> None:
        """Watch the folders a waiting batch's inputs land in (inotify roots only)."""
        watch = self._inotify.get(root)
        if watch is not None:
            watch.watch_inputs(folder, inside)

    def arrived(self, root: Path) -> set[str]:
        """The batch folders of ``root`` where inputs landed since the last call (inotify)."""
        watch = self._inotify.get(root)
        return set() if watch is None else watch.take_landed()

    def watched_folders(self, root: Path) -> frozenset[str]:
        """The batch folders of an inotify root watched now (empty for a polled root)."""
        watch = self._inotify.get(root)
        return frozenset() if watch is None else watch.watching()

    def _arm_polling(self, root: RootSection) -> None:
        listing = ManifestListing(root.path, self.ended(root.path))
        observer = PollingObserverVFS(os.stat, listing, polling_interval=root.poll_seconds)
        observer.schedule(
            _PollingHandler(root.path, self.events), os.fspath(root.path), recursive=True
        )
        observer.start()
        self._polling[root.path] = observer
        self._listings[root.path] = listing

    def armed(self, root: Path) -> bool:
        if root in self._inotify:
            reader = self._fd is not None and self._fd.is_alive()
            return reader and self._inotify[root].alive
        observer = self._polling.get(root)
        return observer is not None and all(e.is_alive() for e in observer.emitters)

    def disarm(self, root: Path) -> None:
        """Stop watching ``root`` (another daemon holds it now) until it is armed again."""
        self._disarm(root)
        self.modes.pop(root, None)

    def _disarm(self, root: Path) -> None:
        watch = self._inotify.pop(root, None)
        if watch is not None:
            watch.close()
        self._listings.pop(root, None)
        observer = self._polling.pop(root, None)
        if observer is not None:
            observer.stop()
            observer.join(timeout=5)

    def stop(self) -> None:
        """Stop every observer and join its threads (bounded)."""
        for root in list(self._inotify) + list(self._polling):
            self._disarm(root)
        if self._fd is not None:
            self._fd.stop()
            self._fd.join(timeout=5)
            self._fd = None
