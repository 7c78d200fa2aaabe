"""The walk's result: what :mod:`.propagate` recorded per node, and what the passes
after it fill in (docs/design.md, "The propagation passes").

The walk visits the graph in order and records, per node, the rule's
:class:`~autoshard.policies.base.Choice` and the layouts it asked of the inputs
(:class:`Visit`); the layout of every value is then final (a value's layout is
written once, when it is visited). The passes read that and add, each its own field:
:func:`~autoshard.passes.layouts.relayouts` the re-layout steps,
:func:`~autoshard.passes.grad_needs.grad_syncs` the gradient steps and syncs,
:func:`~autoshard.passes.count.count_comms` the collectives;
:func:`~autoshard.passes.count.plan_rows` turns them into the plan's rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from autoshard.ir.mesh import Mesh
from autoshard.ir.spec import replicated
from autoshard.policies.base import Choice, Policy

from .annotate import Annotation
from .row_order import RowFact
from .rule_context import Shapes

__all__ = ["Visit", "Walked", "evolve"]


_FIELDS: dict = {}      # dataclass -> its field names (for evolve)


def evolve(obj, **changes):
    """``dataclasses.replace(obj, **changes)`` for a frozen dataclass that validates nothing
    on construction (no ``__post_init__``: :class:`Visit`, :class:`~autoshard.ir.plan.NodePlan`):
    the fields copied, ``changes`` set, no ``__init__`` run. The passes after the walk replace
    every visit, the trace every row, and a search plans hundreds of graphs: replace()'s
    generic ``__init__`` call was a tenth of its time (docs/design.md, "Pricing the search").

        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class Row:
        ...     name: str
        ...     dim: int = 0
        >>> evolve(Row("linear"), dim=1)
        Row(name='linear', dim=1)
        >>> from autoshard.ir.plan import Step       # validates its segments: not copied blindly
        >>> evolve(Step(op="gather", axes=("tp",), dim=0), dim=1)
        Traceback (most recent call last):
        TypeError: evolve() copies plain frozen dataclasses; Step validates or has slots: use dataclasses.replace
    """
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
            raise TypeError(f"evolve() copies plain frozen dataclasses; {cls.__name__} validates or has slots: "
                            f"use dataclasses.replace")
        names = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls) if f.init)
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(changes.keys() - names)}")
    new = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass(frozen=True)
class Visit:
    """One node the walk handed to a rule.

    ``in_specs``: arg path -> the layout the choice asks of that input (its tensor
    inputs); ``moves``: the paths whose value is re-laid from its own layout (not a
    parameter, whose first use fixes its layout, nor a state input's first write);
    ``row``: the node gets a row in the plan (it splits or runs a kernel). The passes
    fill ``arg_steps`` ((path, steps) per input), ``grad_sums`` ((path, Step, note): a
    parameter's gradient summed in the graph at this use) and ``comms``."""

    node: fx.Node
    ann: Annotation
    choice: Choice
    in_specs: dict
    moves: tuple = ()
    row: bool = True
    arg_steps: tuple = ()
    grad_sums: tuple = ()
    comms: tuple = ()


@dataclass(frozen=True)
class Walked:
    """The walk's result over one graph: the final layouts (``specs``: node name ->
    spec; ``param_spec``: parameter -> spec fixed by its first use), the ``entries`` in
    graph order (a :class:`Visit`, or a :class:`~autoshard.ir.plan.NodePlan` the walk
    made whole: a split input), and what the passes add (``output_steps`` /
    ``output_comms``: the outputs' gathers; ``param_sync``: parameter -> axes its
    gradient is summed over after backward)."""

    gm: fx.GraphModule
    policy: Policy
    mesh: Mesh
    shapes: Shapes
    params: frozenset
    state: frozenset
    rows: dict
    batch_axes: tuple
    dp_axes: tuple
    gather_outputs: bool
    needs_grad: frozenset
    specs: dict
    param_spec: dict
    entries: tuple
    output: Any = None
    output_steps: tuple = ()
    output_comms: tuple = ()
    param_sync: dict = field(default_factory=dict)

    def spec(self, a):
        """The layout of graph value ``a`` (a parameter's fixed one, replicated where
        nothing fixed it; None for a non-node)."""
        if not isinstance(a, fx.Node):
            return None
        if a.op == "get_attr" and a.target in self.params:
            return self.param_spec.get(a.target) or replicated(a.meta["val"].dim())
        if a.op == "placeholder" and a.name in self.state and a.name not in self.specs:
            return replicated(a.meta["val"].dim())
        return self.specs.get(a.name)

    def row_fact(self, a: fx.Node) -> RowFact:
        """The row fact of value ``a`` (:mod:`.row_order`; none for a multi-output node)."""
        f = self.rows.get(a.name, RowFact())
        return RowFact() if isinstance(f, tuple) else f

    def visits(self):
        """The :class:`Visit` entries, in graph order."""
        return (e for e in self.entries if isinstance(e, Visit))

    def with_visits(self, fn, **changes) -> "Walked":
        """A copy with every :class:`Visit` ``v`` replaced by ``fn(v)`` (in graph order)
        and ``changes`` applied."""
        entries = tuple(fn(e) if isinstance(e, Visit) else e for e in self.entries)
        return dataclasses.replace(self, entries=entries, **changes)
