"""Builds the service from the configuration and an executor: the one place that wires the
loop's parts together (:class:`daemon.loop.service.Parts`)."""

from __future__ import annotations

import queue
import threading
import time

from daemon.core import readiness
from daemon.core.jobplan import Sharding
from daemon.core.planner import Policy
from daemon.executors import Executor, resources
from daemon.loop.acting import Actor
from daemon.loop.dispatch import Dispatcher
from daemon.loop.endings import Endings
from daemon.loop.intake import Intake
from daemon.loop.mailer import Mailer
from daemon.loop.metrics import Metrics
from daemon.loop.notify import Notifier
from daemon.loop.registry import ModelCheck
from daemon.loop.selfservice import SelfService
from daemon.loop.service import Clock, Parts, Service
from daemon.loop.waitroom import Schedule, WaitRoom
from daemon.site.claims import Claims
from daemon.site.config import Config
from daemon.site.owners import admission
from daemon.store import Store
from daemon.watcher import Wake, Watcher, WatchEvent


def build_service(
    config: Config,
    executor: Executor,
    *,
    clock: Clock = time.time,
    notifier: Notifier | None = None,
    stop: threading.Event | None = None,
) -> Service:
    """The service for ``config``, running jobs on ``executor``; it claims the drop roots
    (raises AnotherDaemon where another daemon holds the database or every root, and
    SpoolNotPrivate where the spool is not the service's alone). ``stop``: the event that asks
    for shutdown, shared with the executor's retries."""
    claims = Claims.take(config, clock())
    store = Store.open(config.daemon.database)
    events: queue.Queue[WatchEvent] = queue.Queue()
    intake = config.intake
    timing = readiness.Timing(intake.settle_seconds, intake.timeout_seconds)
    schedule = Schedule(
        intake.check_seconds,
        min(config.daemon.rescan_seconds, 60.0),
        intake.max_pattern_entries,
        max(intake.max_check_seconds, intake.check_seconds),
    )
    waitroom = WaitRoom(timing, schedule, store.manifest_text, lambda batch: events.put(Wake()))
    accounts = config.accounts.table()
    dispatch = Dispatcher(store, executor, str(config.registry.path), str(config.daemon.spool_dir),
                          accounts=accounts)  # fmt: skip
    models = ModelCheck(config.registry.path, store)
    metrics = Metrics()
    planner = config.planner
    shards = Sharding(planner.shard_size, planner.max_shard_size, executor.width(),
                      planner.region_bytes)  # fmt: skip
    mailer = Mailer.from_config(config.mail)
    return Service(
        Parts(
            config=config,
            claims=claims,
            executor=executor,
            store=store,
            events=events,
            watcher=Watcher(config.roots, events, lambda root: store.ended_folders(str(root))),
            intake=Intake(
                store,
                max_manifest_bytes=intake.max_manifest_bytes,
                settle_seconds=intake.settle_seconds,
                retry_seconds=intake.retry_unreadable_seconds,
                limits=lambda manifest: [
                    *resources.problems(manifest.resources, executor.bounds()),
                    *models(manifest),
                ],
                admits=admission(accounts),
            ),
            waitroom=waitroom,
            dispatch=dispatch,
            actor=Actor(store, dispatch, waitroom, metrics, accounts),
            endings=Endings(store, metrics, mailer, timing, config.mail.sender),
            metrics=metrics,
            policy=Policy(shards, planner.max_attempts, executor.name),
            timing=timing,
            notifier=notifier or Notifier(None),
            clock=clock,
            stop=stop or threading.Event(),
            accounts=accounts,
            selfservice=SelfService(store, intake.cancel_check_seconds),
        )
    )
