"""What a :class:`~autoshard.module.ShardedModule` does besides running its graph, one
concern per module, each taking the module as torchtitan's ``apply_*`` functions take
the model (docs/design.md, "Layers"):

- :mod:`.grads`: its gradients' sync (one all-reduce per parameter, or bucketed and
  overlapped with backward) and their global norm (torch's ``clip_grad_norm_`` included);
- :mod:`.compile`: ``compile()``'s settings, the compiled graphs, CUDA graphs refused;
- :mod:`.eager`: the eager graph passes (weight prefetching, asynchronous TP);
- :mod:`.generation`: ``generate()`` and its step graphs' plans;
- :mod:`.state`: state dicts in (any layout) and Hugging Face folders out;
- :mod:`.compare`: node by node against the dense model.

:mod:`autoshard.module` keeps the call path (inputs checked, the graph found or
captured, the batch padded, the graph run) and one thin method per feature above.
"""
