"""``autoshard verify``: prove a plan exact on CPU ranks before a GPU hour is spent.

:func:`verify` builds a shrunk random copy of the model (the same class and config
switches; layers cut to the fewest that keep the layer pattern, widths to the
smallest that keep every split the real layout makes:
:mod:`autoshard.planning.shrink`), starts ``world_size`` gloo ranks itself, and runs
forward, backward and one SGD step twice on the same batch: sharded, and dense on
every rank. It reports

- each planned node's largest ``|sharded − dense|`` (:mod:`autoshard.runtime.compare`),
  worst first, and the first node in graph order that differs;
- the loss, logits, every local gradient and every parameter after the step;
- the collectives counted by the ledger against the plan's, per phase;
- the share of the model the plan splits.

The verdict is an exit code: 0 exact (fp32: atol = rtol = 1e-5; bf16: within twice the
dense model's own bf16 error against fp32), 1 a mismatch (naming the first node that
differs), 2 refused (the node and the reason, found by planning before any process
starts, or by a rank). Nothing waits forever: the ranks' process group and the whole
run have timeouts, and a failed rank stops the others.

Example (the first call starts 8 ranks, about 20 s; the second is refused before any)::

    >>> from autoshard import verify
    >>> r = verify("llama:7b", world_size=8, mode="2.5d", depth=2)   # doctest: +SKIP
    >>> r.exit_code, r.verdict                                       # doctest: +SKIP
    (0, 'exact')
    >>> r = verify("llama:tiny", world_size=6, mode="2d")
    >>> r.exit_code, r.verdict, r.reason.split(":")[0]
    (2, 'refused', 'ConfigError')
"""

from __future__ import annotations

import copy
import datetime
import importlib
import os
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from .ir.errors import AutoshardError, ConfigError

__all__ = ["verify", "VerifyReport", "run_rank", "resolve_target"]

EXACT, MISMATCH, REFUSED = 0, 1, 2
_FP32_TOL = 1e-5
_LR = 0.1
_BF16_EPS = 2.0 ** -7       # one bf16 rounding step, relative: a node's bf16 tolerance on top of its dense noise


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``exit_code``: 0 exact, 1 mismatch, 2 refused."""

    model: str
    mode: str
    world_size: int
    depth: int | None
    dp: int
    dtype: str
    verdict: str = "exact"                  # exact | mismatch | refused
    exit_code: int = EXACT
    reason: str = ""                        # refused: the error; mismatch: what differs first
    first_node: str = ""                    # mismatch: the first node (graph order) that differs
    shrunk: list = field(default_factory=list)      # [(attribute, real, shrunk)]
    shrink_note: str = ""                   # why the widths were kept (shrink_that_runs)
    batch: tuple = (0, 0)                   # global batch × sequence
    batch_note: str = ""
    nodes: list = field(default_factory=list)       # [NodeDiff as dict], graph order
    checks: dict = field(default_factory=dict)      # what -> (max |diff|, tolerance, ok)
    ledger: dict = field(default_factory=dict)      # phase -> {"ledger": (calls, bytes), "plan": (calls, bytes)}
    split: dict = field(default_factory=dict)       # plan.parallel_fraction() figures
    seconds: float = 0.0
    seconds_by_phase: dict = field(default_factory=dict)    # here, and the slowest rank's phases

    @property
    def ok(self) -> bool:
        return self.exit_code == EXACT

    def to_dict(self) -> dict:
        return asdict(self)

    def comparison(self):
        """The node rows as a :class:`~autoshard.runtime.compare.Comparison` (its table, worst first)."""
        from .runtime.compare import Comparison, NodeDiff

        names = NodeDiff.__dataclass_fields__
        return Comparison([NodeDiff(**{k: r[k] for k in names}) for r in self.nodes],
                          {r["name"]: (r["kind"], r["module"]) for r in self.nodes})

    def show(self, console=None, top: int | None = 25) -> None:
        """Print the report: the node table (worst first), the checks, the ledger, the verdict."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console(highlight=False)
        head = f"verify {self.model} · {self.mode} on {self.world_size} ranks" + \
            (f" (depth {self.depth})" if self.depth else "") + (f" × dp{self.dp}" if self.dp > 1 else "") + \
            f" · {self.dtype} · batch {self.batch[0]} × {self.batch[1]}"
        console.print(head, markup=False)
        if self.shrunk:
            console.print("shrunk: " + ", ".join(f"{k} {a}→{b}" for k, a, b in self.shrunk), markup=False)
        for note in (self.shrink_note, self.batch_note):
            if note:
                console.print(note, markup=False)
        if self.nodes:
            console.print(self.comparison().table(top))
        if self.checks:
            t = Table(title="whole-model checks", title_justify="left")
            for c in ("what", "max |sharded − dense|", "tolerance", ""):
                t.add_column(c)
            for what, (err, tol, ok) in self.checks.items():
                t.add_row(what, f"{err:.3g}", f"{tol:.3g}", "ok" if ok else "[red]differs[/red]")
            console.print(t)
        for ph, d in self.ledger.items():
            (lc, lb), (pc, pb) = d["ledger"], d["plan"]
            mark = "=" if (lc, lb) == (pc, pb) else "≠"
            console.print(f"collectives {ph}: ledger {lc} calls, {lb:,} B per rank {mark} plan {pc} calls, "
                          f"{pb:,} B", markup=False)
        if self.split:
            console.print(f"split: {self.split.get('params_split', 0):.0%} of parameters, "
                          f"{self.split.get('flops_split', 0):.0%} of Linear FLOPs; parameter bytes per rank "
                          f"{self.split.get('vs_ideal', 0):.2f}× the mode's ideal", markup=False)
        colour = {"exact": "green", "mismatch": "red", "refused": "yellow"}[self.verdict]
        if self.seconds_by_phase:
            console.print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds_by_phase.items()),
                          markup=False)
        console.print(f"[bold {colour}]{self.verdict.upper()}[/bold {colour}] (exit {self.exit_code}) in "
                      f"{self.seconds:.1f} s" + (f": {self.reason}" if self.reason else ""))


# --------------------------------------------------------------------------- inputs

def resolve_target(spec):
    """``(config, model class or None, model or None, label)`` for a model spec: a
    module, a config, a local folder or config.json, a known ``arch:size`` name
    (``autoshard plan --help``) or ``pkg.module:fn`` (a function returning a model)."""
    from .io.builder import resolve_class

    if isinstance(spec, torch.nn.Module):
        return spec.config, type(spec), spec, type(spec).__name__
    if not isinstance(spec, (str, os.PathLike)):        # a config
        return spec, resolve_class(spec), None, type(spec).__name__
    s = str(spec)
    if os.path.exists(s) or s.lower() in _known() or ":" not in s:
        from .known import resolve_model

        try:
            cfg = resolve_model(s)
        except ConfigError as e:
            raise ConfigError(f"{e}; or pkg.module:function returning a model") from e
        return cfg, resolve_class(cfg), None, s
    model = _call(s)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ConfigError(f"{s!r} returned {type(model).__name__}, not a transformers model")
    return model.config, type(model), model, s


def _known() -> set:
    from .known import DEFAULT_SIZES, KNOWN_MODELS

    return set(KNOWN_MODELS) | set(DEFAULT_SIZES)


def _batch(model, b: int, s: int, replicas: int) -> dict:
    """The model's own inputs for ``b`` rows of ``s`` tokens; in each replica's block a row
    with left padding and a row with two ignored labels (every replica alike, so the
    per-replica losses average to the global one)."""
    from .passes.capture import default_example_inputs

    out = default_example_inputs(model, batch_size=b, seq_len=s)
    per = b // replicas
    for r in range(replicas):
        lo = r * per
        if "attention_mask" in out and per > 1 and s > 3:
            out["attention_mask"][lo + 1, :2] = 0
        lab = out.get("labels")
        if isinstance(lab, torch.Tensor) and lab.dim() == 2 and s > 2:
            lab[lo, :2] = -100
    return out


def _dropout_off(model):
    """``model`` with every dropout probability at 0, in its modules as built (a config
    changed after construction no longer reaches them)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for k, v in list(vars(m).items()):
            if isinstance(v, float) and v > 0 and "dropout" in k:
                setattr(m, k, 0.0)
    _no_dropout(model.config)
    return model


def _no_dropout(config) -> list:
    """Dropout probabilities set to 0 in ``config`` (in place, nested configs too): the
    comparison runs in train mode with the same values on both sides."""
    changed = []
    for k, v in list(vars(config).items()):
        if isinstance(v, float) and v > 0 and ("dropout" in k or "pdrop" in k or k == "drop_path_rate"):
            setattr(config, k, 0.0)
            changed.append((k, v, 0.0))
        elif hasattr(v, "to_dict") and hasattr(v, "model_type"):
            changed += [(f"{k}.{a}", x, y) for a, x, y in _no_dropout(v)]
    return changed


# --------------------------------------------------------------------------- ranks

def _describe(e: BaseException) -> dict:
    from .ir.errors import CaptureError, ShardingError
    from .runtime.selfcheck import PlanCheckError

    node = getattr(e, "node", None)
    lines = str(e).splitlines()
    node_line = next((x.strip() for x in lines if x.strip().startswith("node:")), "")
    if isinstance(e, PlanCheckError):
        kind = "mismatch"
    elif isinstance(e, (ShardingError, ConfigError, CaptureError)):
        kind = "refused"
    else:
        kind = "crash"
    return {"kind": kind, "type": type(e).__name__, "message": str(e), "node": node_line or (str(node) if node else ""),
            "traceback": traceback.format_exc()}


def _rank_entry(rank: int, world: int, folder: str, job: dict) -> None:
    """One rank, forked by :func:`_serve`: writes its result or its error to
    ``FOLDER/rank<RANK>.pt`` (whole or absent)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", CUDA_VISIBLE_DEVICES="")
    import torch.distributed as dist

    from .runtime.rendezvous import folder_store

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=job["pg_timeout"])
        store = folder_store(rank, world, folder, timeout)
        os.environ["MASTER_PORT"] = str(store.port)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        result = run_rank(rank, world, job)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        result = (rank, "error", _describe(e))
    _write(folder, rank, result)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _write(folder: str, rank: int, result) -> None:
    tmp = os.path.join(folder, f".rank{rank}.pt")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.pt"))


def _serve(world: int, folder: str) -> None:
    """``python -m autoshard.verification WORLD FOLDER``: import what a rank needs once, wait
    for ``FOLDER/job.pt`` (or ``FOLDER/cancel``), then fork the ``world`` ranks (this process
    has run no parallel op, so forking it is safe) and wait for them; a rank that dies
    without a result gets an error record."""
    for name in ("torch.distributed", "transformers", "autoshard.api", "autoshard.module",
                 "autoshard.launch.capture_share", "autoshard.runtime.compare"):
        importlib.import_module(name)       # once here, inherited by every rank

    job_path = os.path.join(folder, "job.pt")
    while not os.path.exists(job_path):
        if os.path.exists(os.path.join(folder, "cancel")):
            return
        time.sleep(0.05)
    job = torch.load(job_path, weights_only=False)      # imports the model's own module too
    pids = {}
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank_entry(r, world, folder, job)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        pids[pid] = r
    while pids:
        pid, status = os.waitpid(-1, 0)
        r = pids.pop(pid, None)
        if r is not None and not os.path.exists(os.path.join(folder, f"rank{r}.pt")):
            _write(folder, r, (r, "error", {"kind": "crash", "type": "RankExited", "node": "", "traceback": "",
                                            "message": f"rank {r} ended without a result (wait status {status})"}))


def run_rank(rank: int, world: int, job: dict) -> tuple:
    """One rank's part of :func:`verify` in a process whose default group is up:
    ``(rank, "ok", figures)`` or ``(rank, "error", what failed)``, never raising."""
    try:
        if job.get("setup"):
            _call(job["setup"])
        return rank, "ok", _run_rank(rank, world, job)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        return rank, "error", _describe(e)


def _call(spec: str):
    """``pkg.module:fn()``; :class:`ConfigError` naming ``spec`` if it cannot be called."""
    mod, _, fn = spec.partition(":")
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"cannot find {spec!r} (want pkg.module:function): {type(e).__name__}: {e}") from e
    return f()


def _build(job: dict):
    from .io.builder import construct

    torch.manual_seed(job["seed"])
    if job.get("fn"):                   # --full of pkg.module:fn: the function's own model
        model = _dropout_off(_call(job["fn"]))
    elif job.get("folder"):             # --full of a folder with weights
        model = job["cls"].from_pretrained(job["folder"], config=job["config"])
    else:
        model = construct(copy.deepcopy(job["config"]), job["cls"])
        if job.get("state"):
            model.load_state_dict(job["state"])
    return model.float().train()


def _run_rank(rank: int, world: int, job: dict) -> dict:
    import autoshard
    from .policies import make_policy
    from .runtime.collectives import CommLedger

    clock = _Clock(job.get("t_start"))
    clock.lap("start-up")
    dense = _build(job)
    dense32 = None
    if job["dtype"] == "bf16":
        dense32 = copy.deepcopy(dense)
        dense = dense.to(torch.bfloat16)
    model = copy.deepcopy(dense)
    b, s, dp = job["batch"], job["seq"], job["dp"]
    inputs = _batch(dense, b, s, dp)
    tp = world // dp
    per = b // dp
    rows = slice((rank // tp) * per, (rank // tp + 1) * per)
    local = {k: v[rows] for k, v in inputs.items()}
    pol = make_policy(job["mode"], world, job["depth"], dp)

    out_d = dense(**inputs)
    out_d.loss.backward()
    clock.lap("dense run")
    cap, ref_vals, node_tol = _dense_values(model, dense32, pol, inputs, local, clock)
    sharded = autoshard.shard(model, mode=job["mode"], depth=job["depth"], dp=dp, example_inputs=local, captured=cap)
    plan = sharded.plan
    clock.lap("shard (plan, rewrite)")
    cmp_rows = sharded.compare_values(ref_vals, local, atol=_FP32_TOL if node_tol is None else node_tol,
                                      rtol=_FP32_TOL if node_tol is None else _BF16_EPS)
    clock.lap("node comparison")
    with CommLedger() as fwd:
        out = sharded(**local)
    with CommLedger() as bwd:
        out.loss.backward()
    checks, missing = _check_run(rank, out, out_d, sharded, dense, dense32, inputs, rows, plan)
    kinds = {n.name: (n.kind, n.module or "") for n in plan.nodes}
    clock.lap("sharded run, checks, step")
    return {"seconds": clock.laps,
        "nodes": cmp_rows, "checks": checks, "missing_grads": missing, "kinds": kinds if rank == 0 else {},
        "ledger": {"fwd": {"ledger": (fwd.count(), fwd.bytes_per_rank()),
                           "plan": (len(plan.comms("fwd")), plan.comm_bytes_per_rank("fwd"))},
                   "bwd": {"ledger": (bwd.count(), bwd.bytes_per_rank()),
                           "plan": (len(plan.comms("bwd")), plan.comm_bytes_per_rank("bwd"))}},
        "split": {k: v for k, v in plan.parallel_fraction().items() if isinstance(v, float)} if rank == 0 else {},
    }


def _dense_values(model, dense32, pol, inputs: dict, local: dict, clock) -> tuple:
    """``(capture, node values, node tolerances)``: the launch pipeline's capture (shared by
    the ranks, handed to shard() after) and prepare stages, the prepared graph run on every
    replica's rows to record each node's dense value; in bf16 each node's tolerance is twice
    the dense bf16 run's own error against fp32 (None in fp32)."""
    from .config import ShardConfig
    from .launch.pipeline import PIPELINE, LaunchState
    from .runtime import compare

    state = PIPELINE.run(LaunchState(config=ShardConfig(), model=model, example_inputs=local, policy=pol), "capture")
    clock.lap("capture (shared)")
    prepared = PIPELINE.run(state, "prepare").prepared
    # the recording runs the graph, whose in-place buffer updates (a training BatchNorm's
    # running statistics and num_batches_tracked) would otherwise be where the sharded run starts
    kept = [(t, t.detach().clone()) for m in (model, prepared.module) for _, t in m.named_buffers()]
    with torch.no_grad():
        ref_vals = compare.record(prepared.module, {**inputs, **prepared.constants})     # every replica's rows
        for t, v in kept:
            t.copy_(v)
    clock.lap("dense node values")
    if dense32 is None:
        return state.captured, ref_vals, None
    cap32 = PIPELINE.run(state.but(model=copy.deepcopy(dense32), captured=None), "capture", "prepare").prepared
    with torch.no_grad():
        vals32 = compare.record(cap32.module, {**inputs, **cap32.constants})
    node_tol = {k: 2 * _noise(v, vals32[k]) + 1e-6 for k, v in ref_vals.items() if isinstance(v, torch.Tensor)
                and v.is_floating_point() and isinstance(vals32.get(k), torch.Tensor) and vals32[k].shape == v.shape
                and v.numel()}
    return state.captured, ref_vals, node_tol


def _check_run(rank: int, out, out_d, sharded, dense, dense32, inputs: dict, rows, plan) -> tuple[dict, list]:
    """``(checks, missing gradients)``: loss, logits, every local gradient and the parameters
    after one SGD step, sharded against dense (fp32: ``_FP32_TOL``; bf16: twice the dense
    bf16 run's own error against fp32)."""
    checks = {}
    ref32 = None
    if dense32 is not None:
        out32 = dense32(**inputs)
        out32.loss.backward()
        ref32 = (out32, dict(dense32.named_parameters(remove_duplicate=False)))

    def check(what, got, ref, ref_hi=None):
        got, ref = got.detach().double(), ref.detach().double()
        err = float((got - ref).abs().max()) if got.numel() else 0.0
        if ref_hi is None:
            tol = float((_FP32_TOL + _FP32_TOL * ref.abs()).max()) if ref.numel() else _FP32_TOL
            ok = bool(torch.allclose(got, ref, atol=_FP32_TOL, rtol=_FP32_TOL))
        else:
            tol = 2 * _noise(ref, ref_hi) + 1e-6
            ok = err <= tol
        prev = checks.get(what)
        checks[what] = (max(err, prev[0]) if prev else err, tol, ok and (prev[2] if prev else True))

    hi = ref32[0] if ref32 else None
    check("loss", out.loss, out_d.loss, hi.loss if hi is not None else None)
    if getattr(out, "logits", None) is not None and getattr(out_d, "logits", None) is not None:
        check("logits", out.logits, out_d.logits[rows], hi.logits[rows] if hi is not None else None)
    dparams = dict(dense.named_parameters(remove_duplicate=False))
    sparams = dict(sharded.named_parameters(remove_duplicate=False))
    mesh = plan.mesh
    missing = []
    for pp in plan.params:
        if pp.is_buffer or not pp.trainable:
            continue
        g, dg = sparams[pp.name].grad, dparams[pp.name].grad
        if dg is None:
            # unused by the dense forward too (DINOv2's mask_token without bool_masked_pos):
            # the sharded side may hold no gradient or zeros, nothing else
            if g is not None:
                check("gradients", g, torch.zeros_like(g), None)
            continue
        if g is None:
            missing.append(pp.name)
            continue
        ref_hi = pp.spec.local(pp.pad(ref32[1][pp.name].grad), mesh, rank) if ref32 else None
        check("gradients", g, pp.spec.local(pp.pad(dparams[pp.name].grad), mesh, rank), ref_hi)
    # one optimizer step each: SGD, whose update is the gradient's own scale (Adam's first
    # step divides by |g| and turns 1e-9 of gradient noise into lr-sized differences)
    for m in (dense, sharded) + ((dense32,) if ref32 else ()):
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=_LR).step()
    for pp in plan.params:
        if pp.is_buffer or not pp.trainable:
            continue
        ref_hi = pp.spec.local(pp.pad(ref32[1][pp.name].detach()), mesh, rank) if ref32 else None
        check("parameters after one SGD step", sparams[pp.name],
              pp.spec.local(pp.pad(dparams[pp.name].detach()), mesh, rank), ref_hi)
    return checks, missing


def _noise(low: torch.Tensor, high: torch.Tensor) -> float:
    """The largest ``|low − high|`` of a dense value in bf16 against fp32, equal values
    (equal infinities: a -inf mask) and NaN on both sides counting 0; a NaN on one side
    only counts as infinite (the dense bf16 run itself lost the value)."""
    from .runtime.compare import abs_diff

    return float(abs_diff(low, high).nan_to_num(float("inf")).max())


class _Clock:
    """Seconds per phase, from ``t0`` (a ``time.time()``; default now)."""

    def __init__(self, t0=None):
        self.t = t0 if t0 is not None else time.time()
        self.laps: dict = {}

    def lap(self, what: str) -> None:
        now = time.time()
        self.laps[what] = round(now - self.t, 2)
        self.t = now


class _Ranks:
    """The ranks of one :func:`verify` run: a ``python -m autoshard.verification`` server started
    at once (its imports overlap the caller's planning), which forks the ranks when
    :meth:`run` hands it the job. No torchrun, no ``multiprocessing`` (the caller's
    ``__main__`` is never re-imported); :meth:`close` kills whatever is left."""

    def __init__(self, world: int):
        import subprocess
        import sys
        import tempfile

        self.world = world
        self._tmp = tempfile.TemporaryDirectory(prefix="autoshard-verify-")
        self.folder = self._tmp.name
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "autoshard.verification", str(world), self.folder], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def run(self, job: dict, timeout: float, progress) -> list:
        """``[(rank, status, payload)]`` of every rank. A rank that fails stops the others
        after a short grace; the whole run stops at ``timeout``."""
        tmp = os.path.join(self.folder, ".job.pt")
        torch.save(job, tmp)
        os.replace(tmp, os.path.join(self.folder, "job.pt"))
        world, got = self.world, {}
        deadline = time.monotonic() + timeout
        first_error = None
        while len(got) < world:
            now = time.monotonic()
            if now > deadline or (first_error is not None and now > first_error + 15):
                break
            for r in range(world):
                path = os.path.join(self.folder, f"rank{r}.pt")
                if r not in got and os.path.exists(path):
                    got[r] = torch.load(path, weights_only=False)
                    if got[r][1] == "error" and first_error is None:
                        first_error = time.monotonic()
                    if progress:
                        progress(len(got), world)
            if len(got) < world and self.proc.poll() is not None and not any(
                    os.path.exists(os.path.join(self.folder, f"rank{r}.pt")) for r in range(world) if r not in got):
                err = (self.proc.stderr.read() or "")[-3000:]
                for r in range(world):
                    got.setdefault(r, (r, "error", {"kind": "crash", "type": "RankExited", "node": "", "traceback": "",
                                                    "message": f"the ranks' process exited with code "
                                                               f"{self.proc.returncode}\n{err}"}))
                break
            time.sleep(0.1)
        for r in range(world):
            if r not in got:
                why = f"timed out (limit {timeout:.0f} s)" if first_error is None else \
                    "was stopped after another rank failed"
                got[r] = (r, "error", {"kind": "crash" if first_error is None else "lost", "type": "RankLost",
                                       "message": f"rank {r} {why}", "node": "", "traceback": ""})
        return [got[r] for r in range(world)]

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            open(os.path.join(self.folder, "cancel"), "w").close()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)        # the server and every forked rank
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        self.proc.stderr.close()
        self._tmp.cleanup()


# --------------------------------------------------------------------------- verify

def verify(model_or_config, *, world_size: int, mode: str, depth: int | None = None, dp: int = 1,
           dtype: str = "fp32", full: bool = False, batch_size: int | None = None, seq_len: int = 8,
           setup: str | None = None, timeout: float = 600.0, seed: int = 0, progress=None) -> VerifyReport:
    """Prove ``mode`` on ``world_size`` ranks exact for this architecture (module doc).

    Args:
        model_or_config: a transformers model, a config, a local folder (config.json,
            weights optional), a ``config.json``, a known name (``"llama:7b"``) or
            ``"pkg.module:fn"`` returning a model.
        world_size, mode, depth, dp: the layout, as :func:`autoshard.shard` takes it.
        dtype: ``"fp32"`` (atol = rtol = 1e-5) or ``"bf16"`` (twice the dense bf16 error).
        full: the real sizes (and the folder's weights, if any) instead of a shrunk copy,
            refused when ``world_size`` copies would not fit in this machine's memory.
        batch_size: the global batch (default: the smallest that splits, said in the report).
        seq_len: tokens per row (rounded up to what the mode's sequence split needs).
        setup: ``"pkg.module:fn"`` called on every rank before anything else, and in this
            process before it plans (e.g. to register a rule; what it changes here stays).
        timeout: seconds for the whole run of the ranks.
        progress: ``progress(ranks done, world_size)``, called as ranks finish.

    Returns:
        a :class:`VerifyReport`; ``exit_code`` 0 exact, 1 mismatch, 2 refused.
    """
    from .policies import make_policy

    t0 = time.perf_counter()
    if dtype not in ("fp32", "bf16"):
        raise ConfigError(f"dtype {dtype!r}: choose fp32 or bf16")
    cfg, cls, model, label = resolve_target(model_or_config)
    report = VerifyReport(model=label, mode=mode, world_size=world_size, depth=depth, dp=dp, dtype=dtype)

    def refuse(msg: str) -> VerifyReport:
        report.verdict, report.exit_code, report.reason = "refused", REFUSED, msg
        report.seconds = time.perf_counter() - t0
        return report

    try:
        pol = make_policy(mode, world_size, depth, dp)
    except AutoshardError as e:
        return refuse(f"{type(e).__name__}: {e}")
    # the ranks' process starts now: its imports overlap the planning below
    ranks = _Ranks(world_size)
    try:
        job = _job(model_or_config, report, cfg, cls, model, pol, full=full, batch_size=batch_size,
                   seq_len=seq_len, seed=seed, dtype=dtype, setup=setup, timeout=timeout)
        if isinstance(job, str):
            return refuse(job)
        # capture and plan here first, without processes: a refused architecture stops here,
        # and the ranks find the capture in the disk cache
        try:
            if setup:
                _call(setup)
            _plan_here(job, world_size)
        except AutoshardError as e:
            return refuse(_first_lines(e))
        report.seconds_by_phase["plan here (capture, plan)"] = round(time.perf_counter() - t0, 2)
        job["t_start"] = time.time()
        results = ranks.run(job, timeout, progress)
        report.seconds_by_phase["ranks"] = round(time.perf_counter() - t0 - report.seconds_by_phase[
            "plan here (capture, plan)"], 2)
        errors = [(r, p) for r, st, p in results if st == "error"]
        if errors:
            return _rank_error(report, errors, refuse, t0)
        payloads = [p for _, _, p in results]
        _fill(report, payloads)
        report.seconds = time.perf_counter() - t0
        return report
    finally:
        ranks.close()


def _job(model_or_config, report: VerifyReport, cfg, cls, model, pol, *, full: bool, batch_size, seq_len: int,
         seed: int, dtype: str, setup, timeout: float):
    """What every rank builds and runs (the model's config, shrunk unless ``full``; the batch;
    the layout), the shrinking and batch said in ``report``; a string: why ``full`` is refused."""
    world_size, dp, mode, depth = report.world_size, report.dp, report.mode, report.depth
    folder = str(model_or_config) if isinstance(model_or_config, (str, os.PathLike)) and \
        os.path.isdir(model_or_config) else None
    cfg = copy.deepcopy(cfg)
    if full:
        if model is None:
            n = _param_count(cfg, cls)
            need = n * 4 * 6 * (world_size + 1)
            have = _memory_bytes()
            if have and need > have * 0.8:
                return (f"--full needs about {need / 2**30:.1f} GiB for {world_size} ranks' dense and "
                        f"sharded copies of {n / 1e6:,.0f}M parameters; this machine has "
                        f"{have / 2**30:.1f} GiB: run without --full (a shrunk copy)")
    else:
        from .planning.shrink import shrink_that_runs

        small = shrink_that_runs(cfg, pol, cls)
        report.shrunk, report.shrink_note = [tuple(c) for c in small.changes], small.note
        cfg = small.config
        model = None        # rebuilt from the shrunk config on every rank
        folder = None
    report.shrunk += [tuple(c) for c in _no_dropout(cfg)]      # cfg is verify's own copy
    seq_split = pol.seq_split()
    seq = -(-max(seq_len, 2) // seq_split) * seq_split
    if batch_size is None:          # at least two rows per replica: one of them left-padded
        from .planning.validate import smallest_batch

        batch_size, report.batch_note = smallest_batch(pol, dp, rows=2)
    report.batch = (batch_size, seq)
    fn = str(model_or_config) if full and model is not None and isinstance(model_or_config, (str, os.PathLike)) \
        else None
    job = {"config": cfg, "cls": cls, "fn": fn, "folder": folder if full and _has_weights(folder) else None,
           "seed": seed, "dtype": dtype, "batch": batch_size, "seq": seq, "dp": dp, "mode": mode, "depth": depth,
           "setup": setup, "pg_timeout": max(60.0, timeout / 2)}
    if model is not None and full and fn is None:
        job["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return job


def _rank_error(report: VerifyReport, errors: list, refuse, t0: float) -> VerifyReport:
    """The report of a run where ranks failed: the most telling error (refused, then a
    mismatch, a crash, a lost rank; the lowest rank of that kind)."""
    real = [e for e in errors if e[1]["kind"] != "lost"] or errors
    r, e = min(real, key=lambda x: ({"refused": 0, "mismatch": 1, "crash": 2, "lost": 3}[x[1]["kind"]], x[0]))
    msg = f"{e['type']} on rank {r}: " + "\n".join(e["message"].splitlines()[:6])
    report.seconds = time.perf_counter() - t0
    if e["kind"] == "refused":
        return refuse(msg)
    report.verdict, report.exit_code = "mismatch", MISMATCH
    report.reason = msg + ("" if e["kind"] == "mismatch" else "\n" + e["traceback"][-2000:])
    report.first_node = e["node"]
    return report


def _fill(report: VerifyReport, payloads: list) -> None:
    from .runtime.compare import merge

    kinds = payloads[0]["kinds"]
    rows = merge([p["nodes"] for p in payloads])
    report.nodes = [dict(asdict(r), kind=kinds.get(r.name, ("", ""))[0], module=kinds.get(r.name, ("", ""))[1])
                    for r in rows]
    checks: dict = {}
    for p in payloads:
        for what, (err, tol, ok) in p["checks"].items():
            prev = checks.get(what)
            checks[what] = (max(err, prev[0]), max(tol, prev[1]), ok and prev[2]) if prev else (err, tol, ok)
    report.checks = checks
    report.ledger = payloads[0]["ledger"]
    ledger_ok = all(p["ledger"][ph]["ledger"] == p["ledger"][ph]["plan"] for p in payloads for ph in p["ledger"])
    report.split = payloads[0]["split"]
    slowest = max(payloads, key=lambda p: sum(p["seconds"].values()))
    report.seconds_by_phase.update({f"rank: {k}": v for k, v in slowest["seconds"].items()})
    missing = sorted({n for p in payloads for n in p["missing_grads"]})
    bad_nodes = [r for r in rows if not r.ok]
    bad_checks = [w for w, (_, _, ok) in checks.items() if not ok]
    if bad_nodes or bad_checks or missing or not ledger_ok:
        report.verdict, report.exit_code = "mismatch", MISMATCH
        if bad_nodes:
            n = bad_nodes[0]
            report.first_node = n.name
            report.reason = (f"first node that differs: {n.name} ({n.op}, {kinds.get(n.name, ('', ''))[1] or '-'}) "
                             f"{n.status}, max |sharded − dense| {n.max_abs:.3g}")
        elif bad_checks:
            report.reason = "differs: " + ", ".join(bad_checks)
        elif missing:
            report.reason = "no gradient on the sharded side for " + ", ".join(missing[:6])
        else:
            report.reason = "the collectives counted differ from the plan's"


def _plan_here(job: dict, world: int):
    """The plan the ranks will make, made in this process from the model they build (its
    capture stored in the disk cache for rank 0): raises what shard() would raise."""
    from .config import ShardConfig
    from .launch.pipeline import PIPELINE, LaunchState
    from .policies import make_policy

    model = _build(job)
    if job["dtype"] == "bf16":
        model = model.to(torch.bfloat16)
    b, s, dp = job["batch"], job["seq"], job["dp"]
    local = {k: v[: b // dp] for k, v in _batch(model, b, s, dp).items()}
    pol = make_policy(job["mode"], world, job["depth"], dp)
    frozen = frozenset(n for n, t in model.named_parameters(remove_duplicate=False) if not t.requires_grad)
    return PIPELINE.run(LaunchState(config=ShardConfig(), model=model, example_inputs=local, capture_with="cached",
                                    policy=pol, frozen=frozen, batch_size=b, seq_len=s),
                        "capture", "prepare", "plan").plan


def _first_lines(e: BaseException, n: int = 8) -> str:
    return f"{type(e).__name__}: " + "\n".join(str(e).splitlines()[:n])


def _param_count(cfg, cls) -> int:
    from .io.builder import model_from

    m = model_from(cfg, meta=True) if cls is None else None
    if m is None:
        with torch.device("meta"):
            m = cls(cfg)
    return sum(p.numel() for p in m.parameters())


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _has_weights(folder) -> bool:
    return bool(folder) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(folder))


if __name__ == "__main__":          # the ranks of verify(): python -m autoshard.verification WORLD FOLDER
    import sys

    _serve(int(sys.argv[1]), sys.argv[2])
