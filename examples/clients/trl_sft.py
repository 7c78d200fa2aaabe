"""TRL's ``SFTTrainer`` on a sharded causal LM.

``ShardedTrainer`` mixed in ahead of ``SFTTrainer`` keeps everything TRL does (its
dataset preparation, collator, loss through its fused LM head, gradient checkpointing,
model tags) and changes what a sharded module needs: no DDP wrapper, batches per
data-parallel replica (every tensor-parallel rank gets the same rows), the global
gradient norm. A real model goes the same way (``from_pretrained``, then
``autoshard.shard``); here a tiny random Llama and a word-level tokenizer, nothing
downloaded.

    pip install 'autoshard[clients]'
    torchrun --nproc-per-node 2 examples/clients/trl_sft.py
"""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import torch
import torch.distributed as dist
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig, SFTTrainer

import autoshard
from autoshard.training.trainer import ShardedTrainer

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "ran", "far", "big", "red", "blue", "and", "is"]


class ShardedSFTTrainer(ShardedTrainer, SFTTrainer):
    """SFTTrainer for a sharded module: ShardedTrainer's overrides first."""


def main():
    dist.init_process_group("gloo")
    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<unk>", *WORDS])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_list([{"text": " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (7,), generator=g))}
                                     for _ in range(32)])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(vocab), pad_token_id=0, eos_token_id=0))
    sharded = autoshard.shard(model, mode="1d")
    out = tempfile.mkdtemp()
    args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3, use_cpu=True,
                     bf16=False, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = ShardedSFTTrainer(model=sharded, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    trainer.save_model(f"{out}/final")          # collective: a dense Hugging Face folder
    if dist.get_rank() == 0:
        print(sharded, "tags:", sharded.model_tags, "checkpointing:", sharded.is_gradient_checkpointing)
        print("saved", sorted(os.listdir(f"{out}/final")))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
