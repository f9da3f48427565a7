"""The device stage of a resident device (:mod:`pipelines.inference.resident`): the job's net
runs in a process that stays on its GPU across jobs, and the job hands it its batches.

The local executor starts one resident device per GPU where ``executor.local.resident_device``
is set, and names its socket to every inference job it starts on that GPU
(:data:`daemon.contract.jobspec.RESIDENT_DEVICE_ENV`). Such a job neither imports torch nor
starts CUDA nor loads the model: the resident device did, once, for the first job of the model,
and decided its precision on that job's first batch
(:func:`pipelines.inference.placement.precision_verdict`; the later jobs' logs, summaries and
reports say which job decided). What a job started on its own spends before its first image
(1–2 s of torch's imports, CUDA's start, the model's load and sha256, the precision's check),
every shard of every batch, is then spent once per model (its warm start imports no torch
either: :data:`daemon.contract.jobspec.RESIDENT_DEVICES_ENV`). Not shared yet: each job's
batch sizing (a probe of one image) and, with ``gpu_compile``, its compiled forward, built and
checked per job as before.

:class:`RemoteDevice` is what :class:`pipelines.inference.stages.Stages` and the slides drive,
as they drive :class:`pipelines.inference.device.DeviceStage`: ``batch_size``, ``submit``,
``done``, ``busy``, ``probabilities``, ``precision``, ``where``, ``summary``. A batch crosses in
shared memory (:class:`pipelines.inference.slabs.Slab`: an anonymous file, its descriptor sent
once over the socket; nothing is named): the job writes the images into one of its
:data:`IN_FLIGHT` transfer slabs and sends one small message; the resident device writes the
masks and confidences back into the same slab and says so. Up to :data:`IN_FLIGHT` batches are
on their way at once, as on a GPU of the job's own.

A resident device that cannot be reached when the job starts (not started yet, ended, its
socket gone) leaves the job to its own device, as before, and the log says why. One that ends
during the job (:class:`ResidentLost`: the daemon stopped or restarted, which ends it) leaves
the job to go on with a device of its own: torch imported, the model loaded, the precision
decided anew, the batches that were on their way given to it again; its log and summary say
so.

This module imports no torch: the job's main process that uses it never does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from daemon.contract.jobspec import RESIDENT_DEVICE_ENV
from models.catalog import ModelError, ModelVersion
from pipelines.inference.masks import Rules
from pipelines.inference.placement import IN_FLIGHT, Placement
from pipelines.inference.slabs import Slab, aligned

log = logging.getLogger("pipelines")
MAX_MESSAGE = 1 << 16  # a message is a small JSON object: every pixel crosses in a slab
CONNECT_SECONDS = 5.0  # for a resident device started with the job to listen
HELLO_SECONDS = 120.0  # for the answer to the first message: the model may be loading
ANSWER_SECONDS = 600.0  # for any other answer (a batch of large images on a busy GPU)
HELLO, RUN, SIZE, PROBABILITIES, SUMMARY = "hello", "run", "size", "probabilities", "summary"
Result = tuple[Any, np.ndarray, np.ndarray]  # as pipelines.inference.device.Result


class ResidentLost(RuntimeError):
    """The resident device ended, or broke the protocol, during the job."""


def slot_layout(count: int, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Where a batch of ``count`` images of ``shape`` lies in a transfer slab: its float32
    pixels at 0, then (offsets returned) its uint8 masks, its float64 confidences, and the
    bytes in all."""
    pixels = count * math.prod(shape)
    masks_at = aligned(4 * pixels)
    confidences_at = aligned(masks_at + pixels)
    return masks_at, confidences_at, confidences_at + 8 * count


def send(channel: socket.socket, message: Mapping[str, Any], fd: int | None = None) -> None:
    data = json.dumps(message).encode()
    if fd is None:
        channel.sendall(data)
    else:
        socket.send_fds(channel, [data], [fd])


def receive(
    channel: socket.socket, timeout: float | None
) -> tuple[dict[str, Any] | None, int | None]:
    """The next message and the descriptor it carried (None: it carried none); (None, None)
    at the end of the connection. TimeoutError when none came in ``timeout`` seconds."""
    if timeout is not None and not select.select([channel], [], [], timeout)[0]:
        raise TimeoutError(f"no answer in {timeout:.0f} s")
    data, fds, flags, _ = socket.recv_fds(channel, MAX_MESSAGE, 1, socket.MSG_CMSG_CLOEXEC)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            socket.close(fd)
        raise ValueError(f"a message longer than {MAX_MESSAGE} bytes")
    if not data:
        for fd in fds:
            socket.close(fd)
        return None, None
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("a message is a JSON object")
    return message, fds[0] if fds else None


def address(environ: Mapping[str, str]) -> str | None:
    """The socket of the resident device named to this job, if any."""
    return environ.get(RESIDENT_DEVICE_ENV) or None


def connect(
    path: str, job: str, registry: str, version: ModelVersion, params: Mapping[str, Any],
    gpus: int, rules: Rules, own: Callable[[], Any],
) -> RemoteDevice | None:  # fmt: skip
    """The resident device at ``path`` with ``version``'s model loaded for this job's
    ``params``, or None where it cannot be reached (the job runs its own; the log says why).
    ``own`` makes the job's own device stage, should the resident device end during the job.
    ModelError: it cannot load that model (as the job's own load would have said)."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    hello = {"op": HELLO, "job": job, "registry": registry,
             "model": version.name, "version": version.version, "sha256": version.sha256,
             "params": dict(params), "gpus": gpus, "min_area": rules.min_area,
             "split_neck": rules.split_neck}  # fmt: skip
    started = time.monotonic()
    try:
        _connect(channel, path)
        send(channel, hello)
        said, _ = receive(channel, HELLO_SECONDS)
    except (OSError, ValueError) as exc:  # TimeoutError is an OSError
        channel.close()
        log.warning("resident device %s not reached (%s): this job runs its own", path, exc)
        return None
    if said is None or "error" in said:
        channel.close()
        error = "it closed the connection" if said is None else said["error"]
        if said is not None and said.get("kind") == "model":
            raise ModelError(error)
        log.warning("resident device %s refused this job (%s): it runs its own", path, error)
        return None
    device = RemoteDevice(channel, said, own)
    log.info("resident device %s (pid %s) on %s, answered in %.2f s: %s; model %s",
             path, said["pid"], said["device"], time.monotonic() - started, said["reason"],
             "already loaded" if said["model_was_loaded"] else "loaded for this job")  # fmt: skip
    if said["decided_by"]:
        log.info("precision: %s, as decided on the first batch of job %s", said["precision"],
                 said["decided_by"])  # fmt: skip
    return device


def _connect(channel: socket.socket, path: str) -> None:
    """Connect, waiting up to :data:`CONNECT_SECONDS` for a resident device just started to
    listen (its socket not there yet, or an ended one's still there)."""
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            channel.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class RemoteDevice:
    """The device stage of a resident device (see the module's docstring)."""

    def __init__(
        self, channel: socket.socket, said: Mapping[str, Any], own: Callable[[], Any]
    ) -> None:
        self.channel, self.make_own = channel, own
        self.own: Any = None  # the job's own device stage, once the resident device ended
        self.placement = Placement(str(said["device"]), int(said["batch_size"]),
                               bool(said["mixed_precision"]), str(said["reason"]),
                               str(said["compile"]))  # fmt: skip
        self.hello = dict(said)  # what it said to the job's hello
        self.said: dict[str, Any] = {}  # its last summary of the job's device
        self.slabs = [Slab.make() for _ in range(IN_FLIGHT + 1)]  # the last: a slide's windows
        self.shared = [False] * len(self.slabs)  # its descriptor sent
        self.free = deque(range(IN_FLIGHT))
        self.in_flight: deque[tuple[int, int, Any, int, tuple[int, ...]]] = deque()
        self.landed: set[int] = set()  # batches whose masks are back (their numbers)
        self.answers: deque[dict[str, Any]] = deque()  # other answers read meanwhile
        self.ready: deque[Result] = deque()  # results copied out of a slab that was needed
        self.sizes: dict[tuple[int, ...], int] = {}
        self.sent = 0

    # -- the messages --------------------------------------------------------------------
    def _send(self, message: dict[str, Any], slab: int | None = None) -> None:
        fd = None
        if slab is not None:
            message = {**message, "slab": slab, "bytes": self.slabs[slab].size}
            if not self.shared[slab]:
                fd, self.shared[slab] = self.slabs[slab].fd, True
        try:
            send(self.channel, message, fd)
        except OSError as exc:
            raise ResidentLost(f"the resident device cannot be reached: {exc}") from exc

    def _read(self, timeout: float | None) -> bool:
        """Read one message (waiting up to ``timeout``; 0: only one already there): a batch's
        masks back are noted, other answers queued; whether one was read."""
        try:
            said, fd = receive(self.channel, timeout)
        except TimeoutError:
            if timeout == 0:
                return False
            raise ResidentLost(f"the resident device did not answer in {timeout:.0f} s") from None
        except (OSError, ValueError) as exc:
            raise ResidentLost(f"the resident device's answer cannot be read: {exc}") from exc
        if fd is not None:
            socket.close(fd)
        if said is None:
            raise ResidentLost("the resident device ended during the job")
        if "error" in said:
            raise ResidentLost(f"the resident device failed: {said['error']}")
        if "summary" in said:  # the precision decided on a first batch, and the checks
            self.said = said["summary"]
        if "done" in said:
            self.landed.add(int(said["done"]))
        else:
            self.answers.append(said)
        return True

    def _answer(self, message: dict[str, Any], slab: int | None = None) -> dict[str, Any]:
        """Send ``message`` and wait for its answer (batches' masks back meanwhile noted)."""
        self._send(message, slab)
        while not self.answers:
            self._read(ANSWER_SECONDS)
        return self.answers.popleft()

    def _go_own(self, lost: ResidentLost) -> None:
        """The resident device ended (a daemon's restart ends it): the job goes on with a
        device stage of its own (torch imported, the model loaded, the precision decided
        anew), the batches on their way given to it again, in order, from their slabs."""
        log.warning("%s: this job goes on with its own net", lost)
        self.channel.close()
        self.own = self.make_own()
        self.sizes.clear()  # the job's own device sizes its batches (and compiles them) itself
        for slab_index, _, tag, count, shape in self.in_flight:
            pixels = self.slabs[slab_index].pixels(0, (count, *shape))
            self.own.submit(list(pixels.copy()), tag)
        self.in_flight.clear()

    def _or_own(self, work: Callable[[], Any]) -> Any:
        if self.own is None:
            try:
                return work()
            except ResidentLost as lost:
                self._go_own(lost)
        return None

    # -- what the stages drive -----------------------------------------------------------
    def batch_size(self, shape: tuple[int, ...]) -> int:
        if shape not in self.sizes:
            size = self._or_own(lambda: self._answer({"op": SIZE, "shape": list(shape)}))
            if self.own is not None:
                return int(self.own.batch_size(shape))
            self.sizes[shape] = int(size["size"])
        return self.sizes[shape]

    @property
    def where(self) -> Placement:
        return self.own.where if self.own is not None else self.placement

    @property
    def precision(self) -> str:
        if self.own is not None:
            return str(self.own.precision)
        return str((self.said or self.hello)["precision"])  # its last word

    def submit(self, images: list[np.ndarray], tag: Any) -> None:
        """Hand the resident device ``images`` (one shape); the result comes from
        :meth:`done`."""
        if self.own is None:
            sent = self.sent
            try:
                self._submit(images, tag)
                return
            except ResidentLost as lost:
                self._go_own(lost)
            if self.sent > sent:  # it was on its way: given to the job's own again
                return
        self.own.submit(images, tag)

    def _submit(self, images: list[np.ndarray], tag: Any) -> None:
        if not self.free:
            self._set_aside()
        slab_index = self.free.popleft()
        slab = self.slabs[slab_index]
        count, shape = len(images), tuple(images[0].shape)
        slab.grow(slot_layout(count, shape)[2])
        pixels = slab.pixels(0, (count, *shape))
        for k, image in enumerate(images):
            pixels[k] = image
        number, self.sent = self.sent, self.sent + 1
        self.in_flight.append((slab_index, number, tag, count, shape))
        self._send({"op": RUN, "number": number, "count": count, "shape": list(shape)},
                   slab_index)  # fmt: skip

    def _result(self, slab_index: int, tag: Any, count: int, shape: tuple[int, ...]) -> Result:
        """A batch back: views of its masks and confidences in its slab (valid until the slab
        takes another batch); the slab is free again."""
        masks_at, confidences_at, _ = slot_layout(count, shape)
        slab = self.slabs[slab_index]
        masks = slab.mask(masks_at, (count, *shape))
        confidences = np.frombuffer(slab.map, np.float64, count, confidences_at)
        self.free.append(slab_index)
        return tag, masks, confidences

    def _set_aside(self) -> None:
        """The oldest batch on its way, waited for and copied out of its slab, which the next
        batch needs."""
        slab_index, number, tag, count, shape = self.in_flight[0]
        while number not in self.landed:
            self._read(ANSWER_SECONDS)
        self.in_flight.popleft()
        self.landed.discard(number)
        _, masks, confidences = self._result(slab_index, tag, count, shape)
        self.ready.append((tag, masks.copy(), confidences.copy()))

    def done(self, wait: bool = False) -> list[Result]:
        """The results back, in the order submitted; ``wait``: at least one if any is on its
        way. A result's arrays are valid until the next :meth:`submit`."""
        found = list(self.ready)
        self.ready.clear()
        if self.own is None:
            try:
                return self._done(found, wait)
            except ResidentLost as lost:
                self._go_own(lost)
        return found + self.own.done(wait and not found)

    def _done(self, found: list[Result], wait: bool) -> list[Result]:
        while self._read(0):
            pass
        while self.in_flight:
            slab_index, number, tag, count, shape = self.in_flight[0]
            if number not in self.landed:
                if not wait or found:
                    break
                self._read(ANSWER_SECONDS)
                continue
            self.in_flight.popleft()
            self.landed.discard(number)
            found.append(self._result(slab_index, tag, count, shape))
        return found

    @property
    def busy(self) -> bool:
        own = self.own is not None and self.own.busy
        return bool(self.in_flight or self.ready or own)

    def probabilities(self, tiles: np.ndarray) -> np.ndarray:
        """Sigmoid probabilities (N, h, w) of windows (N, h, w), at once (they are blended)."""
        found = self._or_own(lambda: self._probabilities(tiles))
        return found if self.own is None else self.own.probabilities(tiles)

    def _probabilities(self, tiles: np.ndarray) -> np.ndarray:
        count, shape = len(tiles), tuple(tiles.shape[1:])
        slab_index = IN_FLIGHT
        slab = self.slabs[slab_index]
        slab.grow(4 * count * math.prod(shape))
        slab.pixels(0, (count, *shape))[...] = tiles
        self._answer({"op": PROBABILITIES, "count": count, "shape": list(shape)}, slab_index)
        return slab.pixels(0, (count, *shape)).copy()

    def summary(self) -> dict[str, Any]:
        """The precision decision and the resident device's word, for the job's result (or,
        once it ended during the job, the job's own device's, and the word that it ended)."""
        if self.own is not None:
            return {**self.own.summary(), "resident": {"ended_during_the_job": True}}
        if not self.said:  # no batch went through it (every image done before, or a problem)
            with contextlib.suppress(ResidentLost):
                self.said = self._answer({"op": SUMMARY})["summary"]
        return self.said or {"device": self.where.device, "precision": self.precision,
                             "checks": [], "compile": self.where.compile, "compile_checks": [],
                             "resident": {"pid": self.hello["pid"],
                                          "decided_by": self.hello["decided_by"],
                                          "ended_before_the_summary": True}}  # fmt: skip

    def close(self) -> None:
        self.channel.close()
        for slab in self.slabs:
            with contextlib.suppress(OSError):
                slab.close()
