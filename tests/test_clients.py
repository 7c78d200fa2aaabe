"""Client libraries on a sharded model (issue 57; tests/clients.py): sentence-transformers'
``SentenceTransformer`` with its transformer module sharded (``encode()`` and a training
step equal to dense), and TRL's ``SFTTrainer`` (mixed with ``ShardedTrainer``) on a
sharded causal LM: its steps' losses and the weights after them equal the same steps on
the dense model. Skipped where the client is not installed (``pip install
'autoshard[clients]'``)."""

from __future__ import annotations

import pytest

import clients
from dist_pool import get_pool


@pytest.mark.extended
@pytest.mark.parametrize("mode,world", [("1d", 2), ("2d", 4)])
def test_sentence_transformer_encodes_as_dense(mode, world):
    pytest.importorskip("sentence_transformers")
    for rank, r in enumerate(get_pool(world, timeout=600).run(clients.sentence_transformer, mode)):
        assert r["encode_err"] <= 1e-5 and r["shape"] == (6, 32), r
        assert r["loss_err"] <= 1e-5 and r["failures"] == [], f"rank {rank}: {r}"
        # the client passes return_dict=True: a constant of the one graph, which serves every batch
        assert len(r["signatures"]) == 1 and "return_dict=True" in r["signatures"][0], r["signatures"]


@pytest.mark.extended
def test_sentence_transformer_with_a_distilbert_body_encodes_as_dense():
    """The client hands DistilBERT token_type_ids, which its forward takes only through
    **kwargs: an input of the graph like the others (torch.export failed on it)."""
    pytest.importorskip("sentence_transformers")
    for rank, r in enumerate(get_pool(2, timeout=600).run(clients.sentence_transformer, "1d", None, "distilbert")):
        assert r["encode_err"] <= 1e-5 and r["shape"] == (6, 32), r
        assert r["loss_err"] <= 1e-5 and r["failures"] == [], f"rank {rank}: {r}"
        assert len(r["signatures"]) == 1 and "token_type_ids" in r["signatures"][0], r["signatures"]


@pytest.mark.extended
@pytest.mark.parametrize("mode,world", [("1d", 2), ("2d", 4)])
def test_sft_trainer_steps_equal_dense(mode, world, tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    res = get_pool(world, timeout=600).run(clients.sft_trainer, mode, str(tmp_path))
    r = res[0]
    assert len(r["trainer"]) == 3
    for a, b in zip(r["trainer"], r["dense"]):
        assert a == pytest.approx(b, abs=1e-5), r
    assert r["weights_err"] <= 1e-5, r
    assert all(x["trainer"] == r["trainer"] for x in res)        # one loss on every rank
    assert r["tags"] == ["trl", "sft"] and r["checkpointing"], r   # add_model_tags, gradient checkpointing
    assert r["num_tokens"][0] == r["num_tokens"][1], r              # not counted once per tensor-parallel rank


def test_token_log_probs_match_the_models_loss():
    """``fused_lm_head=True`` (TRL): the mean negative log-probability of the labelled next
    tokens is the causal LM's own loss."""
    import torch

    from autoshard.hf_face import token_log_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g)
    labels = torch.randint(0, 11, (2, 6), generator=g)
    labels[0, :2] = -100
    got = token_log_probs({"logits": logits}, labels)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(got.loss, ref)
    assert got.label_mask.sum() == 9 and (got.log_probs[~got.label_mask] == 0).all()
