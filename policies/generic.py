"""Which rule plans a node: the dispatch over the rules filed by op family in
:mod:`autoshard.policies.ops` (docs/design.md, "Rules by op family").

A node's target is looked up in the registry the families fill
(:data:`~autoshard.policies.ops.common.RULES`: one dict lookup per node), then by its
overload packet (the per-sample ops), then by its tags: an elementwise write into
its first argument is :func:`~autoshard.policies.ops.pointwise.inplace`, any other
``torch.Tag.pointwise`` op :func:`~autoshard.policies.ops.pointwise.pointwise`, and an
op with no rule :func:`~autoshard.policies.ops.common.all_replicated_or_fallback`.

The names other modules import from here stay here (:data:`RULES`,
:data:`PER_SAMPLE`, :data:`TRIM_META`, :func:`view_groups`, :func:`writes_first_arg`).
"""

from __future__ import annotations

import torch
from torch import fx

from .ops.common import PACKET_RULES, RULES, all_replicated_or_fallback
from .ops.convolution import PER_SAMPLE
from .ops.indexing import TRIM_META
from .ops.pointwise import inplace, is_pointwise_write, pointwise, writes_first_arg
from .ops.views import view_groups

aten = torch.ops.aten

__all__ = ["PER_SAMPLE", "RULES", "TRIM_META", "rule_for", "view_groups", "writes_first_arg"]


def rule_for(node: fx.Node):
    """The rule that plans ``node``: its entry in :data:`RULES`, else the rule of its
    overload packet (the per-sample ops), in-place elementwise writes, pointwise ops
    (by ``torch.Tag.pointwise``), and for anything else
    :func:`~autoshard.policies.ops.common.all_replicated_or_fallback`.

    >>> g = fx.Graph()
    >>> x = g.placeholder("x")
    >>> rule_for(g.call_function(aten.gelu.default, (x,))).__name__
    'pointwise'
    >>> rule_for(g.call_function(aten.view.default, (x, [2, 3]))).__name__
    'reshape'
    >>> rule_for(g.call_function(aten.erfinv_.default, (x,))).__name__
    'inplace'"""
    t = node.target
    rule = RULES.get(t)
    if rule is not None:
        return rule
    if isinstance(t, torch._ops.OpOverload):
        rule = PACKET_RULES.get(t.overloadpacket)
        if rule is not None:
            return rule
        if is_pointwise_write(t):
            return inplace
        if torch.Tag.pointwise in t.tags:
            return pointwise
    return all_replicated_or_fallback
