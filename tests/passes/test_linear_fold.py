"""passes/linear_fold.py: ``x @ W.T`` of a parameter becomes a Linear, same values."""

from __future__ import annotations

import torch

import models
from autoshard.passes.annotate import annotate
from autoshard.passes.capture import capture
from autoshard.passes.linear_fold import fold_transposed_weights


def test_falcon_matmuls_become_linears_with_the_same_values():
    """Falcon multiplies by ``weight.T`` in Python: after the fold every such matmul is
    an ``aten.linear`` annotated as a Linear, and logits, loss and every gradient
    are bit-equal to the captured graph's."""
    model = models.build("falcon")
    inputs = models.batch("falcon")
    cap = capture(model, example_inputs=inputs)
    folded = fold_transposed_weights(cap)
    assert folded.module is not cap.module and fold_transposed_weights(folded) is folded
    g = folded.module.graph
    assert not any(n.target == torch.ops.aten.numpy_T.default for n in g.nodes)
    lin = [n for n in g.nodes if n.target == torch.ops.aten.linear.default]
    ann = annotate(folded.module)
    assert len(lin) == 2 * 4 + 1 and {ann[n.name].kind for n in lin} == {"linear"}
    models.assert_same_values(cap, folded, inputs)
