"""Numbers read from the environment, checked once, in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import ConfigError

__all__ = ["positive_number"]


def positive_number(name: str, default: float, *, what: str, environ: Mapping[str, str] | None = None) -> float:
    """The value of ``name`` in ``environ`` (default: ``os.environ``), ``default`` where it is
    unset or empty; :class:`~autoshard.ir.errors.ConfigError` ``"NAME='raw' <what> (default D)"``
    where it is not a positive number.

    >>> positive_number("AUTOSHARD_TIMEOUT", 300, what="must be a positive number of seconds", environ={})
    300
    >>> positive_number("AUTOSHARD_TIMEOUT", 300, what="...", environ={"AUTOSHARD_TIMEOUT": "20"})
    20.0
    """
    env = os.environ if environ is None else environ
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{name}={raw!r} {what} (default {default:g})")
    return value
