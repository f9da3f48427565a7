"""``watchd``, the daemon's command line: ``watchd run`` (what systemd runs) and ``watchd
check-config``. The top floor: the one module that builds the loop (:mod:`daemon.loop.factory`).

The configuration is found at ``--config``, else ``$WATCHD_CONFIG``, else ``./config.toml``,
else ``/etc/watchd/config.toml``.
"""

from __future__ import annotations

import gc
import os
import signal
import threading

import typer

from daemon.cli.base import ConfigOption, console, entry, find_config
from daemon.executors import make_executor
from daemon.site import logs
from daemon.site.config import load_config

watchd_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The watchd daemon.")


@watchd_app.command("run")
def run_command(config: ConfigOption = None) -> None:
    """Run the daemon in the foreground (what systemd runs)."""
    from daemon.loop.factory import build_service
    from daemon.loop.notify import SYSTEMD_VARIABLES, Notifier

    cfg = load_config(find_config(config))
    logs.configure(cfg.daemon.log_format, cfg.daemon.log_level)
    jobs_env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARIABLES}
    notifier = Notifier.from_environment(os.environ)
    stop = threading.Event()  # shutdown, shared with the executor's retries
    service = build_service(cfg, make_executor(cfg, jobs_env, stop), notifier=notifier, stop=stop)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: service.request_stop())
    # What the start made (the imports, the configuration, the service) lives as long as the
    # daemon: frozen, the collector's full passes never walk it again. Each pass over it took
    # ~30 ms (~92,000 objects), twice in a 4,096-image batch, once inside its report's
    # submission (docs/benchmarks.md); garbage made later is collected as before.
    gc.collect()
    gc.freeze()
    service.run()


@watchd_app.command("check-config")
def check_config_command(config: ConfigOption = None) -> None:
    """Validate the configuration and print it resolved."""
    cfg = load_config(find_config(config))
    console.print_json(cfg.model_dump_json(exclude={"source"}, by_alias=True))


def watchd_main() -> None:
    entry(watchd_app, "watchd")


if __name__ == "__main__":  # python -m daemon.watchd: as the console script
    watchd_main()
