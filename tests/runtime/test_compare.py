"""autoshard.runtime.compare: which captured nodes hold memory not yet written."""

from __future__ import annotations

import torch

from autoshard.runtime.compare import _uninitialised
from autoshard.runtime.selfcheck import op_name


class _FilledSlices(torch.nn.Module):
    """DeepSeek-V2's key: a ``new_empty`` whose two slices are filled by ``copy_`` after slicing."""

    def forward(self, a, b):
        k = a.new_empty(*a.shape[:-1], a.shape[-1] + b.shape[-1])
        k[..., : a.shape[-1]].copy_(a)
        k[..., a.shape[-1]:].copy_(b)
        return k * 2


def test_a_slice_of_an_empty_tensor_is_uninitialised():
    """The slices were recorded before copy_ wrote them: their values are whatever the
    memory held (verify reported them as mismatches of inf); what reads the filled tensor is not."""
    gm = torch.export.export(_FilledSlices(), (torch.randn(2, 3), torch.randn(2, 2))).module()
    nodes = {op_name(n): n for n in gm.graph.nodes if n.op == "call_function"}
    assert _uninitialised(nodes["new_empty"]) and _uninitialised(nodes["slice"])
    assert not _uninitialised(nodes["mul"])
