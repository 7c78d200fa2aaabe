"""Where the input, weight and bias of a Linear-like ATen op sit: filed with the
matmul family in :mod:`autoshard.policies.ops.matmul`; this path is kept for the
passes that import it.
"""

from __future__ import annotations

from .ops.matmul import grouped_offs_spec, linear_operands, rows_whole

__all__ = ["grouped_offs_spec", "linear_operands", "rows_whole"]
