"""transformers.Trainer on a sharded module (autoshard/training/trainer.py): 5 steps equal
autoshard's own loop (autoshard.training.train.train) and the dense model, step by step."""

from __future__ import annotations

import copy

import pytest
import torch

from dist_pool import get_pool
from models import build, torchrun_env

pytest.importorskip("accelerate")


def _rows(n=40, s=8):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (s,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones(s, dtype=torch.long), "labels": ids.clone()})
    return out


def _loop(model, batches, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        clip(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _trainer_vs_loop(rank, world, mode, out, steps=5):
    import transformers
    from torch.utils.data import DistributedSampler

    import autoshard
    from autoshard.training.train import train as autoshard_train
    from autoshard.training.trainer import ShardedTrainer

    torch.set_num_threads(1)
    with torchrun_env(rank, world):         # as under torchrun: Trainer sees a multi-process job
        ds = _rows()
        dense = build("llama")
        example = transformers.default_data_collator(ds[:4])
        for_trainer = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=example)
        for_loop = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs=example)
        seen = []

        class Recording(ShardedTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, **kw):
                loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
                seen.append((loss[0] if return_outputs else loss).item())
                return loss

        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps,
                                              learning_rate=1e-3, report_to=[], use_cpu=True,
                                              save_strategy="steps", save_steps=steps,
                                              lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
                                              weight_decay=0.0, seed=0, optim="adamw_torch", disable_tqdm=True)
        trainer = Recording(model=for_trainer, args=args, train_dataset=ds)
        kind = str(trainer.accelerator.distributed_type)
        trainer.train()
        trainer.save_model(f"{out}/final")                      # collective: a dense HF folder
        order = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
        batches = [transformers.default_data_collator([ds[i] for i in order[4 * k:4 * k + 4]]) for k in range(steps)]
        own = autoshard_train(for_loop, batches, steps, clip=1.0, log=False,
                              optimizer=torch.optim.AdamW(for_loop.parameters(), lr=1e-3, weight_decay=0.0))
        ref = _loop(dense, batches, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        return {"trainer": seen, "loop": own, "dense": ref, "kind": kind}


@pytest.mark.parametrize("mode,world", [("1d", 2), pytest.param("2d", 4, marks=pytest.mark.slow)])
def test_trainer_steps_equal_the_own_loop_and_dense(mode, world, tmp_path):
    import transformers

    res = get_pool(world).run(_trainer_vs_loop, mode, str(tmp_path))
    r = res[0]
    assert "MULTI_CPU" in r["kind"], r["kind"]
    assert len(r["trainer"]) == 5
    for a, b, c in zip(r["trainer"], r["loop"], r["dense"]):
        assert a == pytest.approx(b, abs=1e-5) and a == pytest.approx(c, abs=1e-5), r
    assert all(x["trainer"] == r["trainer"] for x in res)        # one loss on every rank
    # the step-5 checkpoint is autoshard's sharded one; save_model wrote a folder transformers loads
    assert (tmp_path / "checkpoint-5" / "autoshard" / "manifest.json").exists()
    assert (tmp_path / "checkpoint-5" / "trainer_state.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert type(model).__name__ == "LlamaForCausalLM"
