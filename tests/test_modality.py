"""Models led by other inputs than token ids (issue: any modality). A ViT image
classifier (conv patch embedding, CLS token, classifier head) and Whisper (conv front
end over log-mel frames, encoder-decoder, frozen sinusoidal positions) are sharded with
``shard(model)`` and no example inputs, then called with their own kind of batch:
loss, logits, every returned tensor and every local gradient within atol = rtol = 1e-5
of the dense model's, parameter bytes and the collective ledger equal to the plan
(tests/modality.py). In `make test`: ViT 1d@2 and 2d@4, CLIP 1d@2 and 2d@4, LLaVA
1d@2; the 8-rank cells and Whisper's are slow (`make test-extended`); Gemma-3 multimodal and Idefics3 in
1d@2, 2d@4 and 2.5d@8 (slow), Gemma-3 at 2.5d given a batch of 4 (its image-token count sums
over the batch, so the batch cannot be padded to the split of 4).

CLIP (a dual encoder: every image against every text of the batch) reads its batch
as a Python int (``len(logits)`` in its contrastive loss), so export makes the batch
static: a call with another batch size captures a graph of its own, and every mode keeps that batch
whole on every rank (SUMMA / 3D Linears with their rows whole, weights still split),
so the contrastive loss sees every pair — never a block-local one; dp and cp, which
would hand ranks other samples, are refused at plan time naming the input. LLaVA
lists its image features per sample, which makes its batch static too: the same.

State-space models (Mamba; Jamba's hybrid of scan, attention and experts; Falcon-H1's
attention beside a Mamba-2 mixer) are exact in 1d@2 and 2d@4 with their scan held whole
(slow: 75 s each); Falcon-H1 also in 2.5d@8 (extended); Falcon-H1 and Bamba (Mamba-2
layers among attention layers) with 3 optimizer steps."""

from __future__ import annotations

import pytest
import torch

import modality
from dist_pool import get_pool

MODES = {"1d": (2, None), "2d": (4, None), "2.5d": (8, 2), "3d": (8, None)}
FAST = {("vit", "1d"), ("vit", "2d"), ("clip", "1d"), ("clip", "2d"), ("llava", "1d")}
CELLS = [(n, m) for n in ("vit", "whisper", "clip", "llava") for m in MODES] + [
    (n, m) for n in ("gemma3mm", "idefics3") for m in ("1d", "2d", "2.5d")]
# sizes that depend on the data (Idefics3 keeps the images that are not all padding: an
# unbacked size) are priced at 8 rows in the plan's bytes, so only the call count is compared
DATA_DEPENDENT_SIZES = {"idefics3"}
# Idefics3's pixel-shuffle connector reshapes a [images, patches, hidden] block by sizes read
# from that data-dependent count: at 2d and 2.5d it runs whole on its gathered input (exact)
# Gemma-3's SigLIP pooling head (nn.MultiheadAttention) projects its probe and the patches by
# slices of one in_proj weight: at 2d and 2.5d both linears run whole (its head view then reshapes by
# bsz × heads, read from the split batch: multiplied back)
FALLBACKS = {("idefics3", m): ["view_11"] for m in ("2d", "2.5d")} | {
    ("gemma3mm", m): ["linear_12", "linear_13"] for m in ("2d", "2.5d")}


@pytest.mark.parametrize("name,mode", [pytest.param(n, m, id=f"{n}-{m}",
                                                    marks=() if (n, m) in FAST else pytest.mark.slow)
                                       for n, m in CELLS])
def test_family_equals_dense(name, mode):
    world, depth = MODES[mode]
    res = get_pool(world, timeout=600).run(modality.check, name, mode, depth)
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        assert r["fallbacks"] == FALLBACKS.get((name, mode), []), r["fallbacks"]
        n = 1 if name in DATA_DEPENDENT_SIZES else 2
        assert r["ledger"][:n] == r["plan"][:n], f"rank {rank}: ledger {r['ledger']} vs plan {r['plan']}"
        assert r["param_bytes"] == r["plan_param_bytes"], f"rank {rank}"
    # split, not replicated: per rank well under the dense bytes (the conv front end stays whole)
    assert res[0]["param_bytes"] < 0.6 * res[0]["dense_param_bytes"], res[0]


@pytest.mark.parametrize("mode,world", [("1d", 2), pytest.param("2d", 4, marks=pytest.mark.slow)])
def test_whisper_generates_as_dense(mode, world):
    """A speech encoder-decoder generates from its log-mel frames: the encoder graph reads
    ``input_features``, the decoder steps run on the sharded cache; tokens equal dense
    ``GenerationMixin.generate`` and every step's scores are within 1e-5."""
    for rank, r in enumerate(get_pool(world, timeout=600).run(modality.generate_whisper, mode)):
        assert r["tokens"] == r["ref_tokens"], f"rank {rank}"
        assert r["steps"] == 8 and r["scores"] <= 1e-5, r
        assert r["captures"] <= 3, r      # the encoder, the prefill and the decode step, once each


def test_default_inputs_follow_the_model():
    """What ``shard(model)`` captures with comes from the model's forward and config."""
    from autoshard.passes.capture import default_example_inputs

    shapes = {}
    for name in ("vit", "whisper"):
        ex = default_example_inputs(modality.build(name), batch_size=3, seq_len=5)
        shapes[name] = {k: (tuple(v.shape), str(v.dtype)) for k, v in ex.items()}
    assert shapes["vit"] == {"pixel_values": ((3, 3, 16, 16), "torch.float32"), "labels": ((3,), "torch.int64")}
    assert shapes["whisper"] == {"input_features": ((3, 8, 32), "torch.float32"), "labels": ((3, 5), "torch.int64")}
    # a vision-language model: 16 image placeholders (one per patch) open each row, without a label
    ex = default_example_inputs(modality.build("llava"), batch_size=3, seq_len=5)
    assert {k: tuple(v.shape) for k, v in ex.items()} == {"input_ids": (3, 21), "attention_mask": (3, 21),
                                                          "pixel_values": (3, 3, 16, 16), "labels": (3, 21)}
    assert (ex["input_ids"][:, :16] == 127).all() and (ex["input_ids"][:, 16:] != 127).all()
    assert (ex["labels"][:, :16] == -100).all() and (ex["labels"][:, 16:] == ex["input_ids"][:, 16:]).all()


@pytest.mark.slow      # two real exports (15 s); the family tests run the same captures
def test_capture_makes_the_batch_dynamic_and_no_sequence_from_channels():
    """A ViT graph has a dynamic batch and no sequence symbol; Whisper's mel bins (dim 1
    of ``input_features``, 8 = the example's sequence length here) stay static while its
    decoder's tokens get the sequence symbol."""
    from autoshard.passes.capture import capture

    vit = capture(modality.build("vit"))
    assert vit.batch_symbol is not None and vit.seq_symbol is None
    w = capture(modality.build("whisper"), seq_len=8)
    shape = next(n for n in w.module.graph.nodes if n.name == "input_features").meta["val"].shape
    assert isinstance(shape[0], torch.SymInt) and shape[1:] == (8, 32)
    labels = next(n for n in w.module.graph.nodes if n.name == "labels").meta["val"].shape
    assert labels[1].node.expr == w.seq_symbol


def test_example_inputs_of_any_modality_are_checked():
    from autoshard.planning.validate import check_example_inputs

    ok = {"pixel_values": torch.zeros(4, 3, 16, 16), "labels": torch.zeros(4, dtype=torch.long)}
    assert check_example_inputs(ok) == []
    bad = check_example_inputs({"pixel_values": torch.zeros(4, 3, 16, 16), "labels": torch.zeros(3)})
    assert [str(p) for p in bad] == ["labels: shape [3] does not match pixel_values [4, 3, 16, 16] (expected [4, ...])"]
    none = check_example_inputs({"labels": torch.zeros(3)})
    assert "input_ids, inputs_embeds, pixel_values, input_features, input_values" in str(none[0])
    split = check_example_inputs(ok | {"labels": torch.zeros(4)}, batch_split=3, batch_label="row·col")
    assert split and "example_inputs['pixel_values']" in str(split[0])


def _odd_batch(rank, world):
    """A batch of 3 images at 2d@4 (batch split 2): padded to 4 and cut back, exact."""
    import copy

    import autoshard

    torch.set_num_threads(1)
    dense = modality.build("vit")
    sharded = autoshard.shard(copy.deepcopy(dense), mode="2d")
    batch = modality.inputs("vit", dense, b=3)
    out, ref = sharded(**batch), dense(**batch)
    return (out.logits - ref.logits).abs().max().item(), (out.loss - ref.loss).abs().item(), tuple(out.logits.shape)


def test_an_odd_batch_of_images_is_padded_exactly():
    for logits_err, loss_err, shape in get_pool(4, timeout=600).run(_odd_batch):
        assert shape == (3, 10) and logits_err < 1e-5 and loss_err < 1e-5


def _other_batch(rank, world, name="clip"):
    """A static-batch model (CLIP, LLaVA) sharded with no example inputs (a static batch
    of 2), then called with batches of 3 and 8: each size gets its own graph; loss, logits
    and every local gradient of each call against the dense model's."""
    import copy

    import autoshard

    torch.set_num_threads(1)
    dense = modality.build(name)
    sharded = autoshard.shard(copy.deepcopy(dense), mode="1d")
    failures = []
    logits = "logits_per_image" if name == "clip" else "logits"
    for b in (3, 8):
        batch = modality.inputs(name, dense, b=b)
        for m in (sharded, dense):
            m.zero_grad()
        out, ref = sharded(**batch), dense(**batch)
        out.loss.backward()
        ref.loss.backward()
        for what, got, want in (("loss", out.loss, ref.loss), ("logits", out[logits], ref[logits])):
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                failures.append(f"b={b} {what}: {(got - want).abs().max().item()}")
        dparams = dict(dense.named_parameters())
        for pp, p in ((pp, sharded.get_parameter(pp.name)) for pp in sharded.plan.params):
            if dparams[pp.name].grad is None:     # no output reads it (LLaVA's last vision layer)
                if p.grad is not None and p.grad.abs().max() > 0:
                    failures.append(f"b={b} grad {pp.name}: dense has none")
                continue
            want = pp.spec.local(dparams[pp.name].grad, sharded.mesh, rank)
            if p.grad is None or not torch.allclose(p.grad, want, atol=1e-5, rtol=1e-5):
                failures.append(f"b={b} grad {pp.name}")
    return failures, sharded.signatures


def test_mel_bins_are_never_the_sequence():
    """Whisper's ``input_features`` [batch, mel bins, frames] with as many mel bins as the
    labels have tokens: the bins stay a static size of the signature, not ``s``."""
    from autoshard.ir.signature import InputSignature

    sig = InputSignature.of({"input_features": torch.zeros(2, 16, 32), "labels": torch.zeros(2, 16, dtype=torch.long)})
    assert sig.describe() == "input_features[b,16,32]:float32, labels[b,s]:int64", sig.describe()


@pytest.mark.slow      # two Whisper captures
def test_whisper_with_labels_as_long_as_its_mel_bins_equals_dense():
    for rank, r in enumerate(get_pool(2, timeout=600).run(modality.whisper_labels_as_long_as_mel_bins)):
        assert r["failures"] == [], f"rank {rank}: {r}"


@pytest.mark.slow      # two more captures (about a minute each model)
@pytest.mark.parametrize("name", ["clip", "llava"])
def test_a_static_batch_is_captured_per_batch_size(name):
    for failures, sigs in get_pool(2, timeout=600).run(_other_batch, name):
        assert failures == [], failures
        assert len(sigs) == 3 and [s.split("[")[1].split(",")[0] for s in sigs] == ["2", "3", "8"], sigs


@pytest.mark.parametrize("mode,world,kw", [("2d", 8, dict(dp=2)), ("1d", 4, dict(dp=2)), ("1d", 4, dict(cp=2))])
def test_a_static_batch_is_refused_where_ranks_hold_other_rows(mode, world, kw):
    """The tensor-parallel modes keep a static batch whole; data and context parallelism
    would hand each rank its own samples or tokens of it (a block-local contrastive loss)."""
    import autoshard

    with pytest.raises(autoshard.ShardingError) as e:
        autoshard.plan(modality.build("clip"), world_size=world, mode=mode, batch_size=4, seq_len=8, **kw)
    msg = str(e.value)
    assert "graph has a static batch" in msg and "node: %input_ids" in msg, msg
    assert ("dp[2]" if "dp" in kw else "cp[2]") in msg and "with dp=1 and cp=1" in msg, msg


def test_a_static_batch_keeps_its_rows_whole():
    """CLIP's batch at 2d: no input is cut, every SUMMA Linear runs with its rows whole
    (dW kept as a block, not summed over the grid's rows), the plan records no batch axes."""
    import autoshard
    from autoshard.ir.kernels import Summa

    p = autoshard.plan(modality.build("clip"), world_size=4, mode="2d", batch_size=2, seq_len=8)
    assert p.batch_axes == () and not [n for n in p.nodes if n.kind == "input"]
    summas = [n.kernel for n in p.nodes if isinstance(n.kernel, Summa)]
    assert summas and all(k.rows_whole for k in summas)
    assert not any(c.kind == "reduce_scatter" and c.axes == ("row",) for n in p.nodes for c in n.comms)


@pytest.mark.slow      # a real export (13 s); test_state_space_models_equal_dense captures the same model
def test_a_state_space_model_is_captured_with_a_static_sequence():
    """Mamba's scan loops over the sequence in Python, so export makes the sequence
    static (one graph per length), the batch still dynamic: a graph, not a capture
    error about the sequence."""
    import models
    from autoshard.passes.capture import capture

    cap = capture(models.build("mamba"), seq_len=8)
    assert cap.seq_range == (8, 8) and cap.seq_symbol is None and cap.batch_symbol is not None


@pytest.mark.parametrize("arch,mode,world", [pytest.param("mamba", "1d", 2, id="mamba-1d"),
                                             pytest.param("jamba", "1d", 2, id="jamba-1d"),
                                             pytest.param("mamba", "2d", 4, id="mamba-2d", marks=pytest.mark.slow),
                                             pytest.param("jamba", "2d", 4, id="jamba-2d", marks=pytest.mark.slow),
                                             pytest.param("falconh1", "1d", 2, id="falconh1-1d", marks=pytest.mark.slow),
                                             pytest.param("falconh1", "2d", 4, id="falconh1-2d", marks=pytest.mark.slow),
                                             pytest.param("falconh1", "2.5d", 8, id="falconh1-2.5d",
                                                          marks=pytest.mark.extended),
                                             pytest.param("bamba", "1d", 2, id="bamba-1d", marks=pytest.mark.slow),
                                             pytest.param("bamba", "2d", 4, id="bamba-2d", marks=pytest.mark.slow),
                                             pytest.param("bamba", "2.5d", 8, id="bamba-2.5d",
                                                          marks=pytest.mark.extended)])
def test_state_space_models_equal_dense(arch, mode, world):
    """Mamba (selective scan: ``dt_proj.weight @ x``, a parameter on the left of a matmul,
    is a plain matmul, not a Linear), Jamba (scan, attention and expert layers), Falcon-H1
    and Bamba (in 2d and 2.5d their Mamba-2 chunks reshape the whole batch by a size read
    from the row-split mask: the size is multiplied back; einsums with no rule run on whole
    inputs give whole outputs): loss, logits and every local gradient equal dense, the
    ledger equals the plan; Falcon-H1 and Bamba also take 3 AdamW steps with the dense
    model's losses. In
    1d the scan's projections stay whole (each says why in the plan); attention and
    experts split."""
    import models

    steps = 3 if arch in ("falconh1", "bamba") else 0
    res = get_pool(world, timeout=600).run(models.check, arch, mode, MODES[mode][1], steps)
    for rank, r in enumerate(res):
        assert r["failures"] == [], f"rank {rank}: {r['failures'][:5]}"
        assert (r["ledger_bytes"], r["ledger_calls"]) == (r["plan_bytes"], r["plan_calls"]), f"rank {rank}"
        if steps:
            assert len(r["losses"]) == steps
            for a, b in zip(r["losses"], r["dense_losses"]):
                assert abs(a - b) <= 1e-5, (rank, r["losses"], r["dense_losses"])
    dense = sum(p.numel() * p.element_size() for p in models.build(arch).parameters())
    assert res[0]["param_bytes"] < 0.75 * dense, (res[0]["param_bytes"], dense)


def test_a_static_sequence_is_part_of_the_signature():
    from autoshard.ir.signature import InputSignature

    ids = {"input_ids": torch.zeros(4, 8, dtype=torch.long)}
    assert InputSignature.of(ids).describe() == "input_ids[b,s]:int64"
    assert InputSignature.of(ids, static_seq=True).describe() == "input_ids[b,8]:int64"
    assert InputSignature.of(ids, static_batch=True).describe() == "input_ids[4,s]:int64"


def test_the_support_report_lists_every_family():
    """docs/support.md's modality table (regenerated with the architecture matrix; the slow
    test_support_md_is_generated_from_the_matrix compares it with the plans) has each
    family in each mode: pass (CLIP and LLaVA with their static batch kept whole)."""
    import arch_matrix as M

    for name in modality.FAMILIES:
        for mode in MODES:
            want = ("refused" if (name, mode) in modality.REFUSED
                    else "fallbacks" if (name, mode) in modality.WITH_FALLBACKS else "pass")
            assert M.reported(name, mode).status == want, (name, mode)
    # the recent decoders and state-space models plan in every mode (Mamba's and Jamba's scans
    # chunk and split their projections on whole tensors: fallbacks, exact)
    for name in M.RECENT:
        for mode in MODES:
            want = "fallbacks" if name in ("mamba", "jamba", "falconh1", "bamba") and mode != "1d" else "pass"
            assert M.reported(name, mode).status == want, (name, mode)


def test_a_static_sequence_gets_one_graph_per_length():
    """A model that reads its sequence length as a Python int is captured with a static
    sequence; a call at another length captures that length's graph (the batch stays
    dynamic), and each equals dense."""
    r = get_pool(2, timeout=600).run(modality.check_static_seq)[0]
    for s in (8, 6):
        assert r[s][0] < 1e-5 and r[s][1] < 1e-5, r
    assert ["input_ids[b,8]:int64" in r["signatures"][0], "input_ids[b,6]:int64" in r["signatures"][1]] == [True] * 2
    assert len(r["signatures"]) == 2, r       # the second call at 8 reuses the first graph


def test_idefics3_plans_in_1d_with_data_dependent_sizes():
    """Idefics3's connector reshapes by an image count read from the data (unbacked ``u``):
    every look-ahead that compares its sizes (the fused-block and merged-heads checks of
    passes/rule_context.py) must treat them as undecided, not crash the Linear's rule
    (GuardOnDataDependentSymNode on ``Eq(u4, 4*u4)``, once a regression)."""
    import autoshard

    model = modality.build_meta("idefics3")
    plan = autoshard.plan(model, world_size=4, mode="1d", example_inputs=modality.inputs("idefics3", model, b=4))
    assert any(n.name == "linear_12" for n in plan.nodes)
