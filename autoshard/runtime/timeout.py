"""How long a collective waits for the other ranks before it fails."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..ir.errors import ConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "timeout_seconds"]

# A dead or stuck rank turns into an error on the others after this long (seconds);
# AUTOSHARD_TIMEOUT overrides it. Long enough for a first NCCL/gloo connect and a
# large checkpoint read on a busy node, short enough that a job does not hang for
# the 10 (gloo: 30) minutes torch waits by default.
DEFAULT_TIMEOUT_S = 300.0


def timeout_seconds(environ: Mapping[str, str] | None = None) -> float:
    """Collective timeout in seconds: ``AUTOSHARD_TIMEOUT`` or :data:`DEFAULT_TIMEOUT_S`."""
    env = os.environ if environ is None else environ
    raw = env.get("AUTOSHARD_TIMEOUT")
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise ConfigError(f"AUTOSHARD_TIMEOUT={raw!r} must be a positive number of seconds "
                          f"(default {DEFAULT_TIMEOUT_S:g})")
    return t
