"""Guidance store: rollout guidance from the rollout to the trainer through tensorstore (SPEC 5)."""

from trace_jax.guidance.errors import (
    GuidanceCorruptError,
    GuidanceError,
    GuidanceExistsError,
    GuidanceIOError,
    GuidanceMissingError,
    GuidanceVersionError,
)
from trace_jax.guidance.layout import EntryKey
from trace_jax.guidance.store import Fallback, GuidanceStore, GuidanceStoreConfig, WriteResult

__all__ = [
    "EntryKey",
    "Fallback",
    "GuidanceCorruptError",
    "GuidanceError",
    "GuidanceExistsError",
    "GuidanceIOError",
    "GuidanceMissingError",
    "GuidanceStore",
    "GuidanceStoreConfig",
    "GuidanceVersionError",
    "WriteResult",
]
