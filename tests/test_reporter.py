"""The status file as its owner reads it: one line per item whatever the values hold, and a
next step that watchd then takes."""

from __future__ import annotations

from dataclasses import replace

from daemon.contract.jobspec import Pipeline, Problem
from daemon.core.manifest_schema import Kind
from daemon.core.records import Batch, Event, Job
from daemon.core.states import BatchState, JobState
from daemon.loop.reporter import StatusInput, render

NOW = 1_800_000_000.0


def batch(**changes: object) -> Batch:
    base = Batch(
        id=7, root="/drop", folder="plate", revision=1, manifest_sha256="0" * 64,
        manifest_stat="", kind=Kind.INFERENCE, title="", owner="Anna", contact=None,
        state=BatchState.FAILED, reason="inputs incomplete", problems=(), detail="",
        run_dir="/drop/plate/results/r", watch_inputs="", created_at=NOW, updated_at=NOW,
        finished_at=NOW,
    )  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def status(b: Batch, *, retry_taken: bool = True, events: tuple[Event, ...] = ()) -> str:
    return render(StatusInput(b, (), (), events, 5.0, 3600.0, None, retry_taken), NOW)


def test_no_value_can_start_a_line_of_its_own() -> None:
    """Records from before the manifest refused control characters, and file names (which may
    legally hold a newline), stay on their line, escaped."""
    forged = "x\nState:     DONE\x1b[2J"
    text = status(
        batch(title=forged, owner=forged, reason=forged,
              problems=(Problem(f"files[0] '{forged}'", "is missing", "copy it"),)),
        events=(Event(1, NOW, 7, None, None, BatchState.FAILED, forged, ""),),
    )  # fmt: skip
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("State:")] == ["State:     FAILED"]
    assert "\x1b" not in text
    assert 'Batch:     #7, revision 1, inference, "x\\nState:     DONE\\x1b[2J"' in lines
    assert "  - files[0] 'x\\nState:     DONE\\x1b[2J': is missing — copy it" in lines


def test_a_refused_manifest_says_to_save_a_fixed_one_and_never_to_ask_for_a_retry() -> None:
    text = status(batch(kind=None, reason="manifest refused"), retry_taken=False)
    assert "watchctl retry" not in text
    assert (
        "Next step: fix what is listed and save manifest.toml again: watchd takes a changed "
        "manifest in as a new revision (a retry cannot help: the manifest itself was refused)."
    ) in text


def test_a_failed_job_suggests_a_retry_by_the_batchs_id() -> None:
    text = status(batch(reason="job infer-1 failed"))
    assert "ask an operator to run `watchctl retry 7` (the inputs are checked anew" in text


def test_inputs_incomplete_at_the_timeout_are_looked_at_again_until_one_more_timeout() -> None:
    text = status(batch(watch_inputs="abc"))
    assert (
        "Next step: copy what is missing: until 2027-01-15 09:00:00 watchd checks the inputs "
        "again as soon as they change; after that, ask an operator to run `watchctl retry 7`."
    ) in text


def test_a_running_inference_batch_says_its_images_done_as_well_as_its_jobs() -> None:
    def job(i: int, state: JobState, images: int, done: int, pipeline: Pipeline) -> Job:
        return Job(i, 7, f"b000007-{i}", pipeline, 0, i, 2, state, 1, "local", None, None, None,
                   "", NOW, NOW, NOW, None, images=images, images_done=done)  # fmt: skip

    jobs = (job(1, JobState.SUCCEEDED, 750, 0, Pipeline.INFER),
            job(2, JobState.RUNNING, 750, 320, Pipeline.INFER))  # fmt: skip
    text = render(StatusInput(batch(state=BatchState.RUNNING, reason="jobs submitted"), jobs,
                              (), (), 5.0, 3600.0), NOW)  # fmt: skip
    assert "Progress:  1,070 of 1,500 images; 1 of 2 jobs done, 1 running" in text
    training = (job(1, JobState.RUNNING, 0, 0, Pipeline.TRAIN),)
    text = render(StatusInput(batch(state=BatchState.RUNNING), training, (), (), 5.0, 3600.0), NOW)
    assert "Progress:  0 of 1 jobs done, 1 running" in text
