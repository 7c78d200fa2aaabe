"""The one device rule (autoshard/runtime/device.py), checked without a GPU.

- The init path with CUDA simulated: ``set_device(cuda:LOCAL_RANK)`` before
  ``init_process_group("nccl", device_id=cuda:LOCAL_RANK)``; a LOCAL_RANK past the
  GPUs refused before any group exists.
- ``sharded.to("meta")`` moves every tensor: parameters, buffers, the constants
  export lifted out of the forward, and every device literal of every graph
  (the architecture matrix in 1d and 2d; a sample in ``make test``).
- Gradient buckets are launched in the same order on every rank (by axes label,
  not by c10d's per-rank group names).
- An AST scan of the runtime: no tensor factory without ``device=``, no
  ``autocast("cpu")``, no ``Generator()`` without a device.
"""

from __future__ import annotations

import ast
import copy
import pathlib
import warnings

import pytest
import torch

import arch_matrix as M
import models
from dist_pool import get_pool

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ init path
class _Calls:
    def __init__(self):
        self.log = []


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA with 4 GPUs, as far as the init path can tell; every call recorded."""
    import torch.distributed as dist

    calls = _Calls()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.log.append(("set_device", torch.device(d))))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.log.append(("init_process_group", backend, kw.get("device_id"))))
    return calls


def test_nccl_init_binds_the_local_gpu_first(fake_cuda, monkeypatch):
    from autoshard.runtime.device import init_process_group, rank_device

    monkeypatch.setenv("LOCAL_RANK", "2")
    assert init_process_group(timeout_s=30) == "nccl"
    assert fake_cuda.log == [("set_device", torch.device("cuda", 2)),
                             ("init_process_group", "nccl", torch.device("cuda", 2))]
    assert rank_device("nccl") == torch.device("cuda", 2)


def test_shard_joins_the_job_through_the_device_rule(fake_cuda, monkeypatch):
    """``shard()``'s own init (no process group yet) goes the same way."""
    import torch.distributed as dist

    from autoshard import api

    for k, v in {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                 "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    api._ensure_dist()
    assert [c[0] for c in fake_cuda.log] == ["set_device", "init_process_group"]
    assert fake_cuda.log[1][1:] == ("nccl", torch.device("cuda", 1))


def test_local_rank_past_the_gpus_is_refused_before_any_group(fake_cuda, monkeypatch):
    from autoshard import ConfigError
    from autoshard.runtime.device import init_process_group

    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=4 but this node has 4 GPU\(s\).*--nproc-per-node 4"):
        init_process_group()
    assert fake_cuda.log == []


def test_gloo_without_cuda_stays_on_the_cpu(monkeypatch):
    from autoshard.runtime.device import backend_for, rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend_for() == "gloo" and rank_device("gloo") == torch.device("cpu")


# ------------------------------------------------------------------ .to("meta")
def _device_literals(gm) -> list:
    from torch import fx

    found = []

    def walk(v):
        if isinstance(v, torch.device):
            found.append(v)
        elif isinstance(v, str) and v.split(":")[0] in ("cpu", "cuda", "meta"):
            found.append(torch.device(v))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for mod in gm.modules():
        if isinstance(mod, fx.GraphModule):
            for node in mod.graph.nodes:
                walk(node.args)
                walk(node.kwargs)
    return found


def off_device(sharded, device: torch.device) -> list[str]:
    """Every tensor and graph literal of ``sharded`` that is not on ``device``."""
    from autoshard.runtime.device import lifted_constants

    gm = sharded.graph_module()
    bad = [f"parameter {n} on {t.device}" for n, t in sharded.named_parameters() if t.device != device]
    bad += [f"buffer {n} on {t.device}" for n, t in sharded.named_buffers() if t.device != device]
    bad += [f"constant {name} on {t.device}" for _, name, t in lifted_constants(gm) if t.device != device]
    bad += [f"graph literal device={d}" for d in _device_literals(gm) if d != device]
    return bad


def _to_meta(rank, world, arch, mode):
    """shard() on the ranks (one capture shared by the modes of a worker), one call,
    then ``.to("meta")``: what did not follow."""
    import autoshard

    torch.set_num_threads(1)
    model = models.build(arch)
    inputs = models.batch(arch)
    sharded = autoshard.shard(copy.deepcopy(model), mode=mode, example_inputs=inputs,
                              captured=models.shared_capture(arch, model, inputs))
    sharded(**inputs)
    literals = {str(d) for d in _device_literals(sharded.graph_module())}
    sharded.to("meta")
    return off_device(sharded, torch.device("meta")), literals


SAMPLE = ("llama", "gpt2", "bert")   # the rest of the matrix: make test-extended
TO_META = [pytest.param(a, mode, world, id=f"{a}-{mode}",
                        marks=[] if a in SAMPLE else [pytest.mark.extended])
           for mode, world in (("1d", 2), ("2d", 4)) for a in M.ARCHS
           if not (mode == "2d" and M.expected_status(a, mode) == "refused")]


@pytest.mark.parametrize("arch,mode,world", TO_META)
def test_to_meta_moves_every_tensor_and_graph_literal(arch, mode, world):
    for rank, (bad, literals) in enumerate(get_pool(world, timeout=600).run(_to_meta, arch, mode)):
        assert bad == [], f"rank {rank}: {bad}"
        assert literals <= {"cpu"}, f"rank {rank}: graph literals before the move: {literals}"


def test_the_scan_sees_a_literal_left_behind():
    """A graph that still names ``device=cpu``, or keeps a constant there, is reported;
    :func:`retarget` moves both."""
    from torch import fx

    class M_(torch.nn.Module):
        def forward(self, x):
            n = x.shape[0]          # traced: the factories stay graph nodes with their device literal
            return x + torch.arange(n, device="cpu") + torch.ones(n, device=torch.device("cpu")) \
                + torch.full((3,), 2.0, device="cpu")      # no input: traced into a constant

    gm = fx.symbolic_trace(M_())
    const = gm._buffers.pop("_tensor_constant0")      # a plain attribute, as export lifts constants
    object.__setattr__(gm, "_tensor_constant0", const)

    class Holder:
        def graph_module(self):
            return gm

        named_parameters = named_buffers = staticmethod(lambda: [])

    assert off_device(Holder(), torch.device("meta")) == ["constant _tensor_constant0 on cpu"] + \
        ["graph literal device=cpu"] * 2
    from autoshard.runtime.device import retarget

    assert retarget(gm, "meta") == 2 and off_device(Holder(), torch.device("meta")) == []


# ------------------------------------------------------------------ bucket order
def test_buckets_flush_in_the_same_order_on_every_rank():
    """Two ranks whose c10d groups got different names (names are per-rank counters)
    flush the same axes in the same order; an order by name would not."""
    from autoshard.runtime.overlap import BucketedGradSync

    p = torch.nn.Parameter(torch.ones(2))
    keys = lambda names: [(names[a], torch.float32, torch.device("cpu")) for a in ("tp", "dp", "dp,tp")]  # noqa: E731
    orders = []
    for names in ({"tp": "9", "dp": "10", "dp,tp": "11"}, {"tp": "12", "dp": "3", "dp,tp": "7"}):
        sync = BucketedGradSync([(p, n) for n in names.values()], 1 << 20, {n: a for a, n in names.items()})
        orders.append([sync.labels[k[0]] for k in sorted(keys(names), key=sync.order)])
        by_name = [a for a, _ in sorted(names.items(), key=lambda kv: kv[1])]
        sync.remove()
        orders.append(by_name)
    assert orders[0] == orders[2] == ["dp", "dp,tp", "tp"]
    assert orders[1] != orders[3], "the per-rank names must be able to disagree for this test to mean anything"


def test_a_group_without_a_label_is_refused():
    from autoshard.runtime.overlap import BucketedGradSync

    with pytest.raises(ValueError, match="no axes label"):
        BucketedGradSync([(torch.nn.Parameter(torch.ones(1)), "5")], 1024, {})


# ------------------------------------------------------------------ AST scan
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "rand", "randn", "randint", "randperm", "eye",
             "linspace", "as_tensor"}
RUNTIME = ["autoshard/runtime", "autoshard/training", "autoshard/io", "autoshard/launch", "autoshard/module.py",
           "autoshard/generate.py", "autoshard/planning/profile.py", "passes/rewrite.py"]


def device_findings(source: str, where: str) -> list[str]:
    """Tensor factories without ``device=``, ``autocast("cpu")``, ``Generator()`` without a device."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        kws = {k.arg for k in node.keywords}
        name, at = node.func.attr, f"{where}:{node.lineno}"
        if name in FACTORIES and "device" not in kws and None not in kws:
            out.append(f"{at}: torch.{name}(...) without device=")
        elif name == "Generator" and "device" not in kws and not node.args:
            out.append(f"{at}: torch.Generator() without a device")
        elif name == "autocast" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "cpu":
            out.append(f"{at}: autocast('cpu') (autocast follows the module's device)")
    return out


def test_the_runtime_names_a_device_for_every_tensor_it_makes():
    files = [f for p in RUNTIME for f in ((ROOT / p).rglob("*.py") if (ROOT / p).is_dir() else [ROOT / p])]
    assert len(files) > 20
    found = [x for f in files for x in device_findings(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == [], "\n".join(found)


def test_the_scan_finds_each_kind():
    src = ("import torch\nx = torch.zeros(3)\ng = torch.Generator()\nwith torch.autocast('cpu'):\n    pass\n"
           "y = torch.zeros(3, device=x.device)\n")
    assert [f.split(": ", 1)[1] for f in device_findings(src, "f")] == [
        "torch.zeros(...) without device=", "torch.Generator() without a device",
        "autocast('cpu') (autocast follows the module's device)"]


# ------------------------------------------------------------------ backend strings
@pytest.mark.parametrize("config", ["nccl", "cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl"])
def test_a_cuda_backend_in_any_spelling_puts_the_rank_on_its_gpu(fake_cuda, monkeypatch, config):
    """torch names a group's backend as it was asked for ("cuda:nccl,cpu:gloo"; "undefined"
    for ``init_process_group()`` without one, whose configuration is "cpu:gloo,cuda:nccl"
    on a CUDA host): each puts the rank on cuda:LOCAL_RANK, and a collective's tensors on
    the current GPU."""
    import torch.distributed as dist

    from autoshard.runtime.device import comm_device, rank_device, uses_cuda

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert uses_cuda(config) and rank_device(config) == torch.device("cuda", 3)
    # the running group's: its configuration, never the string asked for
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert rank_device() == torch.device("cuda", 3) and comm_device() == torch.device("cuda", 3)


@pytest.mark.parametrize("config", ["gloo", "cpu:gloo", "cpu:gloo,cuda:gloo"])
def test_gloo_in_any_spelling_stays_on_the_cpu_even_with_gpus(fake_cuda, config):
    from autoshard.runtime.device import rank_device, uses_cuda

    assert not uses_cuda(config) and rank_device(config) == torch.device("cpu")


@pytest.mark.parametrize("env,current,bound,want", [
    ({"LOCAL_RANK": "2"}, 0, None, 2),          # never set: LOCAL_RANK
    ({}, 0, None, 5 % 4),                       # no LOCAL_RANK: rank % GPUs
    ({"LOCAL_RANK": "2"}, 1, None, 1),          # the caller's own choice stays
    ({"LOCAL_RANK": "2"}, 0, 3, 3),             # the group's bound GPU wins
])
def test_a_group_the_caller_made_gets_this_ranks_gpu(fake_cuda, monkeypatch, env, current, bound, want):
    """``shard()`` in a process group the caller created without ``set_device``: every rank's
    current GPU would be cuda:0; the rank's own is made current before any collective."""
    import torch.distributed as dist

    from autoshard import api

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    pg = type("PG", (), {"bound_device_id": None if bound is None else torch.device("cuda", bound)})()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: pg)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    api._ensure_dist()
    assert fake_cuda.log == ([] if want == current else [("set_device", torch.device("cuda", want))])


def test_a_local_rank_past_the_gpus_in_a_callers_group_is_refused(fake_cuda, monkeypatch):
    import torch.distributed as dist

    from autoshard import ConfigError, api

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl,cpu:gloo")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: type("PG", (), {"bound_device_id": None})())
    monkeypatch.setenv("LOCAL_RANK", "6")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=6 but this node has 4 GPU"):
        api._ensure_dist()


def test_a_model_moved_to_a_gpu_before_shard_is_warned_about():
    """``model.cuda()`` before ``shard()`` leaves a full copy on a GPU per rank (cuda:0 for
    every rank whose device was not set): said, with what to do instead."""
    from autoshard.ir.errors import AutoshardWarning
    from autoshard.runtime.device import check_model_device

    class OnGpu(torch.nn.Module):       # parameters that report cuda:0 (no GPU here)
        def parameters(self, recurse=True):
            return iter([type("P", (), {"device": torch.device("cuda", 0)})()])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_model_device(torch.nn.Linear(2, 2, device="meta"), torch.device("cuda", 1))   # nothing to say
    with pytest.warns(AutoshardWarning, match=r"cuda:0, not this rank's device cuda:1.*full copy.*on the CPU"):
        check_model_device(OnGpu(), torch.device("cuda", 1))
