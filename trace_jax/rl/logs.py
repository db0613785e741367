"""Console logging of the entry points: third-party INFO lines off unless asked for.

Orbax logs every checkpoint save and restore at INFO through absl (hundreds of lines in a short
run); the library's own messages use Python loggers under `trace_jax` and are not affected.
"""

from __future__ import annotations

import logging

THIRD_PARTY_LOGGERS = ("absl", "orbax", "jax", "tensorstore", "etils")


def quiet_third_party(verbose: bool = False) -> None:
    """Shows only warnings and errors of third-party libraries (absl and orbax among them); with
    `verbose`, everything their loggers pass on. Call it after flags are parsed (absl resets
    its logger's level when it parses `--verbosity`)."""
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)
