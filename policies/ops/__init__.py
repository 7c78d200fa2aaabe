"""The mode-independent rules, one module per op family (as DTensor files its
sharding strategies under ``torch/distributed/tensor/_ops/``). Each rule registers
the ATen overloads it serves where it is written (:func:`~.common.register`);
importing this package imports every family, so :data:`~.common.RULES` is full.
Heavy Linear and embedding choices live in the mode modules
(:meth:`autoshard.policies.base.Policy.linear`, :meth:`~autoshard.policies.base.Policy.embedding`).

Adding an op: write its rule in its family's module (or a new module here, listed
below) under ``@register(aten.<op>.<overload>, ...)``.

>>> import torch
>>> from autoshard.policies.ops import RULES
>>> RULES[torch.ops.aten.layer_norm.default].__module__
'autoshard.policies.ops.norms'
"""

from __future__ import annotations

from . import (attention, convolution, creation, indexing, loss, matmul, norms, pointwise,  # noqa: F401 - registers
               reductions, views)
from .common import PACKET_RULES, RULES, register

__all__ = ["PACKET_RULES", "RULES", "register"]
