"""Sharding policies, one module per mode, found through :data:`POLICIES`.

Every module of this package is imported once and each :class:`Policy`
subclass with a ``name`` becomes a mode, in ``order``: adding a mode is adding a
module here (or calling :func:`register_policy` for one defined elsewhere).

>>> list(POLICIES)
['1d', '1d-sp', '2d', '2.5d', '3d']
>>> make_policy("2d", 4).dim_splits()[1]
'q=2'
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Choice, Policy, RuleContext

__all__ = ["POLICIES", "Choice", "Policy", "RuleContext", "register_policy"]

POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Add a mode to :data:`POLICIES` (keeps the registry sorted by ``order``).

    Args:
        cls: a :class:`Policy` subclass with a ``name``.

    Returns:
        ``cls`` itself, so it can be used as a class decorator.

    Raises:
        ValueError: ``cls`` has no ``name``.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name: a mode needs one (e.g. name = '1d')")
    entries = dict(POLICIES)
    entries[cls.name] = cls
    POLICIES.clear()
    POLICIES.update(sorted(entries.items(), key=lambda kv: (kv[1].order, kv[0])))
    return cls


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Policy) and obj.__module__ == mod.__name__ and obj.name:
                register_policy(obj)


_discover()


CP_ATTENTION = ("ring", "gather", "auto")
CP_ORDER = ("balanced", "contiguous")


def make_policy(mode: str, world_size: int, depth: int | None = None, dp: int = 1, cp: int = 1,
                cp_attention: str = "ring", cp_order: str = "balanced") -> Policy:
    """The policy of ``mode`` on its mesh for ``world_size`` ranks (``dp`` replicas,
    each split ``cp`` ways on the sequence: context parallelism, a ``cp`` axis after
    ``dp`` and before the mode's own axes; see docs/design.md, "Context parallelism"), its
    attention ``cp_attention``: ``"ring"`` (key/value blocks sent around the cp ring) or
    ``"gather"`` (keys and values all-gathered over cp) or ``"auto"`` (the one the cost model
    predicts faster, chosen when the graph is planned:
    :func:`autoshard.planning.search.choose_cp_attention`), the order of the sequence's blocks
    ``cp_order``: ``"balanced"`` (the sequence cut into 2·cp chunks, rank r holding chunks r
    and 2·cp-1-r, so a causal mask leaves every rank the same work; the sequence must be a
    multiple of 2·cp) or ``"contiguous"`` (rank r holds block r; a multiple of cp).

    Raises:
        ConfigError: an unknown mode, ``"auto"`` (chosen by the search), or a world
            size, depth or dp the mode cannot take; the message lists the valid choices.

    >>> make_policy("2.5d", 8, depth=2).mesh
    Mesh(axes=('dep', 'row', 'col'), sizes=(2, 2, 2))
    >>> make_policy("1d", 8, dp=2, cp=2).mesh
    Mesh(axes=('dp', 'cp', 'tp'), sizes=(2, 2, 2))
    >>> make_policy("4d", 8)
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.ConfigError: unknown mode '4d'; valid modes: '1d', '1d-sp', '2d', '2.5d', '3d'
    """
    from autoshard.ir.errors import ConfigError

    if mode == "auto":
        raise ConfigError("mode='auto' is chosen by autoshard.search(...); here choose one of "
                          + ", ".join(repr(m) for m in POLICIES))
    if mode not in POLICIES:
        raise ConfigError(f"unknown mode {mode!r}; valid modes: {', '.join(repr(m) for m in POLICIES)}")
    cls = POLICIES[mode]
    if cp_attention not in CP_ATTENTION:
        raise ConfigError(f"cp_attention={cp_attention!r}; valid: {', '.join(repr(c) for c in CP_ATTENTION)}")
    if cp_order not in CP_ORDER:
        raise ConfigError(f"cp_order={cp_order!r}; valid: {', '.join(repr(c) for c in CP_ORDER)}")
    if cp == 1:
        return cls(cls.make_mesh(world_size, depth=depth, dp=dp))
    if cp < 1 or world_size % (cp * dp):
        raise ConfigError(f"cp={cp} × dp={dp} must divide the world size {world_size}; valid cp: "
                          f"{[c for c in range(1, world_size // dp + 1) if world_size % (c * dp) == 0]}")
    if not cls.composes_with_cp:
        raise ConfigError(f"mode={mode!r} does not take cp yet: {cls.composes_with_cp_why}; valid with cp: "
                          + ", ".join(repr(m) for m, c in POLICIES.items() if c.composes_with_cp))
    pol = cls(with_cp(cls.make_mesh(world_size // cp, depth=depth, dp=dp), cp))
    pol.cp_attention, pol.cp_order = cp_attention, cp_order
    return pol


def with_cp(mesh, cp: int):
    """``mesh`` with a ``cp`` axis of ``cp`` ranks after ``dp`` and before the mode's own axes
    (``mesh`` itself for cp = 1).

    >>> from autoshard.ir.mesh import Mesh
    >>> with_cp(Mesh(axes=("dp", "tp"), sizes=(2, 2)), 2)
    Mesh(axes=('dp', 'cp', 'tp'), sizes=(2, 2, 2))
    """
    from autoshard.ir.mesh import Mesh

    if cp == 1:
        return mesh
    at = 1 if mesh.axes[:1] == ("dp",) else 0
    return Mesh(axes=mesh.axes[:at] + ("cp",) + mesh.axes[at:], sizes=mesh.sizes[:at] + (cp,) + mesh.sizes[at:])


__all__ += ["make_policy", "with_cp"]
