"""Intake's look at the model registry: an inference batch names a model that is there.

A batch naming a model (or a version of one) the registry does not have is refused when it is
taken in, with the models or versions there are, in its status file: its jobs would all fail
at their start. A model that a training or sweep batch under way will register is taken on
trust: the expert may drop the training and the inference that uses it together. The registry
is read as its folders and ``aliases.json`` lie (:func:`daemon.contract.names.unregistered`),
never through models/.
"""

from __future__ import annotations

from pathlib import Path

from daemon.contract.errors import ManifestError
from daemon.contract.jobspec import Problem
from daemon.contract.names import unregistered
from daemon.core.manifest import MANIFEST_NAME, Manifest, parse_manifest
from daemon.store import Store

_HINT = (
    "name a model the registry has (watchctl models list), or drop its training batch first; "
    "then write the manifest again"
)


class ModelCheck:
    """The problems of a manifest's model for this site's registry (a callable for intake)."""

    def __init__(self, registry: Path, store: Store) -> None:
        self.registry, self.store = registry, store

    def __call__(self, manifest: Manifest) -> list[Problem]:
        if manifest.kind.trains:
            return []
        model = manifest.model
        why = unregistered(self.registry, model.name, model.version)
        if not why or model.name in self._training():
            return []
        return [Problem(f"{MANIFEST_NAME}, model", why, _HINT)]

    def _training(self) -> set[str]:
        """The models that training and sweep batches under way will register."""
        names = set()
        for batch in self.store.active_batches():
            if batch.kind is None or not batch.kind.trains:
                continue
            data = self.store.manifest_text(batch.id).encode()
            try:
                names.add(parse_manifest(data, max_bytes=len(data) + 1).model.name)
            except ManifestError:
                continue
        return names
