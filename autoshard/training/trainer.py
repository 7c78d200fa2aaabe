"""Hugging Face ``Trainer`` for a sharded module (``pip install autoshard[trainer]``).

A :class:`~autoshard.module.ShardedModule` already does what ``Trainer`` would
add for several processes: it all-reduces the gradients its plan says to (over
``dp`` and the mesh axes that replicate a weight), returns the global mean
loss on every rank, and needs every tensor-parallel rank of a replica to see
the same batch. ``Trainer``'s own multi-process path does the opposite (DDP
around the model, a different batch per process), and the mechanism it offers
for tensor-parallel models (accelerate's ``ParallelismConfig``) refuses CPU
processes and expects DTensor parameters. :class:`ShardedTrainer` keeps
everything else of ``Trainer`` (optimizer, scheduler, accumulation, logging,
callbacks) and changes four things:

- the model is not wrapped (no DDP): autoshard reduces its gradients;
- the training batches are split by data-parallel replica, not by process:
  the TP ranks of a replica get the same rows (same shuffle seed on every rank);
- gradient clipping uses the global norm over all shards, each entry once
  (:func:`autoshard.training.train.clip_grad_norm_`);
- ``save_model`` writes a dense Hugging Face folder from every rank
  (:meth:`~autoshard.module.ShardedModule.save_pretrained`, collective), and a
  checkpoint during training is autoshard's sharded one (weights and optimizer,
  :func:`autoshard.training.train.save_state`) under ``checkpoint-<step>/autoshard``.

The loss is the model's mean (``num_items_in_batch`` is not passed: the module's
loss is already the mean over every replica's tokens).

Example (under ``torchrun``)::

    sharded = autoshard.shard(model, mode="1d")
    trainer = ShardedTrainer(model=sharded, args=TrainingArguments("out", use_cpu=True), train_dataset=ds)
    trainer.train()
    trainer.save_model("out/final")          # a folder AutoModelFor...from_pretrained loads
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, DistributedSampler

try:
    import transformers
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - transformers is a dependency
    raise ImportError("autoshard.training.trainer needs transformers") from e

from .train import clip_grad_norm_, save_state

__all__ = ["ShardedTrainer"]


class _Owned(torch.nn.Module):
    """The sharded module as ``Trainer`` runs it: a wrapper that is not the model, so
    ``Trainer`` does not hand the model to accelerate to be wrapped in DDP."""

    def __init__(self, sharded):
        super().__init__()
        self.sharded = sharded

    def forward(self, *args, **kwargs):
        return self.sharded(*args, **kwargs)


def _show_model_signature(sharded) -> None:
    """Give ``sharded.forward`` the model's own signature, as ``Trainer`` reads it to keep
    the dataset columns the model takes (``remove_unused_columns``)."""
    import inspect

    cls = sharded.model_class
    if cls is None or "__signature__" in getattr(sharded.forward, "__dict__", {}):
        return
    sig = inspect.signature(cls.forward)
    call = sharded.forward

    def forward(**kwargs):
        return call(**kwargs)

    forward.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n != "self"])
    object.__setattr__(sharded, "forward", forward)


class ShardedTrainer(Trainer):
    """``transformers.Trainer`` for a :class:`~autoshard.module.ShardedModule` (see the module doc)."""

    def __init__(self, model=None, *args, **kwargs):
        from ..module import ShardedModule

        if not isinstance(model, ShardedModule):
            raise TypeError(f"ShardedTrainer trains a ShardedModule (autoshard.shard(...)), got {type(model).__name__}")
        try:
            import accelerate  # noqa: F401
        except ImportError as e:
            raise ImportError("transformers.Trainer needs accelerate: pip install 'autoshard[trainer]'") from e
        _show_model_signature(model)
        super().__init__(model, *args, **kwargs)
        self.model_accepts_loss_kwargs = False      # the module's loss is already the global mean
        if hasattr(self, "_tp_size"):   # TRL's SFTTrainer: the tokens it gathers from every process,
            # divided by this, are its num_tokens; every rank of a replica sees the same rows
            self._tp_size = max(1, self.accelerator.num_processes // model.mesh.dp)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return _Owned(self.model) if training else self.model

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        mesh, coords = self.model.mesh, self.model.coords
        sampler = DistributedSampler(self.train_dataset, num_replicas=mesh.dp, rank=coords.get("dp", 0),
                                     shuffle=True, seed=self.args.seed, drop_last=self.args.dataloader_drop_last)
        collate = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, sampler=sampler,
                          collate_fn=collate, drop_last=self.args.dataloader_drop_last,
                          num_workers=self.args.dataloader_num_workers)

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the dense Hugging Face folder (collective: every rank calls it, rank 0 writes)."""
        self.model.save_pretrained(output_dir or self.args.output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        folder = os.path.join(self._get_output_dir(trial=trial),
                              f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        save_state(self.model, os.path.join(folder, "autoshard"), opt, step=self.state.global_step)
        if self.args.should_save:
            self.state.save_to_json(os.path.join(folder, transformers.trainer_utils.TRAINER_STATE_NAME
                                                 if hasattr(transformers.trainer_utils, "TRAINER_STATE_NAME")
                                                 else "trainer_state.json"))
