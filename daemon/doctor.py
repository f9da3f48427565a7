"""Health checks: what ``watchctl doctor`` shows. Each is a :class:`Check` (name, ok, detail);
:func:`checks` lists them all, so a new kind of check is one more function added to it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from daemon.config import Config
from daemon.errors import WatchdError
from daemon.executors import Check, make_executor

CheckGroup = Callable[[Config, Mapping[str, str]], list[Check]]


def config_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    roots = ", ".join(str(r.path) for r in config.roots)
    detail = f"{config.source}: executor {config.executor.kind}, roots {roots}"
    return [Check("config", True, detail)]


def executor_checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """The executor's own self-test (the one the daemon logs at start-up)."""
    try:
        executor = make_executor(config, environ)
    except WatchdError as exc:
        detail = str(exc).splitlines()[0]
        return [Check(f"{config.executor.kind} executor", False, detail)]
    try:
        return executor.self_test()
    finally:
        executor.close()


GROUPS: tuple[CheckGroup, ...] = (config_checks, executor_checks)


def checks(config: Config, environ: Mapping[str, str]) -> list[Check]:
    """Every check, in order."""
    return [check for group in GROUPS for check in group(config, environ)]
