"""watchd's daemon and its command lines, in layers (docs/architecture.md; the import rules are
held by tests/test_layers.py), bottom up: :mod:`daemon.contract` (what the jobs rely on),
:mod:`daemon.core` (pure), :mod:`daemon.site` (configuration and the machine),
:mod:`daemon.store`, :mod:`daemon.executors`, :mod:`daemon.watcher`, :mod:`daemon.loop` (the
service), :mod:`daemon.cli` (watchctl) and :mod:`daemon.watchd` (``watchd run``). It never
imports torch, Lightning, ``pipelines`` or ``models``."""
