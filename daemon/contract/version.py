"""The installed watchd version: in the heartbeat, and recorded with every output."""

from __future__ import annotations

from importlib import metadata


def code_version() -> str:
    try:
        return metadata.version("watchd")
    except metadata.PackageNotFoundError:
        return "unknown"
