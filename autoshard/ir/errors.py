"""Typed errors. Every user-facing failure is one of these, raised before any collective."""

from __future__ import annotations

__all__ = ["AutoshardError", "ConfigError", "ShardingError", "CaptureError", "CheckpointError", "CollectiveError",
           "AutoshardWarning"]


class AutoshardError(Exception):
    """Base class of every error autoshard raises on purpose."""


class ConfigError(AutoshardError, ValueError):
    """A bad option: world size vs mode, depth, batch size, dtype... The message lists valid choices."""


class ShardingError(AutoshardError, ValueError):
    """A graph node that no rule can shard exactly. The message names the node and its input specs."""

    def __init__(self, message: str, *, node: object | None = None, specs: object | None = None):
        detail = message
        if node is not None:
            fmt = getattr(node, "format_node", None)
            detail += f"\n  node: {fmt() if fmt else node}"
            stack = getattr(node, "meta", {}).get("nn_module_stack") or {}
            if stack:
                detail += f"\n  module: {list(stack.values())[-1][0]}"
        if specs is not None:
            detail += f"\n  input specs: {specs}"
        super().__init__(detail)


class CaptureError(AutoshardError, RuntimeError):
    """The model could not be captured with torch.export."""


class CheckpointError(AutoshardError, RuntimeError):
    """A checkpoint is incomplete, corrupt or belongs to another model."""


class CollectiveError(AutoshardError, RuntimeError):
    """A collective failed: another rank died, stalled past the collective timeout, or never
    entered a collective call (``save_pretrained`` on one rank only)."""


class AutoshardWarning(UserWarning):
    """An exact fallback worth knowing about: a dimension that does not divide and
    stays replicated, a graph node gathered to a replicated layout."""
