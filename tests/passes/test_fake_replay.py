"""The pad pass's remembered shape inference (``autoshard/passes/fake_replay.py``): a graph
padded again replays the ops it ran, and every value's fake tensor is the one running them
gives (symbolic sizes, strides, offset, dtype, device, a view or not)."""

from __future__ import annotations

import transformers

from autoshard.passes import fake_replay
from autoshard.passes.capture import capture
from autoshard.passes.pad import pad_widths


def _geometry(gm):
    out = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        vs = v if isinstance(v, (list, tuple)) else [v]
        out[n.name] = [(str(tuple(t.shape)), str(t.stride()), str(t.storage_offset()), t.dtype, t.device.type,
                        t.requires_grad, t._is_view()) if hasattr(t, "shape") else repr(t) for t in vs]
    return out


def test_replayed_padding_gives_the_values_running_gives(monkeypatch):
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3,
        vocab_size=64))
    cap = capture(m)
    monkeypatch.setattr(fake_replay, "_MEMO", {})
    monkeypatch.setattr(fake_replay, "STATS", {"replayed": 0, "ran": 0})
    with monkeypatch.context() as off:          # the reference: every op run, nothing remembered
        off.setattr(fake_replay, "makes_new_tensors", lambda target: False)
        off.setattr(fake_replay, "makes_view", lambda target: False)
        ran = pad_widths(cap, 2, heads=3, kv_heads=3)
    assert fake_replay.STATS == {"replayed": 0, "ran": 0} and not fake_replay._MEMO
    views = {"replayed": 0}
    replay_view = fake_replay._replay_view

    def counted(*args):
        out = replay_view(*args)
        views["replayed"] += out is not None
        return out

    monkeypatch.setattr(fake_replay, "_replay_view", counted)
    first = pad_widths(cap, 2, heads=3, kv_heads=3)          # remembered as it runs
    runs = fake_replay.STATS["ran"]
    again = pad_widths(cap, 2, heads=3, kv_heads=3)          # the same graph again: replayed
    assert runs > 0 and fake_replay.STATS["ran"] == runs and fake_replay.STATS["replayed"] >= runs
    assert views["replayed"] > 0        # views (transpose, reshape, slice) too: rebuilt with as_strided
    for out in (first, again):
        assert sorted((p.names, p.dense, p.padded) for p in out.padding) == \
            sorted((p.names, p.dense, p.padded) for p in ran.padding)
        assert _geometry(out.module) == _geometry(ran.module)
