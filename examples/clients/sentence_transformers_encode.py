"""sentence-transformers with its transformer module sharded: ``encode()`` as dense.

A ``SentenceTransformer`` runs its first module's model (here a BERT) with the
tokenized batch and ``return_dict=True``; swap that model for its sharded module and
every other part of the client stays as it is. A real model goes the same way
(``SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")``); here a tiny random
BERT and a word-level tokenizer are made in a temporary folder, so nothing is
downloaded. Exit code 1 if the embeddings differ from dense by more than 1e-5.

    pip install 'autoshard[clients]'
    torchrun --nproc-per-node 2 examples/clients/sentence_transformers_encode.py
"""

import copy
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from transformers import BertConfig, BertModel, BertTokenizerFast

import autoshard

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "far", "big", "red", "blue", "and", "is"]
SENTENCES = ["the cat sat on the mat", "a dog ran far", "the big red dog is blue", "a cat and a dog"]


def tiny_folder(path):
    """A random 2-layer BERT and its tokenizer, as a Hugging Face folder."""
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=os.path.join(path, "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64)).save_pretrained(path)


def main():
    dist.init_process_group("gloo")
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)        # rank 0 writes the folder, every rank reads it
    if dist.get_rank() == 0:
        tiny_folder(path[0])
    dist.barrier()
    body = Transformer(path[0])
    dense = SentenceTransformer(modules=[body, Pooling(body.get_embedding_dimension(), "mean")], device="cpu").eval()
    model = copy.deepcopy(dense)
    # shard the transformer's model; the example inputs are what the client hands it
    features = {k: v for k, v in model.preprocess(SENTENCES).items() if isinstance(v, torch.Tensor)}
    model[0].model = autoshard.shard(model[0].model, mode="1d", example_inputs={**features, "return_dict": True})
    got = model.encode(SENTENCES, batch_size=3, convert_to_tensor=True)
    ref = dense.encode(SENTENCES, batch_size=3, convert_to_tensor=True)
    err = (got - ref).abs().max().item()
    if dist.get_rank() == 0:
        print(model[0].model)
        print(f"embeddings {tuple(got.shape)}, largest difference to dense {err:.2e}")
    dist.destroy_process_group()
    raise SystemExit(0 if err <= 1e-5 else 1)


if __name__ == "__main__":
    main()
