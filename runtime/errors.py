"""Errors a client of an engine sees, importable without torch or Ray."""
from __future__ import annotations

__all__ = ["EngineDeadError"]


class EngineDeadError(RuntimeError):
    """The workers are gone or stuck: every in-flight request fails with this, and so does every
    later call."""
