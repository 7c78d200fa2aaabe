"""Fine-tune → Hugging Face folder (autoshard/io/export.py, gather.save_pretrained,
sharded_format): a classifier fine-tuned from a checkpoint whose config names the
bare encoder (as all-MiniLM-L6-v2's does) saves, exports and reloads as the
classifier, with the sharded model's logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import models
from dist_pool import get_pool


def _classifier():
    import transformers

    _, _, kw = models.TINY["bert"]
    torch.manual_seed(0)
    cfg = transformers.BertConfig(**kw, num_labels=3, architectures=["BertModel"])
    return transformers.BertForSequenceClassification(cfg).train()


def _batch(b=4, s=8):
    g = torch.Generator().manual_seed(5)
    return {"input_ids": torch.randint(0, 128, (b, s), generator=g),
            "attention_mask": torch.ones(b, s, dtype=torch.long), "labels": torch.tensor([0, 1, 2, 1][:b])}


def _fine_tune_and_save(rank, world, ckpt, hf):
    import autoshard

    torch.set_num_threads(1)
    sharded = autoshard.shard(_classifier(), mode="1d", example_inputs=_batch())
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    for _ in range(2):
        sharded(**_batch()).loss.backward()
        opt.step()
        opt.zero_grad()
    sharded.save_checkpoint(ckpt, opt)
    sharded.save_pretrained(hf)
    with torch.no_grad():
        return sharded(**_batch()).logits


def _reload(rank, world, ckpt):
    import autoshard

    torch.set_num_threads(1)
    sharded = autoshard.load_checkpoint(ckpt, mode="1d")     # the checkpoint alone: config and class from it
    with torch.no_grad():
        return type(sharded.config).__name__, sharded.plan.model, sharded(**_batch()).logits


def test_fine_tune_exports_a_folder_transformers_loads(tmp_path):
    import transformers

    from autoshard.cli import main
    from autoshard.io.export import export_checkpoint

    ckpt, hf, out = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "exported"
    logits = get_pool(2).run(_fine_tune_and_save, str(ckpt), str(hf))[0]
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
    export_checkpoint(ckpt, out)                              # one process, no process group
    assert main(["export", str(ckpt), str(tmp_path / "cli")]) == 0
    for folder in (hf, out, tmp_path / "cli"):
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
        with torch.no_grad():
            got = model(**_batch()).logits
        torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-5)
    # the checkpoint alone rebuilds the classifier (not the BertModel of the original config)
    cfg_name, cls_name, again = get_pool(2).run(_reload, str(ckpt))[0]
    assert cls_name == "BertForSequenceClassification"
    torch.testing.assert_close(again, logits, atol=1e-5, rtol=1e-5)


def test_export_refuses_what_is_not_a_complete_checkpoint(tmp_path):
    from autoshard.ir.errors import CheckpointError
    from autoshard.io.export import export_checkpoint

    with pytest.raises(CheckpointError, match="no such directory"):
        export_checkpoint(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError):
        export_checkpoint(tmp_path / "half", tmp_path / "out")
    assert not (tmp_path / "out").exists()                  # nothing half-written
