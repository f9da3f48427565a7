"""``watchctl``, the command line of operators and experts (``watchd``, the daemon's, is
:mod:`daemon.watchd`).

Expected errors print one line, ``Error: …``, and exit 1 (``watchctl doctor``'s failed checks
exit 3); no traceback. ``watchctl`` reads the database directly, so it works while the daemon is
down; what it changes (retry, cancel, requeue, pause, resume) it records as an intent that the
daemon applies through its state machine. The reading commands (status, batches, show, jobs,
logs) are in :mod:`daemon.cli.read`; usage and quota in :mod:`daemon.cli.accounting`.

The configuration is found at ``--config``, else ``$WATCHD_CONFIG``, else ``./config.toml``,
else ``/etc/watchd/config.toml``.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from daemon.cli import accounting, manifest_writer, overview
from daemon.cli import read as cli_read
from daemon.cli.base import (
    EXIT_CODES,
    ConfigOption,
    JsonOption,
    console,
    entry,
    find_config,
    find_root,
    open_store,
    progress_console,
    shown,
)
from daemon.contract.errors import ChecksFailed, CommandFailed, WatchdError
from daemon.core.manifest import MAX_MANIFEST_BYTES
from daemon.core.manifest_schema import Kind, ManifestModel
from daemon.core.records import IntentAction
from daemon.site.config import Config, load_config
from daemon.site.subprocesses import run as run_command_line

watchctl_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="See and steer the watchd daemon.",
    epilog=EXIT_CODES,
)


# -- watchctl: reading (daemon/cli/read.py) -----------------------------------------------------

watchctl_app.command("status")(cli_read.status_command)
watchctl_app.command("batches")(cli_read.batches_command)
watchctl_app.command("show")(cli_read.show_command)
watchctl_app.command("jobs")(cli_read.jobs_command)
watchctl_app.command("logs")(cli_read.logs_command)
watchctl_app.command("usage")(accounting.usage_command)
watchctl_app.command("quota")(accounting.quota_command)


# -- watchctl: intents ----------------------------------------------------------------------


def _intent(action: IntentAction, batch_id: int, config: Path | None) -> None:
    _, store = open_store(config)
    intent = store.add_intent(action, batch_id, time.time(), getpass.getuser())
    console.print(
        f"{action.value} of batch {batch_id} recorded (intent {intent.id}); "
        "the daemon applies it at its next tick"
    )


def _root_intent(action: IntentAction, named: str, config: Path | None) -> None:
    cfg, store = open_store(config)
    root = str(find_root(cfg, named).path)
    intent = store.add_root_intent(action, root, time.time(), getpass.getuser())
    console.print(
        f"{action.value} of drop root {shown(root)} recorded (intent {intent.id}); "
        "the daemon applies it at its next tick"
    )


@watchctl_app.command("retry")
def retry_command(batch_id: int, config: ConfigOption = None) -> None:
    """Run a failed or cancelled batch again: inputs are checked anew, failed jobs re-run."""
    _intent(IntentAction.RETRY, batch_id, config)


@watchctl_app.command("cancel")
def cancel_command(batch_id: int, config: ConfigOption = None) -> None:
    """Cancel a batch and its running jobs."""
    _intent(IntentAction.CANCEL, batch_id, config)


@watchctl_app.command("requeue")
def requeue_command(batch_id: int, config: ConfigOption = None) -> None:
    """Run a done, failed or cancelled batch again: every job of it.

    The inputs are checked anew first; inference skips the images whose masks are current."""
    _intent(IntentAction.REQUEUE, batch_id, config)


RootArgument = Annotated[str, typer.Argument(help="the drop root: its path, or its index")]


@watchctl_app.command("pause")
def pause_command(root: RootArgument, config: ConfigOption = None) -> None:
    """Pause a drop root: no new batch is taken in, no new job starts there.

    New manifests wait on disk; running jobs finish."""
    _root_intent(IntentAction.PAUSE, root, config)


@watchctl_app.command("resume")
def resume_command(root: RootArgument, config: ConfigOption = None) -> None:
    """Resume a paused drop root: what was dropped meanwhile is taken in, held jobs go out."""
    _root_intent(IntentAction.RESUME, root, config)


# -- watchctl: doctor -------------------------------------------------------------------------


@watchctl_app.command("doctor")
def doctor_command(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Check that watchd can work here; exit status 3 when a check failed.

    The config; each drop root (there, writable, its filesystem and observer); inotify limits;
    the database (integrity, schema, WAL); the daemon's version; the registry; the executor
    (Slurm: reachable, client and controller versions, partitions)."""
    from dataclasses import asdict

    from daemon.cli import doctor

    found = doctor.run(find_config(config), os.environ)
    failed = [c.name for c in found if not c.ok]
    if as_json:
        print(overview.to_json({"ok": not failed, "checks": [asdict(c) for c in found]}))
    else:
        for check in found:
            mark = "[green]ok[/green]  " if check.ok else "[red]FAIL[/red]"
            first, *more = check.detail.splitlines()
            console.print(f"{mark} {check.name}: {shown(first)}", *map(shown, more), sep="\n")
            if check.hint:
                console.print(f"     hint: {shown(check.hint)}")
    if failed:
        raise ChecksFailed(f"{len(failed)} check(s) failed: {', '.join(failed)}")


# -- watchctl: manifest -----------------------------------------------------------------------


@watchctl_app.command("manifest")
def manifest_command(
    folder: Annotated[Path | None, typer.Argument(help="the batch folder")] = None,
    kind: Annotated[Kind, typer.Option(help="training, inference or sweep")] = Kind.INFERENCE,
    model: Annotated[
        str, typer.Option(help="model to use (inference) or to produce (training)")
    ] = "spheroid-unet",
    version: Annotated[str | None, typer.Option(help="inference: latest, best or a number")] = None,
    owner: Annotated[str | None, typer.Option(help="your name")] = None,
    email: Annotated[str | None, typer.Option(help="where to reach you")] = None,
    title: Annotated[str, typer.Option(help="a title for the batch")] = "",
    masks: Annotated[
        str | None,
        typer.Option(help="folder of ground-truth masks (training; inference: scored against)"),
    ] = None,
    param: Annotated[list[str] | None, typer.Option(help="NAME=VALUE, repeatable")] = None,
    checksums: Annotated[bool, typer.Option(help="record sha256 of every file")] = True,
    force: Annotated[bool, typer.Option(help="replace an existing manifest")] = False,
    schema: Annotated[bool, typer.Option(help="print the manifest's JSON schema and exit")] = False,
    config: ConfigOption = None,
) -> None:
    """Write a correct manifest.toml for a folder of images (atomically), within the
    configured intake.max_manifest_bytes when a configuration is found."""
    if schema:
        print(overview.to_json(ManifestModel.model_json_schema()))
        return
    if folder is None:
        raise WatchdError("name the batch folder")
    if kind.trains and masks is None and (folder / "masks").is_dir():
        masks = "masks"
    cfg = _manifest_config(config)
    limit = cfg.intake.max_manifest_bytes if cfg else MAX_MANIFEST_BYTES
    request = manifest_writer.ManifestRequest(
        folder=folder, kind=kind, model=model, version=version,
        owner=owner or getpass.getuser(), email=email, title=title, masks=masks,
        checksums=checksums, params=_params(param or []), max_bytes=limit,
    )  # fmt: skip
    with _hashing_progress(checksums) as progress:
        written = manifest_writer.write(request, overwrite=force, progress=progress)
    if written.note:
        print(written.note, file=sys.stderr)
    console.print(f"wrote {shown(written.path)}")
    if cfg is not None and not kind.trains:
        _say_if_unregistered(cfg, model)


def _manifest_config(config: Path | None) -> Config | None:
    """The daemon's configuration when one can be used here; else None, and a note saying
    that the daemon's default limits apply and why (an expert on a workstation or on the
    share's client has no configuration, or may not read the gateway's)."""
    try:
        return load_config(find_config(config))
    except WatchdError as exc:
        if config is not None:
            raise
        print(
            f"note: no site configuration used ({str(exc).splitlines()[0]}); the daemon's "
            f"default limits apply: a manifest of at most {MAX_MANIFEST_BYTES:,} bytes",
            file=sys.stderr,
        )
        return None


def _say_if_unregistered(cfg: Config, model: str) -> None:
    """The daemon would refuse the batch: say so now, while the expert is here (a training
    batch under way may still register the model, so this is a note, not a refusal)."""
    from daemon.contract.names import model_names

    known = model_names(cfg.registry.path)
    if model not in known:
        print(
            f"note: no model named {model!r} in the registry {cfg.registry.path} (models there: "
            f"{', '.join(known) or 'none'}); watchd refuses the batch unless a training batch "
            "under way registers it — see watchctl models list",
            file=sys.stderr,
        )


@contextlib.contextmanager
def _hashing_progress(checksums: bool) -> Iterator[manifest_writer.ProgressHook | None]:
    """A progress bar on stderr while the files are hashed, when stderr is a terminal."""
    if not (checksums and progress_console.is_terminal):
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=progress_console, transient=True) as bar:
        task = bar.add_task("hashing", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _params(pairs: list[str]) -> dict[str, Any]:
    import tomllib

    params: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise WatchdError(f"--param {pair!r}: expected NAME=VALUE")
        try:
            params[name] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            params[name] = value
    return params


# -- watchctl: models -------------------------------------------------------------------------

models_app = typer.Typer(no_args_is_help=True, help="The model registry: versions and aliases.")
watchctl_app.add_typer(models_app, name="models")


def _catalog(cfg: Config, *args: str) -> dict[str, Any]:
    """Run ``python -m models.catalog`` in the pipelines' interpreter (the daemon never imports
    models/) and return its JSON; its ``Error: …`` becomes ours."""
    import json

    python = cfg.executor.local.python or sys.executable
    command = [python, "-m", "models.catalog", str(cfg.registry.path), *args]
    try:
        output = run_command_line(command, timeout=120)
    except CommandFailed as exc:
        message = exc.stderr.strip()
        if exc.returncode == 1 and message.startswith("Error: "):
            raise WatchdError(message.removeprefix("Error: ")) from None
        raise
    return dict(json.loads(output))


@models_app.command("list")
def models_list_command(
    name: Annotated[str | None, typer.Argument(help="one model (default: all)")] = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Every model's versions, newest first, with validation metrics (pixels and objects) and
    aliases."""
    cfg = load_config(find_config(config))
    data = _catalog(cfg, "list", *([name] if name else []))
    if as_json:
        print(overview.to_json(data))
        return
    if not data["models"]:
        console.print(f"no models in {shown(data['registry'])}")
    for model in data["models"]:
        table = Table(title=model["name"], title_justify="left")
        for column in ("version", "aliases", *(label for _, label, _ in _SCORES), "created_at",
                       "sha256"):  # fmt: skip
            table.add_column(column, justify="right" if column in _SCORE_LABELS else "left")
        for v in model["versions"]:
            table.add_row(
                str(v["version"]), ", ".join(v.get("aliases", [])),
                *(_score(v.get(key), form) for key, _, form in _SCORES),
                str(v.get("created_at") or v.get("error", "")), str(v.get("sha256", ""))[:12],
            )  # fmt: skip
        console.print(table)


# (key in the catalogue's listing, column, format): validation scores of each version; the
# object scores are those of the objects found in the validation images (docs/models.md)
_SCORES = (
    ("val_dice", "val_dice", "{:.4f}"),
    ("val_iou", "val_iou", "{:.4f}"),
    ("val_object_f1", "obj_f1@.5", "{:.4f}"),
    ("val_matched_iou", "obj_iou", "{:.4f}"),
    ("val_count_error", "count_err", "{:.1%}"),
)
_SCORE_LABELS = {label for _, label, _ in _SCORES}


def _score(value: Any, form: str) -> str:
    return "" if value is None else form.format(value)


@models_app.command("promote")
def models_promote_command(
    name: Annotated[str, typer.Argument(help="the model")],
    version: Annotated[str, typer.Argument(help="a version number, or latest/best")],
    alias: Annotated[str, typer.Option(help="the alias to move: best or latest")] = "best",
    config: ConfigOption = None,
) -> None:
    """Point an alias at a version (its weights are checked whole first)."""
    cfg = load_config(find_config(config))
    data = _catalog(cfg, "promote", name, version, "--alias", alias, "--by", getpass.getuser())
    aliases = ", ".join(f"{k} = {v}" for k, v in sorted(data["aliases"].items()))
    console.print(f"{name}: {alias} → version {data['aliases'][alias]} ({aliases})")


# -- entry point ------------------------------------------------------------------------------


def watchctl_main() -> None:
    entry(watchctl_app, "watchctl")


if __name__ == "__main__":  # python -m daemon.cli.watchctl: as the console script
    watchctl_main()
