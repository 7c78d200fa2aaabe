"""Client libraries on a sharded model (tests/test_clients.py): sentence-transformers'
``SentenceTransformer`` with its transformer module sharded, and TRL's ``SFTTrainer``
training a sharded causal LM. Each builds a tiny random model and a word-level
tokenizer in a temporary folder (no download), runs the client on the dense and the
sharded model alike, and returns the differences."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile

import torch

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "far", "big", "small", "red", "blue", "and", "is", "was"]
SENTENCES = ["the cat sat on the mat", "a dog ran far", "the big red dog is small", "blue cat and red dog",
             "a mat", "the dog was on a blue mat and the cat ran"]


def tokenizer_folder(path: str, kind: str = "bert") -> str:
    """A word-level tokenizer saved at ``path`` (BERT's special tokens, or a GPT-2-like
    one with an end-of-text token that pads)."""
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    if kind == "bert":
        vocab = os.path.join(path, "vocab.txt")
        with open(vocab, "w") as f:
            f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
        tok = BertTokenizerFast(vocab_file=vocab)
    else:
        ids = {w: i for i, w in enumerate(["<|endoftext|>", "<unk>", *WORDS])}
        t = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                      unk_token="<unk>")
    tok.save_pretrained(path)
    return path


@contextlib.contextmanager
def shared_folder(make):
    """A temporary folder rank 0 fills with ``make(path)`` and every rank reads
    (transformers' ``save_pretrained`` writes from the main process only)."""
    import torch.distributed as dist

    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    if dist.get_rank() == 0:
        make(path[0])
    dist.barrier()
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def sentence_transformer(rank: int, world: int, mode: str, depth=None, body: str = "bert") -> dict:
    """``SentenceTransformer([Transformer(tiny BERT), Pooling])``: its BERT sharded, then
    ``encode()`` (batches of other sizes and lengths than the capture's) against the dense
    model's; and a training step through the sharded module (the client's features, a
    cosine loss on the pooled embeddings): loss and every local gradient. ``body="distilbert"``:
    a DistilBERT, whose forward takes the ``token_type_ids`` the client hands it only
    through ``**kwargs``."""
    import autoshard
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel

    torch.set_num_threads(1)

    def make(d):
        tokenizer_folder(d, "bert")
        torch.manual_seed(0)
        if body == "distilbert":
            DistilBertModel(DistilBertConfig(vocab_size=len(WORDS) + 5, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                             max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                             pad_token_id=0)).save_pretrained(d)
            return
        BertModel(BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)).save_pretrained(d)

    with shared_folder(make) as d:
        body = Transformer(d)
        dense = SentenceTransformer(modules=[body, Pooling(body.get_embedding_dimension(), "mean")], device="cpu")
    st = copy.deepcopy(dense)
    features = st.preprocess(SENTENCES[:4])          # what encode() hands its first module
    example = {k: v for k, v in features.items() if isinstance(v, torch.Tensor)}
    st[0].model = autoshard.shard(st[0].model, mode=mode, depth=depth, example_inputs={**example, "return_dict": True})
    got = st.encode(SENTENCES, batch_size=3, convert_to_tensor=True)
    ref = dense.encode(SENTENCES, batch_size=3, convert_to_tensor=True)
    out = {"encode_err": (got - ref).abs().max().item(), "shape": tuple(got.shape),
           "signatures": st[0].model.signatures, "failures": []}
    # training through the client: the pooled embeddings of two sentence lists, a cosine loss
    pairs = (SENTENCES[:4], SENTENCES[2:6])
    losses = []
    for m in (st, dense):
        m.train()
        emb = [m(m.preprocess(p))["sentence_embedding"] for p in pairs]
        loss = (1 - torch.nn.functional.cosine_similarity(*emb)).mean()
        loss.backward()
        losses.append(loss)
    out["loss_err"] = (losses[0] - losses[1]).abs().item()
    sharded = st[0].model
    dparams = dict(dense[0].model.named_parameters())
    for pp in sharded.plan.params:
        g, dg = sharded.get_parameter(pp.name).grad, dparams[pp.name].grad
        if dg is None:          # unused by the loss (BERT's pooler under mean pooling)
            if g is not None and g.abs().max() > 0:
                out["failures"].append(f"grad {pp.name}: nonzero, dense has none")
            continue
        want = pp.spec.local(dg, sharded.mesh, rank)
        if g is None or not torch.allclose(g, want, atol=1e-5, rtol=1e-5):
            out["failures"].append(f"grad {pp.name}: " + ("missing" if g is None else f"{(g - want).abs().max():.3g}"))
    return out


def sft_trainer(rank: int, world: int, mode: str, out: str, steps: int = 3) -> dict:
    """TRL's ``SFTTrainer`` (as ``ShardedTrainer``'s mixin: no DDP, batches per data-parallel
    replica, global gradient norm) on a sharded tiny Llama, ``steps`` steps with TRL's own
    defaults where they bear (its fused LM head, gradient checkpointing, its collator), and
    the same batches on the dense model by hand: the loss (TRL's ``-log_probs.sum() /
    labelled tokens``) of every step, and the weights after the last one."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    import autoshard
    from autoshard.training.trainer import ShardedTrainer

    from models import torchrun_env

    torch.set_num_threads(1)
    with torchrun_env(rank, world):         # as under torchrun: Trainer sees a multi-process job
        with shared_folder(lambda d: tokenizer_folder(d, "gpt2")) as d:
            tok = transformers.AutoTokenizer.from_pretrained(d)
        g = torch.Generator().manual_seed(0)
        rows = [{"input_ids": torch.randint(2, len(WORDS) + 2, (8,), generator=g).tolist()} for _ in range(24)]
        ds = datasets.Dataset.from_list(rows)
        torch.manual_seed(0)
        dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=len(WORDS) + 2, max_position_embeddings=64, pad_token_id=0, eos_token_id=0))
        ids = torch.tensor([r["input_ids"] for r in rows[:4]])
        sharded = autoshard.shard(copy.deepcopy(dense), mode=mode, example_inputs={
            "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
        batches, losses = [], []

        class Trainer(ShardedTrainer, SFTTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, **kw):
                batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
                loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
                losses.append((loss[0] if return_outputs else loss).item())
                return loss

        args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-3,
                         report_to=[], use_cpu=True, bf16=False, save_strategy="no", lr_scheduler_type="constant",
                         warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, seed=0, optim="adamw_torch",
                         disable_tqdm=True, logging_steps=1, max_length=None)
        trainer = Trainer(model=sharded, args=args, train_dataset=ds, processing_class=tok)
        trainer.train()
        res = {"trainer": losses, "tags": sharded.model_tags, "checkpointing": sharded.is_gradient_checkpointing,
               "keys": sorted(batches[0]), "signatures": sharded.signatures,
               # TRL's num_tokens metric against the tokens of the batches this replica trained on
               "num_tokens": (trainer._total_train_tokens, sum(int(b["attention_mask"].sum()) for b in batches))}
        # the same batches on the dense model: the loss TRL computes, AdamW, the global norm clipped at 1
        opt = torch.optim.AdamW(dense.parameters(), lr=1e-3, weight_decay=0.0)
        ref = []
        for b in batches:
            kw = {k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "labels", "position_ids")}
            loss = dense(**kw).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            ref.append(loss.item())
        res["dense"] = ref
        full = sharded.full_state_dict(rank0_only=False)
        res["weights_err"] = max((full[n] - p).abs().max().item() for n, p in dense.state_dict().items() if n in full)
        return res
