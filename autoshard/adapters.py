"""peft adapters on a sharded model: ``shard(peft_model)`` (docs/design.md, "Frozen
parameters and LoRA").

A ``PeftModel`` is sharded through the model peft injected its layers into
(``peft_model.get_base_model()``): each LoRA ``A`` and ``B`` is an ordinary Linear of
the captured graph, so its layout comes from propagation like any other op, and the
frozen base is a constant for the backward (no gradient, no gradient collective, no
optimizer state). This module is the only place that knows peft; the passes and
policies never see a peft class. It

- recognises a peft wrapper by what it offers (``peft_config``, ``get_base_model``),
  refuses a method outside the LoRA family (prefix or prompt tuning, IA3, ...) and a
  quantized base, each by name, before any collective;
- keeps a skeleton of the wrapper on the meta device (its configs and names, no
  weights) to re-inject the same adapters into a model rebuilt from its config (a
  new input signature, generate()'s step graphs) and to write adapters as peft does;
- writes :meth:`~autoshard.module.ShardedModule.save_pretrained` of a sharded peft
  model as ``peft_model.save_pretrained`` would (``adapter_config.json`` +
  ``adapter_model.safetensors``, dense), and merges the adapters into the base
  weights for a dense export (``merge_and_unload``).

Example (under ``torchrun --nproc-per-node 2``)::

    from peft import LoraConfig, get_peft_model
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    sharded = autoshard.shard(peft_model, mode="1d")       # LoRA A / B split from the graph
    ...                                                     # train the trainable slices
    sharded.save_pretrained("adapter")                      # what PeftModel.from_pretrained loads
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .ir.errors import ConfigError

__all__ = ["Adapters", "export_merged", "is_peft_model", "refuse_quantized", "unwrap"]

# peft's methods autoshard shards: LoRA (with rsLoRA, DoRA, fan_in_fan_out, several adapters)
LORA_FAMILY = ("LORA",)


def is_peft_model(model) -> bool:
    """Whether ``model`` is a peft wrapper (``PeftModel`` and its task subclasses)."""
    return isinstance(getattr(model, "peft_config", None), dict) and callable(getattr(model, "get_base_model", None)) \
        and hasattr(model, "active_adapters")


def refuse_quantized(model) -> None:
    """Raise a :class:`ConfigError` naming the quantization where ``model`` (or the model
    under a peft wrapper) holds quantized weights: autoshard slices dense weights."""
    inner = model.get_base_model() if is_peft_model(model) else model
    config = getattr(inner, "config", None)
    q = getattr(config, "quantization_config", None) or getattr(inner, "hf_quantizer", None)
    bits = [b for b in ("4bit", "8bit") if getattr(inner, f"is_loaded_in_{b}", False)]
    if q is None and not bits:
        return
    method = getattr(q, "quant_method", None) or (q.get("quant_method") if isinstance(q, dict) else None)
    what = " ".join(x for x in (str(getattr(method, "value", method or "")), "/".join(bits)) if x) or type(q).__name__
    raise ConfigError(f"shard(): the model is quantized ({what}); autoshard slices dense weights and cannot split "
                      f"quantized ones. Load the base model unquantized (torch_dtype=torch.bfloat16 or float32) "
                      f"and shard that: tensor parallelism divides its bytes by the number of ranks")


@dataclass
class Adapters:
    """The peft adapters of a sharded model: what re-injects them and writes them.

    ``configs``: adapter name -> peft config; ``active``: the active adapters;
    ``skeleton``: the peft wrapper on the meta device; ``prefix``: what peft puts
    before an inner parameter name in its own state dict; ``idle``: dense values of
    parameters the graph does not use (inactive adapters), under inner names."""

    configs: dict
    active: tuple
    skeleton: torch.nn.Module
    prefix: str = "base_model.model."
    idle: dict = field(default_factory=dict)

    def inject(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (rebuilt from its config, on meta) with the same adapters injected
        under the same names, the same ones active; returns the injected model (peft's
        ``get_base_model()``)."""
        from peft import PeftModel

        names = list(self.configs)
        wrapped = PeftModel(model, copy.deepcopy(self.configs[names[0]]), adapter_name=names[0])
        for n in names[1:]:
            wrapped.add_adapter(n, copy.deepcopy(self.configs[n]))
        wrapped.base_model.set_adapter(list(self.active) if len(self.active) > 1 else self.active[0])
        return wrapped.get_base_model()

    def saved_names(self, selected=None) -> dict[str, list[str]]:
        """Adapter name -> the inner parameter names peft saves for it (its LoRA
        matrices, DoRA magnitudes, ``modules_to_save`` copies)."""
        from peft.utils import get_peft_model_state_dict

        state = self.skeleton.state_dict(keep_vars=True)
        by_id = {id(v): k for k, v in state.items()}
        out = {}
        for a in selected or list(self.configs):
            kept = get_peft_model_state_dict(self.skeleton, state_dict=state, adapter_name=a,
                                             save_embedding_layers=False)
            out[a] = [by_id[id(v)][len(self.prefix):] for v in kept.values() if id(v) in by_id]
        return out

    def save(self, sharded, path, selected=None) -> None:
        """Write the adapters as ``peft_model.save_pretrained(path)`` does, gathered and
        dense (collective: call on every rank; rank 0 writes)."""
        import torch.distributed as dist

        from .io.gather import iter_full_state_dict

        names = {n for ns in self.saved_names(selected).values() for n in ns}
        held = set(sharded.plan.params_by_name())
        missing = sorted(names - held - set(self.idle))
        if missing:
            raise ConfigError(f"save_pretrained: adapter tensors {missing[:4]} are neither in the sharded module nor "
                              f"kept aside; was the model changed after shard()?")
        dense = dict(iter_full_state_dict(sharded, rank0_only=True, only=names & held, copy=True))
        if sharded.rank == 0:
            dense.update({n: t.detach().clone() for n, t in self.idle.items() if n in names})
            state = {self.prefix + n: t.cpu() for n, t in dense.items()}
            self.skeleton.save_pretrained(str(path), state_dict=state, selected_adapters=selected,
                                          save_embedding_layers=False)
        if dist.is_initialized():
            dist.barrier()

    def write_configs(self, path) -> None:
        """Write the active adapter's peft config (``adapter_config.json``) into a sharded
        checkpoint folder, so that ``autoshard export`` merges the adapter (:func:`export_merged`)."""
        if len(self.active) == 1:
            self.configs[self.active[0]].save_pretrained(str(path))

    def merged(self, dense: dict) -> dict:
        """The base model's dense state dict with the active adapters merged into the base
        weights (peft's ``merge_and_unload``), from ``dense`` (inner names -> tensors)."""
        model = copy.deepcopy(self.skeleton)
        state = {self.prefix + n: t for n, t in {**self.idle, **dense}.items()}
        model.load_state_dict(state, strict=False, assign=True)
        return model.merge_and_unload().state_dict()


def unwrap(model) -> tuple[torch.nn.Module, Adapters | None]:
    """``(the model to capture, its adapters)``: a peft wrapper's injected model and
    :class:`Adapters`, or ``(model, None)`` for any other model. Raises a
    :class:`ConfigError` for a peft method outside the LoRA family or a quantized base."""
    refuse_quantized(model)
    if not is_peft_model(model):
        return model, None
    for name, cfg in model.peft_config.items():
        kind = str(getattr(cfg.peft_type, "value", cfg.peft_type))
        if kind not in LORA_FAMILY:
            how = (" (it feeds virtual tokens through the attention cache, which the captured graph does not take)"
                   if getattr(cfg, "is_prompt_learning", False) else "")
            raise ConfigError(f"shard(): peft method {kind} (adapter {name!r}) is not supported{how}; autoshard "
                              f"shards peft's LoRA family ({', '.join(LORA_FAMILY)}: LoRA, rsLoRA, DoRA). Merge the "
                              f"adapter into the base (merge_and_unload()) and shard that, or use a LoraConfig")
    inner = model.get_base_model()
    active = tuple(model.active_adapters)
    meta = {id(t): _on_meta(t) for t in list(model.parameters()) + list(model.buffers())}
    skeleton = copy.deepcopy(model, memo=meta)
    in_graph = _used_by_active(inner, active, tuple(model.peft_config))
    idle = {n: t.detach().clone() for n, t in inner.named_parameters(remove_duplicate=False) if n not in in_graph}
    return inner, Adapters(configs=dict(model.peft_config), active=active, skeleton=skeleton, idle=idle)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    m = torch.empty_like(t, device="meta")
    return torch.nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else m


def _used_by_active(inner: torch.nn.Module, active: tuple, adapters: tuple) -> set[str]:
    """Inner parameter names outside every inactive adapter (peft keys an adapter's
    modules by its name: ``lora_A.<name>.weight``)."""
    idle = set(adapters) - set(active)
    return {n for n, _ in inner.named_parameters(remove_duplicate=False) if not idle & set(n.split("."))}


def export_merged(path, out, *, model_class=None, max_shard_size="5GB"):
    """``autoshard export`` of a checkpoint saved from a sharded peft model (its folder holds
    ``adapter_config.json``): the dense Hugging Face folder of the base with the adapter
    merged into its weights (peft's ``merge_and_unload``), in one process. Returns ``out``."""
    import tempfile
    from pathlib import Path

    from peft import PeftConfig, PeftModel
    from safetensors.torch import load_file

    from .io.builder import build_meta, load_config, resolve_class
    from .io.export import export_checkpoint
    from .io.sharded_format import checkpoint_class, read_manifest

    path, out = Path(path), Path(out)
    with tempfile.TemporaryDirectory(prefix="autoshard-unmerged-", dir=out.parent if out.parent.exists() else None) \
            as tmp:
        export_checkpoint(path, tmp, model_class=model_class, max_shard_size="1000GB")
        config = load_config(path)
        cls = resolve_class(config, checkpoint_class(read_manifest(path), model_class, config))
        built = build_meta(config, model_class=cls)
        wrapped = PeftModel(built.model, PeftConfig.from_pretrained(str(path)))
        state = load_file(str(Path(tmp) / "model.safetensors"))
        wrapped.get_base_model().load_state_dict(state, strict=False, assign=True)
    for name, buf in built.buffers.items():     # non-persistent buffers: the constructor's values
        mod, _, attr = name.rpartition(".")
        owner = wrapped.get_base_model().get_submodule(mod) if mod else wrapped.get_base_model()
        if owner._buffers.get(attr) is not None and owner._buffers[attr].is_meta:
            owner._buffers[attr] = buf
    merged = wrapped.merge_and_unload()
    left = [n for n, t in list(merged.named_parameters()) + list(merged.named_buffers()) if t.is_meta]
    if left:
        raise ConfigError(f"export: {path} holds no values for {left[:4]}; was it saved from this model?")
    merged.save_pretrained(str(out), max_shard_size=max_shard_size)
    return out
