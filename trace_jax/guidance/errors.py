"""Errors of the guidance store: every failure names the entry (run, step, micro-batch) and why."""

from __future__ import annotations


class GuidanceError(Exception):
    """Base class: guidance could not be written or read as asked."""


class GuidanceMissingError(GuidanceError):
    """No committed guidance for the entry (never written, not yet written, or collected)."""


class GuidanceCorruptError(GuidanceError):
    """The entry is committed but its manifest or data fail their checksums or layout checks."""


class GuidanceVersionError(GuidanceError):
    """The entry was sampled with a policy version outside the reader's accepted window."""


class GuidanceExistsError(GuidanceError):
    """A writer tried to commit an entry that another write already committed."""


class GuidanceIOError(GuidanceError):
    """The kvstore failed in a way that says nothing about the data (e.g. unavailable)."""
