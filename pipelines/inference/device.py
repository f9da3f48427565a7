"""The device stage: the net, on the CPU or on the GPU the job was given
(:mod:`pipelines.inference.placement`), from decoded images to masks.

Whole images go in batches of one size; what comes back per image is its mask (the sigmoid
probability above ``threshold``, as 0/1 bytes) and its confidence (the mean of |2p − 1|): the
probabilities never leave the device. On the CPU the net runs in this process's threads
(channels-last, inference mode: what measured fastest) and the mask and confidence are taken
from the probabilities with numpy, exactly as the job always did: the CPU's masks do not change.

On a GPU the stage never waits for its results: a batch is gathered into a pinned host buffer
(reused, one of :data:`IN_FLIGHT`), copied to the GPU asynchronously on a stream of its own, run,
thresholded and reduced there, and its masks and confidences copied back asynchronously into
pinned buffers; :meth:`DeviceStage.done` hands over those whose copies have landed, and waits
only when asked to (the main process has nothing else to do). The first batch decides the
precision (:func:`pipelines.inference.placement.precision_verdict`) and the batch size
follows the GPU's free memory (:func:`pipelines.inference.placement.sized_batch`).

With ``gpu_compile`` (:func:`pipelines.inference.placement.compile_plan`), a GPU's full batches
of one size run through :func:`fast_forward` (torch.compile, or a CUDA graph captured once per
size), once the first of them gives masks that agree with full precision's eager ones under the
precision rule (:func:`pipelines.inference.placement.precision_verdict`); if it does not, or the
compiler fails, that size runs eager, and the log says why. Smaller batches run eager. A process
compiles one graph per size, precision and model; past torch's limit on them (8: a resident
device that serves many jobs reaches it) torch would run the rest eager without a word, so here
it raises instead, and that size runs eager under its own name, with the log and the summary
saying so.

Windows of a slide take :meth:`DeviceStage.probabilities` instead: they are blended, so their
probabilities come back whole.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from models import registry
from models.registry import ModelError, ModelVersion
from models.unet import UNet
from pipelines.inference.masks import Rules
from pipelines.inference.placement import (
    BFLOAT,
    EAGER,
    FULL,
    HALF,
    IN_FLIGHT,
    TF32,
    Placement,
    Verdict,
    compile_plan,
    decided,
    precision_verdict,
    sized_batch,
)

log = logging.getLogger("pipelines")
Result = tuple[Any, np.ndarray, np.ndarray]  # (tag, masks (N, H, W) uint8 0/1, confidences)
Forward = Callable[[torch.Tensor], torch.Tensor]  # a batch (N, 1, H, W) → probabilities (N, H, W)


def load_model(version: ModelVersion) -> UNet:
    """Build ``version``'s model from its weights (read and their sha256 checked), ready for
    inference."""
    state = registry.load(version)
    try:
        net = UNet(**version.architecture)
        net.load_state_dict(state)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ModelError(
            f"model {version.name!r} version {version.version}: the weights do not fit the "
            f"architecture in its metadata {version.architecture} ({exc})"
        ) from exc
    net.eval()
    net.to(memory_format=torch.channels_last)  # (a module's .to works in place)
    return net


def _fp32_math(tf32: bool) -> None:
    """Let cuDNN and cuBLAS use TF32 for float32 work, or hold them to IEEE fp32."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):  # torch 2.9 and later
        conv.fp32_precision = "tf32" if tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32


_AUTOCAST = {HALF: torch.float16, BFLOAT: torch.bfloat16}


def _bf16_native() -> bool:
    """Whether the GPU computes in bfloat16 itself (Ampere and later). Before torch 2.4 that is
    what ``is_bf16_supported`` said; since, it also says yes where bfloat16 is only emulated
    (a V100, a T4), and there cuDNN has no bfloat16 convolutions for the net."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch before 2.4: no emulation counted
        return bool(torch.cuda.is_bf16_supported())


def _first_line(exc: BaseException) -> str:
    """What a log line says of ``exc``: its message's first line, or its type's name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _graph_limit(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's refusal to compile one more graph in this process
    (``torch._dynamo.exc.FailOnRecompileLimitHit``, raised as :func:`fast_forward` asks)."""
    return type(exc).__name__ == "FailOnRecompileLimitHit"


def forward(net: torch.nn.Module, images: torch.Tensor, precision: str, cache: bool = True
            ) -> torch.Tensor:  # fmt: skip
    """Sigmoid probabilities (N, H, W) of a batch (N, 1, H, W) on the GPU, the net run under
    ``precision``'s autocast (fp32 and TF32: none; see :func:`_fp32_math`); ``cache``: whether
    autocast keeps its casts of the weights (not inside a CUDA graph's capture)."""
    dtype = _AUTOCAST.get(precision)
    with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None,
                        cache_enabled=cache):  # fmt: skip
        logits = net(images.contiguous(memory_format=torch.channels_last))
    return torch.sigmoid(logits.float())[:, 0]


def fast_forward(net: torch.nn.Module, mode: str, example: torch.Tensor, precision: str) -> Forward:
    """:func:`forward` for batches shaped as ``example`` (on the GPU, on the current stream),
    compiled by torch.compile (``mode`` "compile": inductor's default mode, one shape, no
    dynamic shapes) or captured as a CUDA graph (``mode`` "graphs"; its input and output are
    buffers of its own: a result must be used before the next call). Built and run once on
    ``example`` here, so that the compilation or capture happens now."""
    if mode == "compile":
        # past its limit of graphs per process torch would run the net eager, silently: raise
        # (FailOnRecompileLimitHit), so that the caller says so and runs eager itself
        if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):  # (torch 2.6 on)
            torch._dynamo.config.fail_on_recompile_limit_hit = True
        compiled = torch.compile(net, dynamic=False)
        run: Forward = lambda images: forward(compiled, images, precision)  # noqa: E731
        run(example)
        return run
    static = example.contiguous(memory_format=torch.channels_last).clone()
    for _ in range(3):  # cuDNN and the allocator settle before the capture
        forward(net, static, precision, cache=False)
    torch.cuda.current_stream().synchronize()  # type: ignore[no-untyped-call]
    graph = torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    # thread-local: another job's thread of a resident device may use the GPU meanwhile
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = forward(net, static, precision, cache=False)

    def replay(images: torch.Tensor) -> torch.Tensor:
        static.copy_(images)
        graph.replay()  # type: ignore[no-untyped-call]
        return out

    return replay


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run an elementwise op in this thread alone: on more, torch's OpenMP threads spin for
    milliseconds after it, waiting for more work, on the cores the workers need (a sigmoid of
    a 256² image took 1.5 ms of wall and 1 ms of CPU on two threads, 0.1 ms on one, the
    same values; switching costs 0.1 ms)."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _confidences(probabilities: np.ndarray) -> np.ndarray:
    """The mean of |2p - 1| of each image, as numpy always computed it (in one buffer)."""
    sure = np.empty_like(probabilities[0])
    found = np.empty(len(probabilities))
    for k, image in enumerate(probabilities):
        np.multiply(image, 2, out=sure)
        sure -= 1
        found[k] = float(np.abs(sure, out=sure).mean())
    return found


@dataclass
class _Slot:
    """Pinned host buffers of one GPU batch in flight, and the event that says it is back."""

    images: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    masks: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    confidences: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))
    event: Any = None

    def fit(self, count: int, pixels: int) -> None:
        if self.images.numel() < count * pixels:
            self.images = torch.empty(count * pixels, dtype=torch.float32).pin_memory()
            self.masks = torch.empty(count * pixels, dtype=torch.uint8).pin_memory()
        if self.confidences.numel() < count:
            self.confidences = torch.empty(count, dtype=torch.float64).pin_memory()


def _landed(slot: _Slot, tag: Any, count: int, shape: tuple[int, ...]) -> Result:
    """A batch back from the GPU: views of its masks and confidences in ``slot``'s pinned
    buffers (valid until the slot takes another batch)."""
    masks = slot.masks[: count * math.prod(shape)].numpy().reshape(count, *shape)
    return tag, masks, slot.confidences[:count].numpy()


class DeviceStage:
    """The net on its device: batches of whole images in, (masks, confidences) out."""

    def __init__(self, net: UNet, where: Placement, threshold: float, rules: Rules) -> None:
        self.where, self.threshold, self.rules = where, threshold, rules
        self.net = net.to(where.device)
        self.precision = FULL
        self.verdicts: list[Verdict] = []
        self.checked = not where.cuda  # the precision is decided (on the first batch)
        self.sizes: dict[tuple[int, ...], int] = {}
        self.bytes_per_pixel = 0.0
        self.ready: deque[Result] = deque()
        self.in_flight: deque[tuple[_Slot, Any, int, tuple[int, ...]]] = deque()
        self.compile, said = compile_plan(where)
        log.info("%s", said)
        self.fast: dict[tuple[int, ...], Forward | None] = {}  # by shape; None: eager
        self.compile_checks: list[dict[str, Any]] = []
        if where.cuda:
            self.stream = torch.cuda.Stream(where.device)  # type: ignore[no-untyped-call]
            self.slots = [_Slot() for _ in range(IN_FLIGHT)]
            self.turn = 0

    # -- sizes and precision -------------------------------------------------------------
    def batch_size(self, shape: tuple[int, ...]) -> int:
        """Images of ``shape`` that go through the net at once."""
        if not self.where.cuda:
            return self.where.batch_size
        if shape not in self.sizes:
            if not self.bytes_per_pixel and self.where.batch_size <= 0:
                self.bytes_per_pixel = self._probe(shape)
            # what torch keeps cached for reuse counts as free once given back (a resident
            # device's other jobs and batches leave some: pipelines/inference/resident.py)
            torch.cuda.empty_cache()  # type: ignore[no-untyped-call]
            free, _ = torch.cuda.mem_get_info(self.where.device)
            self.sizes[shape] = size = sized_batch(math.prod(shape), self.bytes_per_pixel,
                                                   free, self.where.batch_size)  # fmt: skip
            log.info("%d image(s) of %s at once on the GPU", size, "×".join(map(str, shape)))
        return self.sizes[shape]

    @torch.inference_mode()
    def _probe(self, shape: tuple[int, ...]) -> float:
        """GPU memory one image of ``shape`` takes through the net, per pixel (in fp32)."""
        torch.cuda.synchronize(self.where.device)
        torch.cuda.reset_peak_memory_stats(self.where.device)
        before = torch.cuda.memory_allocated(self.where.device)
        self._probabilities(torch.zeros((1, 1, *shape), device=self.where.device), FULL)
        torch.cuda.synchronize(self.where.device)
        taken = torch.cuda.max_memory_allocated(self.where.device) - before
        return max(taken, 1) / math.prod(shape)

    def _probabilities(self, images: torch.Tensor, precision: str) -> torch.Tensor:
        """Sigmoid probabilities (N, H, W) of a batch (N, 1, H, W) on the GPU."""
        _fp32_math(precision == TF32)
        return forward(self.net, images, precision)

    def _forward(self, batch: torch.Tensor, count: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Probabilities of a batch in the precision decided: compiled if it is a full batch
        of its size and ``gpu_compile`` is on (and held), eager otherwise."""
        _fp32_math(self.precision == TF32)  # a switch of the process's: another job may use it
        if self.compile == EAGER or count != self.sizes.get(shape):
            return self._probabilities(batch, self.precision)
        if shape not in self.fast:
            self.fast[shape] = self._build(batch, shape)
        run = self.fast[shape]
        if run is not None:
            try:
                return run(batch)
            except Exception as exc:  # torch compiles again where its guards fail (another
                if not _graph_limit(exc):  # job of a resident device, its TF32 switch): ...
                    raise
                self.fast[shape] = None  # ... and at its limit this size runs eager here
                self._not_compiled(count, shape, exc, "eager from now on")
        return self._probabilities(batch, self.precision)

    def _not_compiled(self, count: int, shape: tuple[int, ...], exc: BaseException,
                      then: str) -> None:  # fmt: skip
        """Say in the log and the summary that batches of ``count`` × ``shape`` run eager."""
        size, first = "×".join(map(str, (count, *shape))), _first_line(exc)
        if _graph_limit(exc):
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            first = (f"this process has compiled the net {limit} times, torch's limit" if limit
                     else "this process has compiled the net as often as torch allows")  # fmt: skip
        log.warning("gpu_compile %r failed for %s, %s: %s", self.compile, size, then, first)
        self.compile_checks.append({"shape": size, "kept": False, "error": first})

    def _build(self, batch: torch.Tensor, shape: tuple[int, ...]) -> Forward | None:
        """The compiled forward of batches like ``batch``, if it builds and its masks of this
        batch agree with full precision's eager ones under the precision rule; else None."""
        size, started = "×".join(map(str, (len(batch), *shape))), time.monotonic()
        _fp32_math(self.precision == TF32)
        try:
            run = fast_forward(self.net, self.compile, batch, self.precision)
        except Exception as exc:  # no compiler, a capture refused, torch's limit of graphs
            if not isinstance(exc, RuntimeError) and not _graph_limit(exc):
                raise
            self._not_compiled(len(batch), shape, exc, "eager instead")
            return None
        built = time.monotonic() - started
        full = (self._probabilities(batch, FULL) > self.threshold).cpu().numpy()
        _fp32_math(self.precision == TF32)
        fast = (run(batch) > self.threshold).cpu().numpy()
        verdict = precision_verdict(f"{self.precision} {self.compile}", list(full), list(fast),
                                    self._count)  # fmt: skip
        log.info("gpu_compile for %s, built in %.1f s: %s", size, built, verdict.said())
        self.compile_checks.append({"shape": size, "seconds": round(built, 1),
                                    "agreement": round(verdict.agreement, 6),
                                    "counts_equal": verdict.counts_equal,
                                    "counted_alike": verdict.counted_alike,
                                    "images": verdict.images,
                                    "kept": verdict.accepted})  # fmt: skip
        return run if verdict.accepted else None

    def _decide(self, images: torch.Tensor) -> None:
        """Decide the precision on this first batch: full precision against each candidate."""
        full = (self._probabilities(images, FULL) > self.threshold).cpu().numpy()
        for candidate in self.where.candidates():
            if candidate == BFLOAT and not _bf16_native():
                continue
            try:
                faster = (self._probabilities(images, candidate) > self.threshold).cpu().numpy()
            except torch.cuda.OutOfMemoryError:  # the full precision's own would fail too
                raise
            except RuntimeError as exc:  # no kernels for it on this GPU: not kept
                first = _first_line(exc)
                log.warning("precision %s failed on this GPU, not kept: %s", candidate, first)
                continue
            verdict = precision_verdict(candidate, list(full), list(faster), self._count)
            self.verdicts.append(verdict)
            log.info("precision %s", verdict.said())
            if verdict.accepted:
                break
        self.precision, self.checked = decided(self.verdicts), True
        _fp32_math(self.precision == TF32)
        log.info("precision: %s from now on", self.precision)

    def _count(self, mask: np.ndarray) -> int:
        """The objects the table will count. The finish stage's code (scipy, scikit-image) is
        imported here, for a GPU's first batch only: on the CPU this process never needs it."""
        from pipelines.inference.finish import object_ids

        return int(object_ids(mask, self.rules).max())

    def summary(self) -> dict[str, Any]:
        """The precision decision, for the job's result and the report."""
        checks = [{"precision": v.precision, "agreement": round(v.agreement, 6),
                   "counts_equal": v.counts_equal, "counted_alike": v.counted_alike,
                   "images": v.images, "kept": v.accepted}
                  for v in self.verdicts]  # fmt: skip
        return {
            "device": self.where.device,
            "precision": self.precision,
            "checks": checks,
            "compile": self.compile,
            "compile_checks": self.compile_checks,
        }

    # -- whole images --------------------------------------------------------------------
    @torch.inference_mode()
    def submit(self, images: Sequence[np.ndarray], tag: Any) -> None:
        """Run the net on ``images`` (one shape); its result comes from :meth:`done`."""
        if not self.where.cuda:
            stack = images[0][None] if len(images) == 1 else np.stack(images)
            logits = self.net(torch.from_numpy(stack)[:, None].contiguous(
                memory_format=torch.channels_last))  # fmt: skip
            with _one_thread():
                probabilities = torch.sigmoid(logits)[:, 0].numpy()
            masks = (probabilities > self.threshold).view(np.uint8)
            self.ready.append((tag, masks, _confidences(probabilities)))
            return
        self._submit_gpu(images, tag)

    def _submit_gpu(self, images: Sequence[np.ndarray], tag: Any) -> None:
        if len(self.in_flight) >= IN_FLIGHT:  # the slot to reuse holds a batch not handed over
            self._set_aside()
        slot = self.slots[self.turn]
        self.turn = (self.turn + 1) % IN_FLIGHT
        if slot.event is not None:
            slot.event.synchronize()  # its last batch is back (and was handed over)
        count, shape = len(images), images[0].shape
        pixels = math.prod(shape)
        slot.fit(count, pixels)
        host = slot.images[: count * pixels].numpy().reshape(count, *shape)
        for k, image in enumerate(images):
            host[k] = image
        with torch.cuda.stream(self.stream):
            batch = slot.images[: count * pixels].view(count, 1, *shape)
            batch = batch.to(self.where.device, non_blocking=True)
            if not self.checked:
                self._decide(batch)
            probabilities = self._forward(batch, count, shape)
            masks = (probabilities > self.threshold).to(torch.uint8)
            sure = (2 * probabilities - 1).abs().sum(dim=(1, 2), dtype=torch.float64) / pixels
            slot.masks[: count * pixels].view(count, *shape).copy_(masks, non_blocking=True)
            slot.confidences[:count].copy_(sure, non_blocking=True)
            # blocking: a wait on it sleeps instead of spinning (CUDA's default with more
            # cores than GPUs), leaving the core to the job's workers
            slot.event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            slot.event.record(self.stream)
        self.in_flight.append((slot, tag, count, shape))

    def _set_aside(self) -> None:
        """The oldest batch in flight, waited for and copied out of its pinned buffers into
        :attr:`ready`: its slot is about to take another batch (the main process submitted
        more batches than :data:`IN_FLIGHT` between two :meth:`done`)."""
        flight = self.in_flight.popleft()
        flight[0].event.synchronize()
        tag, masks, confidences = _landed(*flight)
        self.ready.append((tag, masks.copy(), confidences.copy()))

    def done(self, wait: bool = False) -> list[Result]:
        """The results back from the device, in the order submitted; ``wait``: at least one
        if any is in flight. A result's arrays are valid until the next :meth:`submit`."""
        found = list(self.ready)
        self.ready.clear()
        while self.in_flight:
            slot = self.in_flight[0][0]
            if not slot.event.query():
                if not wait or found:
                    break
                slot.event.synchronize()
            found.append(_landed(*self.in_flight.popleft()))
        return found

    @property
    def busy(self) -> bool:
        return bool(self.in_flight or self.ready)

    # -- windows -------------------------------------------------------------------------
    @torch.inference_mode()
    def probabilities(self, tiles: np.ndarray) -> np.ndarray:
        """Sigmoid probabilities (N, h, w) of windows (N, h, w), at once (they are blended)."""
        tensor = torch.from_numpy(np.ascontiguousarray(tiles))[:, None]
        if not self.where.cuda:
            logits = self.net(tensor.contiguous(memory_format=torch.channels_last))
            return torch.sigmoid(logits)[:, 0].numpy()
        batch = tensor.pin_memory().to(self.where.device, non_blocking=True)
        if not self.checked:
            self._decide(batch)
        return self._probabilities(batch, self.precision).cpu().numpy()
