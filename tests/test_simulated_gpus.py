"""Several GPUs, simulated (docs/design.md, "Several GPUs by simulation"): ranks of an
8- and a 64-rank job run ``shard()`` and a training step one after the other in this
process on torch's fake process group (:mod:`simulated`), their tensors on meta standing
for each rank's GPU, every collective recorded. On every rank alike:

- the same sequence of collectives (op, mesh axes, dtype, size), and at each position the
  members of a rank's group hold that same group (their calls would meet);
- no collective is handed a CPU tensor (the device is the GPU);
- a rank creates a communicator only once per set of ranks, none for the default
  group's ranks (1d with tp = world reuses WORLD);
- under ``torch.autocast`` (a CPU run: values, garbage where a collective would have
  filled them) the blocks' gathers, reduce-scatters and ring steps move bf16.

One capture serves every case (the slow part); the default suite runs the 8-rank jobs on
every rank and the 64-rank ones on a few ranks (first, last, a middle one of each group
pattern); ``make test-extended`` runs every rank of every case.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import simulated as S

# (mode, world, dp, cp, depth): every mode, with dp and cp where the mode takes them
CASES8 = [("1d", 8, 2, 2, None), ("1d-sp", 8, 2, 1, None), ("2d", 8, 2, 1, None), ("2d", 8, 1, 2, None),
          ("2.5d", 8, 1, 1, 2), ("3d", 8, 1, 1, None), ("1d", 8, 1, 1, None)]
CASES64 = [("1d", 64, 4, 2, None), ("1d-sp", 64, 8, 1, None), ("2d", 64, 2, 2, None), ("2.5d", 64, 4, 2, 2),
           ("3d", 64, 8, 1, None)]
FEW = (0, 1, 9, 27, 63)         # the 64-rank cases in the default suite
DEFAULT = {("2d", 8, 2, 1, None), ("2d", 64, 2, 2, None)}       # the rest: make test-extended (about 1 min)


def _marked(cases):
    return [pytest.param(c, id=_case_id(c), marks=[] if c in DEFAULT else [pytest.mark.extended]) for c in cases]


def _case_id(c):
    mode, world, dp, cp, depth = c
    return f"{mode}@{world}-dp{dp}-cp{cp}" + (f"-d{depth}" if depth else "")


@pytest.fixture(scope="module")
def job():
    """A Llama whose every dim divides 2, 4, 8 and 16 ways (8 heads), its batch and one capture."""
    import transformers

    from autoshard.passes.capture import capture

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4, 32), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return model, inputs, capture(model, example_inputs=inputs)


def _run(job, case, rank: int, meta: bool = True):
    import autoshard

    model, inputs, cap = job
    mode, world, dp, cp, depth = case
    with S.fake_rank(rank, world, meta=meta) as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = autoshard.shard(model, mode=mode, dp=dp, cp=cp, depth=depth, example_inputs=inputs, captured=cap,
                                  seed=0, device="meta" if meta else "cpu")
        sharded.self_check = False
        calls.shard_calls = len(calls.ops)
        calls.labels = tuple(sharded.groups)
        S.step(sharded, inputs, autocast=not meta, calls=calls)
    return calls


def _check_job(job, case, ranks):
    runs = {r: _run(job, case, r) for r in ranks}
    world = case[1]
    assert S.same_program(runs) == []
    for r, calls in runs.items():
        assert len(calls.ops) > calls.shard_calls, f"rank {r}: the step made no collective"
        on_cpu = [c for c in calls.ops if c.device == "cpu"]
        assert on_cpu == [], f"rank {r}: collectives on CPU tensors while the device is the GPU: {on_cpu[:3]}"
        # one communicator per set of ranks, none for WORLD's (a balanced cp group is its own: its name marks the order)
        dup = {g for g in calls.made if calls.made.count(g) > 1 and len(g) != case[3]}
        assert len(calls.made) <= len(calls.labels), (r, calls.made, calls.labels)
        assert not dup, f"rank {r}: {sorted(dup)} made twice"
        assert tuple(range(world)) not in calls.made, f"rank {r}: a second communicator over every rank"
    return runs


@pytest.mark.parametrize("case", _marked(CASES8))
def test_every_rank_of_an_8_gpu_job_runs_the_same_program(job, case):
    runs = _check_job(job, case, range(case[1]))
    made = {r: len(c.made) for r, c in runs.items()}
    assert len(set(made.values())) == 1, made          # every rank holds as many communicators


@pytest.mark.parametrize("case", _marked(CASES64))
def test_a_64_gpu_job_runs_the_same_program_on_a_few_ranks(job, case):
    _check_job(job, case, FEW)


@pytest.mark.extended
@pytest.mark.parametrize("case", CASES64, ids=[_case_id(c) for c in CASES64])
def test_every_rank_of_a_64_gpu_job_runs_the_same_program(job, case):
    _check_job(job, case, range(64))


def test_tp_over_every_rank_reuses_the_default_group(job):
    """1d with tp = world: its tp group is WORLD's ranks in WORLD's order; a second
    communicator over them would hold NCCL's buffers twice."""
    calls = _run(job, ("1d", 8, 1, 1, None), 3)
    assert calls.made == [], calls.made
    assert calls.ops and all(c.ranks == tuple(range(8)) for c in calls.ops)


WIRE = ("all_gather", "all_gather_single", "reduce_scatter_single", "batch_isend_irecv")


@pytest.mark.parametrize("case", _marked([("2d", 8, 2, 1, None), ("2.5d", 8, 1, 1, 2), ("3d", 8, 1, 1, None),
                                          ("1d", 8, 2, 2, None), ("1d-sp", 8, 2, 1, None)]))
def test_under_autocast_the_blocks_move_bf16(job, case):
    """Between the first and the last bf16 call of forward (and of backward), every gather,
    reduce-scatter and ring step moves bf16: the transformer blocks' operands and
    gradients travel in the compute dtype. Outside that span float32 is the model's own:
    the embedding's residual stream and the float32 logits gathered at the end;
    all-reductions of statistics (norms, the loss, gradients of float32 weights) stay float32."""
    for rank in (0, case[1] - 1):
        calls = _run(job, case, rank, meta=False)
        for phase, ops in (("forward", calls.ops[calls.shard_calls:calls.forward]),
                           ("backward", calls.ops[calls.forward:])):
            bf = [i for i, c in enumerate(ops) if c.dtype == "bfloat16"]
            assert bf, f"rank {rank}: nothing travelled in bf16 in {phase}"
            inside = [c for c in ops[bf[0]:bf[-1] + 1] if c.op in WIRE and c.dtype in ("float32", "float64")]
            assert inside == [], f"rank {rank}: float32 between the blocks' bf16 calls in {phase}: {inside[:4]}"


# ------------------------------------------------------------------ refusals
def test_a_cpu_tensor_on_a_group_without_a_cpu_backend_is_refused():
    """NCCL alone carries no CPU tensor; shared memory on one host would have carried it
    (and hidden the bug until a second host)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torch.distributed as dist

    from autoshard import CollectiveError
    from autoshard.runtime import collectives as C

    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        name = dist.group.WORLD.group_name
        with pytest.raises(CollectiveError, match=r"CPU tensor \(4,\).*carries no CPU tensors"):
            C.all_reduce(torch.ones(4), name, "sum")
        with pytest.raises(CollectiveError, match="carries no CPU tensors"):
            C.all_gather(torch.ones(4), 0, name)
    finally:
        dist.destroy_process_group()


def test_cuda_graphs_are_refused_both_ways(job):
    import autoshard
    from autoshard import ConfigError

    model, inputs, cap = job
    with S.fake_rank(0, 2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = autoshard.shard(model, mode="1d", example_inputs=inputs, captured=cap, seed=0, device="meta")
        with pytest.raises(ConfigError, match=r"triton.cudagraphs.*captures CUDA graphs"):
            sharded.compile(options={"triton.cudagraphs": True})
        with pytest.raises(ConfigError, match=r"mode='reduce-overhead'.*captures CUDA graphs"):
            torch.compile(sharded, mode="reduce-overhead")(**inputs)
