"""autoshard.planning.shrink: shrunk configs keep every split the real layout makes.

Configs only (no processes): residues and ``check_dims`` agree with the real
config, the shrunk model builds on the meta device with few parameters, the
layer pattern and the routing survive, and two shrunk configs plan."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

import autoshard
from autoshard.ir.errors import ConfigError
from autoshard.planning.shrink import Shrunk, shrink
from autoshard.planning.validate import check_dims, dims_of
from autoshard.policies import make_policy

LAYOUTS = {"1d@8": ("1d", 8, None), "2d@4": ("2d", 4, None), "2.5d@8-d2": ("2.5d", 8, 2), "3d@8": ("3d", 8, None)}


def _policy(layout):
    mode, world, depth = LAYOUTS[layout]
    return make_policy(mode, world, depth)


def llama2_7b():
    return tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32000)


def llama3_70b():
    return tf.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, bos_token_id=128000, eos_token_id=128001)


def gpt2():
    return tf.GPT2Config()                    # vocab 50257 divides nothing


def mixtral():
    return tf.MixtralConfig()                 # 8 experts, top 2, 32 heads over 8 kv


def gemma2():
    return tf.Gemma2Config()                  # layer_types alternate sliding / full


def gemma3():
    return tf.Gemma3TextConfig()              # five sliding layers, then a full one


def qwen3_moe():
    return tf.Qwen3MoeConfig(decoder_sparse_step=2, mlp_only_layers=[0, 1])


def deepseek_v3():
    return tf.DeepseekV3Config()              # first_k_dense_replace=3, 256 experts in 8 groups, MLA


def t5():
    return tf.T5Config()


def bert():
    return tf.BertConfig()                    # 12 heads: not a multiple of 8


# (config, AutoModel class building it)
CONFIGS = {"llama2-7b": (llama2_7b, tf.AutoModelForCausalLM), "llama3-70b": (llama3_70b, tf.AutoModelForCausalLM),
           "gpt2": (gpt2, tf.AutoModelForCausalLM), "mixtral": (mixtral, tf.AutoModelForCausalLM),
           "gemma2": (gemma2, tf.AutoModelForCausalLM), "gemma3": (gemma3, tf.AutoModelForCausalLM),
           "qwen3-moe": (qwen3_moe, tf.AutoModelForCausalLM), "deepseek-v3": (deepseek_v3, tf.AutoModelForCausalLM),
           "t5": (t5, tf.AutoModelForSeq2SeqLM), "bert": (bert, tf.AutoModelForMaskedLM)}

CASES = [("llama2-7b", layout) for layout in LAYOUTS] + \
        [(name, "1d@8") for name in CONFIGS if name != "llama2-7b"] + \
        [("llama3-70b", "2d@4"), ("gpt2", "3d@8"), ("gpt2", "2.5d@8-d2"), ("mixtral", "3d@8"), ("t5", "2d@4"),
         ("bert", "2d@4"), ("deepseek-v3", "2d@4")]


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{n}-{l}" for n, l in CASES])
def test_every_split_is_kept(name, layout):
    real, pol = CONFIGS[name][0](), _policy(layout)
    out = shrink(real, pol)
    splits = pol.dim_splits()[0]
    before, after = dims_of(real), dims_of(out.config)
    assert before.keys() == after.keys()
    for what, n in before.items():
        s = math.lcm(splits.get(what, 1), pol.vocab_multiple()) if what == "vocab_size" else splits.get(what, 1)
        assert after[what] % s == n % s, (what, n, after[what], s)
        assert after[what] >= s or n < s, (what, n, after[what], s)
        assert after[what] <= n
    assert [(p.what, p.error) for p in check_dims(out.config, pol)] == \
        [(p.what, p.error) for p in check_dims(real, pol)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_shrunk_model_builds_small(name):
    make, auto = CONFIGS[name]
    out = shrink(make(), _policy("1d@8"))
    with torch.device("meta"):
        model = auto.from_config(out.config)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000, out.describe()
    assert type(out.config) is type(make())


def test_the_real_config_is_left_alone():
    real = llama2_7b()
    before = real.to_dict()
    out = shrink(real, _policy("1d@8"))
    assert real.to_dict() == before and out.config is not real
    assert isinstance(out, Shrunk) and all(getattr(out.config, a.split(".")[-1]) == new for a, _, new in out.changes)


def test_llama_2_7b_at_1d():
    out = shrink(llama2_7b(), _policy("1d@8"))
    c = out.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size) == (8, 8, 8, 64)
    assert (c.intermediate_size, c.vocab_size, c.num_hidden_layers) == (176, 64, 2)
    assert out.describe().startswith("num_attention_heads 32→8, num_key_value_heads 32→8, head_dim 128→8, "
                                     "hidden_size 4096→64")
    kept = {a for a, _, _ in out.changes}
    assert "max_position_embeddings" not in kept and c.rope_parameters == llama2_7b().rope_parameters


def test_gqa_keeps_its_kv_heads_and_a_group_of_two():
    c = shrink(llama3_70b(), _policy("1d@8")).config
    assert (c.num_key_value_heads, c.num_attention_heads) == (8, 16)       # 8 kv ≤ split 8: kept; group 8 → 2
    c = shrink(llama3_70b(), _policy("2d@4")).config
    assert (c.num_key_value_heads, c.num_attention_heads) == (2, 4)        # kv ≡ 8 (mod 2), group 2


def test_mqa_stays_mqa():
    real = tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=4, num_attention_heads=32,
                          num_key_value_heads=1, vocab_size=32000)
    c = shrink(real, _policy("1d@8")).config
    assert c.num_key_value_heads == 1 and c.num_attention_heads == 8        # 8 heads: the least multiple of 8 from 2


def test_heads_that_do_not_divide_stay_uneven():
    """12 heads over 8 ranks: 1d pads them (a warning, not an error); the shrunk copy keeps
    the same uneven split, so verify proves the padded layout."""
    real = bert()                                                          # 12 heads over 8 ranks
    out = shrink(real, _policy("1d@8"))
    assert out.config.num_attention_heads == 12
    found = [(p.what, p.error) for p in check_dims(out.config, _policy("1d@8"))]
    assert ("num_attention_heads", False) in found and not any(e for _, e in found)


def test_gpt2_vocab_and_tokens():
    out = shrink(gpt2(), _policy("1d@8"))
    c = out.config
    assert c.vocab_size == 65 and c.n_inner is None                        # 50257 ≡ 1 (mod 8), least from 64
    assert c.bos_token_id == c.eos_token_id == 64                          # 50256 → vocab'-1, one id stays one id
    assert ("eos_token_id", 50256, 64) in out.changes
    assert shrink(gpt2(), _policy("3d@8")).config.vocab_size == 65         # padded to q² = 4: 50257 ≡ 1 (mod 4)


def test_distinct_token_ids_stay_distinct():
    real = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=1000, bos_token_id=998, eos_token_id=999, pad_token_id=3)
    c = shrink(real, _policy("1d@8")).config
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (62, 63, 3)


def test_explicit_head_dim_and_hidden():
    c = shrink(gemma3(), _policy("1d@8")).config                            # head_dim 256, hidden 2304 ≠ 8·256
    assert (c.head_dim, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (8, 32, 8, 4)
    c = shrink(gemma3(), _policy("2d@4")).config
    assert c.hidden_size % 2 == 0 and c.hidden_size >= 32


def test_partial_rotary_keeps_an_even_rotary_part():
    real = tf.PhiConfig(hidden_size=2560, intermediate_size=10240, num_hidden_layers=4, num_attention_heads=32,
                        vocab_size=51200, partial_rotary_factor=0.4)
    c = shrink(real, _policy("1d@8")).config
    rot = int(c.hidden_size // c.num_attention_heads * 0.4)
    assert rot >= 2 and rot % 2 == 0


def test_layer_patterns():
    c = shrink(gemma2(), _policy("1d@8")).config
    assert c.num_hidden_layers == 2 and c.layer_types == ["sliding_attention", "full_attention"]
    c = shrink(gemma3(), _policy("1d@8")).config
    assert c.num_hidden_layers == 6 and c.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    c = shrink(deepseek_v3(), _policy("1d@8")).config
    assert c.num_hidden_layers == 4 and c.first_k_dense_replace == 3       # three dense, then MoE
    c = shrink(qwen3_moe(), _policy("1d@8")).config
    assert c.num_hidden_layers == 4 and c.mlp_only_layers == [0, 1]        # two dense, then a period of 2
    c = shrink(llama2_7b(), _policy("1d@8"), min_layers=3).config
    assert c.num_hidden_layers == 3
    real = tf.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    assert shrink(real, _policy("1d@8")).config.num_hidden_layers == 1     # never more than the real count


def test_t5_encoder_and_decoder():
    out = shrink(t5(), _policy("1d@8"))
    c = out.config
    assert (c.num_heads, c.d_kv, c.d_model, c.num_layers, c.num_decoder_layers) == (8, 8, 64, 2, 2)
    assert c.d_ff == 256 and c.vocab_size == 64 and (c.pad_token_id, c.eos_token_id) == (0, 1)
    assert ("d_kv", 64, 8) in out.changes                                  # head_dim resolved to d_kv


def test_experts():
    c = shrink(mixtral(), _policy("1d@8")).config
    assert (c.num_local_experts, c.num_experts_per_tok) == (8, 2)          # 8 ≤ split 8: kept
    c = shrink(mixtral(), _policy("2d@4")).config
    assert c.num_local_experts == 4 and c.num_local_experts % 2 == 0       # more than top-2, even
    c = shrink(qwen3_moe(), _policy("1d@8")).config
    assert c.num_experts == 16 and c.num_experts_per_tok == 8              # > top 8, ≡ 128 (mod 8)
    c = shrink(deepseek_v3(), _policy("1d@8")).config
    assert c.n_routed_experts % c.n_group == 0 and c.n_routed_experts // c.n_group >= 2
    assert c.num_experts_per_tok <= c.topk_group * c.n_routed_experts // c.n_group
    assert c.qk_head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim


def test_text_config_is_shrunk():
    real = tf.Gemma3Config()
    out = shrink(real, _policy("1d@8"))
    assert out.config.text_config.hidden_size == 32 and out.config.vision_config == real.vision_config
    assert any(a == "text_config.hidden_size" for a, _, _ in out.changes)
    assert out.config.image_token_id < out.config.text_config.vocab_size


def test_inconsistent_heads_are_refused():
    real = tf.LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=5, intermediate_size=128)
    with pytest.raises(ConfigError, match="not a multiple of num_key_value_heads"):
        shrink(real, _policy("1d@8"))


@pytest.mark.parametrize("name,layout,batch", [("llama2-7b", "1d@8", 2), ("gpt2", "2d@4", 2)])
def test_the_shrunk_config_plans(name, layout, batch):
    mode, world, depth = LAYOUTS[layout]
    shrunk = shrink(CONFIGS[name][0](), _policy(layout)).config
    p = autoshard.plan(shrunk, world_size=world, mode=mode, depth=depth, batch_size=batch, seq_len=8)
    assert p.mesh.world_size == world


def test_a_derived_head_dim_is_left_to_its_config():
    """Falcon's ``head_dim`` is a read-only property (hidden / heads): the shrink sets the
    fields it derives from and leaves it alone."""
    cfg = tf.FalconConfig(hidden_size=4544, num_attention_heads=71, num_hidden_layers=32,
                                    vocab_size=65024, multi_query=True)
    for mode, world, depth in (("1d", 4, None), ("2d", 4, None)):
        pol = make_policy(mode, world, depth, 1)
        small = shrink(cfg, pol)
        assert small.config.head_dim == small.config.hidden_size // small.config.num_attention_heads
        assert "head_dim" not in {k for k, _, _ in small.changes}
        assert [(p.what, p.error) for p in check_dims(small.config, pol)] == \
            [(p.what, p.error) for p in check_dims(cfg, pol)]


def _codegen():
    return tf.CodeGenConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=128, vocab_size=128,
                            architectures=["CodeGenForCausalLM"])         # heads split over 4 fixed groups


def _mamba2():
    return tf.Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, n_groups=1, state_size=8, num_hidden_layers=2,
                           vocab_size=64, architectures=["Mamba2ForCausalLM"])    # heads · head_dim = 2 · hidden


@pytest.mark.parametrize("make", [_codegen, _mamba2], ids=["codegen", "mamba2"])
def test_a_shrunk_model_that_does_not_run_keeps_its_widths(make):
    """Sizes tied by the modelling code, not by an attribute shrink knows: the plain shrink
    builds a model that fails; shrink_that_runs keeps the widths (layers, vocabulary still
    shrink), says why, and its model runs."""
    from autoshard.planning.shrink import _run_error, shrink_that_runs

    real, pol = make(), make_policy("1d", 2)
    assert _run_error(real, None) is None
    assert _run_error(shrink(real, pol).config, None) is not None
    out = shrink_that_runs(real, pol)
    assert _run_error(out.config, None) is None
    assert "widths kept" in out.note and "widths kept" in out.describe()
    widths = {"n_embd", "n_head", "n_inner", "rotary_dim", "hidden_size", "num_heads", "head_dim"}
    assert not {a for a, _, _ in out.changes} & widths, out.changes


def test_a_shrunk_model_that_runs_is_the_plain_shrink():
    from autoshard.planning.shrink import shrink_that_runs

    real, pol = llama2_7b(), make_policy("1d", 2)
    real.architectures = ["LlamaForCausalLM"]
    out = shrink_that_runs(real, pol)
    assert out.changes == shrink(real, pol).changes and out.note == ""
