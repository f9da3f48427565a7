"""A resident device: one process that keeps the inference net on its GPU across jobs.

``python -m pipelines.inference.resident SOCKET``, started by the local executor, one per GPU
(``executor.local.resident_device``, :mod:`daemon.executors.resident`), with that GPU alone
visible. It listens on SOCKET (in a folder of the service's own), imports torch once, and
serves every inference job that connects (:mod:`pipelines.inference.remote`, the job's side),
each in a thread of its own with a :class:`pipelines.inference.device.DeviceStage` of its own
(its stream, its pinned buffers, its batch sizes), while what is costly is kept for all:

- CUDA's start and torch's imports, once per process;
- each model's weights, read, checked (sha256) and on the GPU once, for every job of it (the
  last :data:`MAX_MODELS` models used);
- the precision, decided on the first batch of the first job of a model and its parameters
  (threshold, object rules, the precisions allowed) and then used by every later job of them:
  their logs, summaries and reports name the job that decided, and its measured agreement.

The net's launches (and the global TF32 switch they read) are made under one lock, so two jobs'
batches interleave on the GPU whole; the copies back and the waits are each job's own.

The process ends at the end of file on its standard input (the daemon stopped, or is gone: it
holds the other end) or at SIGTERM; its log lines go where the daemon's go. A job that was
using it then goes on with a net of its own (:mod:`pipelines.inference.remote`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from models import catalog
from models.catalog import ModelError
from pipelines.inference.masks import Rules
from pipelines.inference.placement import choose_device
from pipelines.inference.remote import (
    HELLO,
    PROBABILITIES,
    RUN,
    SIZE,
    SUMMARY,
    receive,
    send,
    slot_layout,
)
from pipelines.inference.slabs import Slab

log = logging.getLogger("resident")
MAX_MODELS = 4  # kept on the GPU, the last used
USAGE = "usage: python -m pipelines.inference.resident SOCKET"


class Resident:
    """What the jobs served share: the models on the device and the precisions decided."""

    def __init__(self, device: ModuleType) -> None:
        self.device = device  # pipelines.inference.device (torch), imported once bound
        self.lock = threading.Lock()
        # by sha256 and device, the last used last
        self.nets: OrderedDict[tuple[str, str], Any] = OrderedDict()
        # by model and parameters: (precision, its checks, the job whose first batch decided)
        self.decided: dict[tuple[Any, ...], tuple[str, list[Any], str]] = {}
        self.loading: dict[tuple[str, str], threading.Lock] = {}  # by model: held while it loads
        self.jobs = 0

    def stage(self, hello: dict[str, Any]) -> tuple[Any, dict[str, Any], tuple[Any, ...]]:
        """The device stage of a job that said ``hello``, what is said back, and the key of its
        precision decision. ModelError: its model cannot be loaded."""
        version = catalog.resolve(Path(hello["registry"]), str(hello["model"]),
                                  str(hello["version"]))  # fmt: skip
        if version.sha256 != hello["sha256"]:
            raise ModelError(
                f"model {version.name!r} version {version.version} changed since the job "
                f"resolved it (sha256 now {version.sha256[:12]}…)"
            )
        params = hello["params"]
        rules = Rules(int(hello["min_area"]), float(hello["split_neck"]), fsync_each=False)
        torch = self.device.torch
        with self.lock:
            cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
            where = choose_device(int(hello["gpus"]), os.environ, cuda, params)
            model = (version.sha256, where.device)  # a job given no GPU: its net on the CPU
            loading = self.loading.setdefault(model, threading.Lock())
        with loading:  # one load of a model at a time, beside the other jobs' batches
            with self.lock:
                net = self.nets.get(model)
            loaded = net is not None
            if net is None:
                net = self.device.load_model(version).to(where.device)
        with self.lock:
            self.nets[model] = net
            self.nets.move_to_end(model)
            while len(self.nets) > MAX_MODELS:
                self.nets.popitem(last=False)
            stage = self.device.DeviceStage(net, where, float(params["threshold"]), rules)
            key = (version.sha256, where.device, float(params["threshold"]), rules.min_area,
                   rules.split_neck, where.candidates())  # fmt: skip
            decided_by = ""
            if where.cuda and key in self.decided:
                stage.precision, verdicts, decided_by = self.decided[key]
                stage.verdicts, stage.checked = list(verdicts), True
            self.jobs += 1
        said = {"pid": os.getpid(), "device": where.device, "batch_size": where.batch_size,
                "mixed_precision": where.mixed_precision, "reason": where.reason,
                "compile": where.compile, "precision": stage.precision,
                "decided_by": decided_by, "model_was_loaded": loaded}  # fmt: skip
        log.info("job %s: model %s version %d (%s) on %s", hello["job"], version.name,
                 version.version, "kept" if loaded else "loaded", where.device)  # fmt: skip
        return stage, said, key

    def note(self, stage: Any, key: tuple[Any, ...], job: str) -> None:
        """Keep the precision ``stage`` decided on its first batch for the jobs after it."""
        if stage.where.cuda and stage.checked and key not in self.decided:
            self.decided[key] = (stage.precision, list(stage.verdicts), job)
            log.info("job %s decided the precision: %s", job, stage.precision)

    def serve(self, channel: socket.socket) -> None:
        """One job's connection, to its end; then the GPU memory torch keeps cached for reuse
        goes back to the GPU (:meth:`give_back_memory`)."""
        try:
            self._serve(channel)
        finally:  # (the job's stage gone with _serve's frame)
            self.give_back_memory()

    def give_back_memory(self) -> None:
        """Hand the device memory that torch's allocator keeps cached, the ended jobs' batches'
        and evicted models', back to the GPU. The executor's seats count this GPU free for
        the jobs it starts next (a training, a job with a net of its own); a resident device
        that kept its peak would leave them that much less, for as long as the daemon runs."""
        torch = self.device.torch
        if torch.cuda.is_initialized():
            with self.lock:
                torch.cuda.empty_cache()

    def _serve(self, channel: socket.socket) -> None:
        job = "?"
        slabs: dict[int, Slab] = {}
        try:
            hello, _ = receive(channel, None)
            if hello is None or hello.get("op") != HELLO:
                return
            job = str(hello.get("job", "?"))
            try:
                stage, said, key = self.stage(hello)
            except ModelError as exc:
                send(channel, {"error": str(exc), "kind": "model"})
                return
            send(channel, said)
            Connection(self, stage, key, job, channel, slabs, said).run()
        except Exception as exc:  # a job's failure is its own: the others go on ...
            log.exception("job %s: failed", job)
            with contextlib.suppress(OSError):
                send(channel, {"error": f"{type(exc).__name__}: {exc}"})
            if _broken(exc):  # ... but not CUDA's own: the executor starts another process
                log.error("CUDA failed: this resident device ends")
                os._exit(1)
        finally:
            channel.close()
            for slab in slabs.values():
                with contextlib.suppress(OSError):
                    slab.close()


class Connection:
    """One job's requests, in order; its batches' results sent back as they land."""

    def __init__(
        self, resident: Resident, stage: Any, key: tuple[Any, ...], job: str,
        channel: socket.socket, slabs: dict[int, Slab], said: dict[str, Any],
    ) -> None:  # fmt: skip
        self.resident, self.stage, self.key, self.job = resident, stage, key, job
        self.channel, self.slabs, self.said = channel, slabs, said
        self.sent: dict[str, Any] = {}  # the summary the job has

    def run(self) -> None:
        while True:
            if self.stage.busy and not select.select([self.channel], [], [], 0)[0]:
                self._send_back(wait=True)
                continue
            message, fd = receive(self.channel, None)
            if message is None:
                return
            if "slab" in message:
                self._slab(int(message["slab"]), int(message["bytes"]), fd)
            op = message.get("op")
            if op == RUN:
                self._run(message)
            elif op == SIZE:
                with self.resident.lock:
                    size = self.stage.batch_size(tuple(message["shape"]))
                send(self.channel, {"size": size})
            elif op == PROBABILITIES:
                self._probabilities(message)
            elif op == SUMMARY:
                send(self.channel, {"summary": self._summary()})
            else:
                raise ValueError(f"no such request: {op!r}")

    def _slab(self, index: int, size: int, fd: int | None) -> None:
        """The job's transfer slab ``index``, mapped (its descriptor comes with its first use)
        or mapped again at ``size`` (the job enlarged it)."""
        if fd is not None:
            old = self.slabs.pop(index, None)
            if old is not None:
                old.close()
            self.slabs[index] = Slab(fd, size)
        else:
            self.slabs[index].follow(size)

    def _run(self, message: dict[str, Any]) -> None:
        count, shape = int(message["count"]), tuple(message["shape"])
        slab_index = int(message["slab"])
        pixels = self.slabs[slab_index].pixels(0, (count, *shape))
        with self.resident.lock:
            self.stage.submit(list(pixels), (int(message["number"]), slab_index, count, shape))
            self.resident.note(self.stage, self.key, self.job)
        self._send_back(wait=False)

    def _send_back(self, wait: bool) -> None:
        """The masks and confidences of the batches that landed, into their slabs, and their
        word to the job."""
        for (number, slab_index, count, shape), masks, confidences in self.stage.done(wait):
            masks_at, confidences_at, _ = slot_layout(count, shape)
            slab = self.slabs[slab_index]
            slab.mask(masks_at, (count, *shape))[...] = masks
            np.frombuffer(slab.map, np.float64, count, confidences_at)[...] = confidences
            send(self.channel, {"done": number, **self._summary_if_new()})

    def _probabilities(self, message: dict[str, Any]) -> None:
        count, shape = int(message["count"]), tuple(message["shape"])
        windows = self.slabs[int(message["slab"])].pixels(0, (count, *shape))
        with self.resident.lock:
            found = self.stage.probabilities(windows)
            self.resident.note(self.stage, self.key, self.job)
        windows[...] = found
        send(self.channel, {"probabilities": count, **self._summary_if_new()})

    def _summary_if_new(self) -> dict[str, Any]:
        """The summary, where it changed since the job last had it (a precision decided, a
        size compiled)."""
        summary = self._summary()
        if summary == self.sent:
            return {}
        self.sent = summary
        return {"summary": summary}

    def _summary(self) -> dict[str, Any]:
        """The job's device summary (its precision, the checks that decided it), as the job's
        result has it, with the resident device's word: sent with every batch back, so that
        the job has it should this process end before the job does."""
        word = {"pid": self.said["pid"], "jobs_served": self.resident.jobs,
                "model_was_loaded": self.said["model_was_loaded"],
                "decided_by": self.said["decided_by"]}  # fmt: skip
        return {**self.stage.summary(), "resident": word}


def _broken(exc: BaseException) -> bool:
    """Whether ``exc`` left the process's CUDA context unusable (an illegal address, an ECC
    error: every later job would fail), as a small operation on the GPU then fails too; not a
    memory shortage, which the next jobs may not meet. Any of torch's errors (RuntimeError)
    is looked at so: after such a fault the next call may fail in cuDNN's or cuBLAS's own words
    (CUDNN_STATUS_EXECUTION_FAILED), which name no CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(exc, RuntimeError) or not torch.cuda.is_initialized():
        return False
    try:
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:  # any failure: the context is gone
        return True
    return False


def _end_with_input() -> None:
    """End the process at the end of file on its standard input: the daemon that holds the
    other end stopped, or is gone."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os._exit(0)

    threading.Thread(target=watch, name="stdin", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        sys.exit(USAGE)
    said = f"%(asctime)s resident device {os.getpid()}: %(message)s"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=said)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args[0])
    listener.bind(args[0])
    listener.listen(64)  # bound before torch's imports: a job that comes meanwhile waits
    _end_with_input()
    from pipelines.inference import device
    from pipelines.job import settle_collector

    # imported with the collector off (python -m pipelines...): what was made is frozen, and a
    # process that lives as long as the daemon collects its garbage from now on
    frozen = settle_collector()
    resident = Resident(device)
    log.info("listening on %s, torch imported, %d objects frozen", args[0], frozen)
    while True:
        channel, _ = listener.accept()
        threading.Thread(target=resident.serve, args=(channel,), daemon=True).start()


if __name__ == "__main__":
    main()
