"""The command lines: ``watchd`` (the daemon) and ``watchctl`` (operators and experts).

Expected errors print one line, ``Error: …``, and exit 1; no traceback. ``watchctl`` reads the
database directly, so it works while the daemon is down; what it changes (retry, cancel) it
records as an intent that the daemon applies through its state machine.

The configuration is found at ``--config``, else ``$WATCHD_CONFIG``, else ``./config.toml``,
else ``/etc/watchd/config.toml``.
"""

from __future__ import annotations

import getpass
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.table import Table

from daemon import logs, manifest_writer, overview
from daemon.config import Config, load_config
from daemon.errors import CommandFailed, WatchdError
from daemon.executors import make_executor
from daemon.manifest import MAX_MANIFEST_BYTES, Kind, ManifestModel
from daemon.states import BatchState
from daemon.store import Store
from daemon.subprocesses import process_start_ticks
from daemon.subprocesses import run as run_command_line

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="config.toml to use", show_default=False)
]
JsonOption = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]

watchd_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The watchd daemon.")
watchctl_app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="See and steer the watchd daemon."
)
console = Console(highlight=False, soft_wrap=True)


def find_config(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    for candidate in (os.environ.get("WATCHD_CONFIG"), "config.toml", "/etc/watchd/config.toml"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise WatchdError("no config.toml here or in /etc/watchd; pass --config PATH")


# -- watchd ---------------------------------------------------------------------------------


@watchd_app.command("run")
def run_command(config: ConfigOption = None) -> None:
    """Run the daemon in the foreground (what systemd runs)."""
    from daemon.notify import SYSTEMD_VARIABLES, Notifier
    from daemon.service import Service

    cfg = load_config(find_config(config))
    logs.configure(cfg.daemon.log_format, cfg.daemon.log_level)
    jobs_env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARIABLES}
    notifier = Notifier.from_environment(os.environ)
    stop = threading.Event()  # shutdown, shared with the executor's retries
    service = Service(cfg, make_executor(cfg, jobs_env, stop), notifier=notifier, stop=stop)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: service.request_stop())
    service.run()


@watchd_app.command("check-config")
def check_config_command(config: ConfigOption = None) -> None:
    """Validate the configuration and print it resolved."""
    cfg = load_config(find_config(config))
    console.print_json(cfg.model_dump_json(exclude={"source"}, by_alias=True))


# -- watchctl: reading -------------------------------------------------------------------------


def _open(config: Path | None) -> tuple[Config, Store]:
    cfg = load_config(find_config(config))
    return cfg, Store.open_existing(cfg.daemon.database)


def _pid_alive(host: str, pid: int) -> bool | None:
    import socket

    if host != socket.gethostname():
        return None
    return process_start_ticks(pid) is not None


@watchctl_app.command("status")
def status_command(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Whether the daemon is alive, batches per state, what runs, the last failures."""
    cfg, store = _open(config)
    now = time.time()
    beat = store.heartbeat()
    live = overview.liveness(
        beat, now, cfg.daemon.heartbeat_seconds, _pid_alive(beat.host, beat.pid) if beat else None
    )
    active = [(b, store.jobs([b.id])) for b in store.active_batches()]
    failed = store.batches([BatchState.FAILED], limit=5, newest_first=True)
    data = overview.status(live, store.counts(), active, [(b, store.jobs([b.id])) for b in failed])
    if as_json:
        print(overview.to_json(data))
        return
    _print_status(data)


def _print_status(data: dict[str, Any]) -> None:
    d = data["daemon"]
    where = (
        f" (pid {d['pid']} on {d['host']}, heartbeat {d['heartbeat_age_s']} s ago)"
        if d.get("pid")
        else ""
    )
    console.print(f"[bold]watchd[/bold]: {d['state']}{where}")
    console.print("batches: " + ", ".join(f"{n} {s}" for s, n in data["counts"].items()))
    if data["active"]:
        console.print(
            _table(
                "Active", data["active"], ["id", "folder", "kind", "state", "progress", "reason"]
            )
        )
    if data["recent_failures"]:
        console.print(
            _table(
                "Last failures", data["recent_failures"], ["id", "folder", "updated_at", "reason"]
            )
        )


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        row = {**row, "progress": f"{row['jobs_done']}/{row['jobs_total']} jobs"}
        table.add_row(*(str(row.get(c, "")) for c in columns))
    return table


@watchctl_app.command("show")
def show_command(
    batch_id: Annotated[int, typer.Argument(help="batch id (see watchctl status)")],
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """One batch: its state, problems, jobs and history."""
    _, store = _open(config)
    batch = store.batch(batch_id)
    data = overview.batch_detail(batch, store.jobs([batch.id]), store.events(batch.id))
    if as_json:
        print(overview.to_json(data))
        return
    console.print(f"[bold]batch {data['id']}[/bold] {data['path']} (revision {data['revision']})")
    for key in ("kind", "state", "reason", "owner", "contact", "run_dir", "manifest_sha256"):
        console.print(f"  {key + ':':<17}{data[key]}")
    if batch.problems:
        console.print("  problems:")
        for p in batch.problems:
            console.print(f"    - {p.render()}")
    jobs = Table(title="Jobs", title_justify="left")
    for column in ("id", "name", "state", "attempts", "handle", "exit_code", "reason"):
        jobs.add_column(column)
    for j in data["jobs"]:
        jobs.add_row(
            *(
                str(j[c])
                for c in ("id", "name", "state", "attempts", "handle", "exit_code", "reason")
            )
        )
    console.print(jobs)
    history = Table(title="History (UTC)", title_justify="left")
    for column in ("at", "job", "change", "reason"):
        history.add_column(column)
    for e in data["history"]:
        change = f"{e['from'] or '·'} → {e['to']}" if e["to"] else "note"
        history.add_row(e["at"], str(e["job_id"] or ""), change, e["reason"])
    console.print(history)


# -- watchctl: intents ----------------------------------------------------------------------


def _intent(action: str, batch_id: int, config: Path | None) -> None:
    _, store = _open(config)
    intent = store.add_intent(action, batch_id, time.time(), getpass.getuser())
    console.print(
        f"{action} of batch {batch_id} recorded (intent {intent.id}); "
        "the daemon applies it at its next tick"
    )


@watchctl_app.command("retry")
def retry_command(batch_id: int, config: ConfigOption = None) -> None:
    """Run a failed or cancelled batch again: inputs are checked anew, failed jobs re-run."""
    _intent("retry", batch_id, config)


@watchctl_app.command("cancel")
def cancel_command(batch_id: int, config: ConfigOption = None) -> None:
    """Cancel a batch and its running jobs."""
    _intent("cancel", batch_id, config)


# -- watchctl: doctor -------------------------------------------------------------------------


@watchctl_app.command("doctor")
def doctor_command(config: ConfigOption = None, as_json: JsonOption = False) -> None:
    """Check that watchd can work here: the config, the executor (Slurm: reachable, client and
    controller versions, partitions). Exit status 1 when a check failed."""
    from dataclasses import asdict

    from daemon import doctor

    cfg = load_config(find_config(config))
    found = doctor.checks(cfg, os.environ)
    if as_json:
        print(overview.to_json({"checks": [asdict(c) for c in found]}))
    else:
        for check in found:
            mark = "[green]ok[/green]  " if check.ok else "[red]FAIL[/red]"
            console.print(f"{mark} {check.name}: {check.detail}")
    failed = [c.name for c in found if not c.ok]
    if failed:
        raise WatchdError(f"{len(failed)} check(s) failed: {', '.join(failed)}")


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
        str | None, typer.Option(help="training: folder of ground-truth masks")
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
    try:
        limit = load_config(find_config(config)).intake.max_manifest_bytes
    except WatchdError:
        if config is not None:
            raise
        limit = MAX_MANIFEST_BYTES  # no usable configuration here: the daemon's default
    request = manifest_writer.ManifestRequest(
        folder=folder, kind=kind, model=model, version=version,
        owner=owner or getpass.getuser(), email=email, title=title, masks=masks,
        checksums=checksums, params=_params(param or []), max_bytes=limit,
    )  # fmt: skip
    written = manifest_writer.write(request, overwrite=force)
    if written.note:
        print(written.note, file=sys.stderr)
    console.print(f"wrote {written.path}")


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
    """Every model's versions, newest first, with validation metrics and aliases."""
    cfg = load_config(find_config(config))
    data = _catalog(cfg, "list", *([name] if name else []))
    if as_json:
        print(overview.to_json(data))
        return
    if not data["models"]:
        console.print(f"no models in {data['registry']}")
    for model in data["models"]:
        table = Table(title=model["name"], title_justify="left")
        for column in ("version", "aliases", "val_dice", "val_iou", "created_at", "sha256"):
            table.add_column(column)
        for v in model["versions"]:
            dice, iou = v.get("val_dice"), v.get("val_iou")
            table.add_row(
                str(v["version"]), ", ".join(v.get("aliases", [])),
                "" if dice is None else f"{dice:.4f}", "" if iou is None else f"{iou:.4f}",
                str(v.get("created_at") or v.get("error", "")), str(v.get("sha256", ""))[:12],
            )  # fmt: skip
        console.print(table)


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


# -- entry points ---------------------------------------------------------------------------


def _entry(app: typer.Typer) -> None:
    command = typer.main.get_command(app)
    try:
        command.main(standalone_mode=False)
    except WatchdError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        print("Aborted.", file=sys.stderr)
        sys.exit(1)


def watchd_main() -> None:
    _entry(watchd_app)


def watchctl_main() -> None:
    _entry(watchctl_app)
