"""How long a collective waits for the other ranks before it fails."""

from __future__ import annotations

from collections.abc import Mapping

from ..ir.env import positive_number

__all__ = ["DEFAULT_TIMEOUT_S", "timeout_seconds"]

# A dead or stuck rank turns into an error on the others after this long (seconds);
# AUTOSHARD_TIMEOUT overrides it. Long enough for a first NCCL/gloo connect and a
# large checkpoint read on a busy node, short enough that a job does not hang for
# the 10 (gloo: 30) minutes torch waits by default.
DEFAULT_TIMEOUT_S = 300.0


def timeout_seconds(environ: Mapping[str, str] | None = None) -> float:
    """Collective timeout in seconds: ``AUTOSHARD_TIMEOUT`` or :data:`DEFAULT_TIMEOUT_S`."""
    return positive_number("AUTOSHARD_TIMEOUT", DEFAULT_TIMEOUT_S, what="must be a positive number of seconds",
                           environ=environ)
