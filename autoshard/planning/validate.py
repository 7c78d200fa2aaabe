"""Up-front checks of everything :func:`autoshard.shard` is given.

Each check is a pure function of its arguments (the environment, the process
group's size, the model's parameters and config, the mesh, the example inputs)
that returns a list of :class:`Problem`; nothing here runs a collective. So every
rank, given the same arguments, finds the same problems and raises the same
:class:`~autoshard.ir.errors.ConfigError` before the first collective: a bad input
never leaves one rank waiting for another. :func:`raise_problems` raises every
error at once (one message, one line per problem) and turns the rest into
:class:`~autoshard.ir.errors.AutoshardWarning`. ``autoshard check`` prints the same
list without processes.

Example:
    >>> from transformers import LlamaConfig
    >>> from autoshard.ir.mesh import Mesh
    >>> cfg = LlamaConfig(hidden_size=48, intermediate_size=128, num_hidden_layers=1,
    ...                   num_attention_heads=3, num_key_value_heads=3, vocab_size=127)
    >>> [(p.what, p.error) for p in check_dims(cfg, "1d", Mesh(axes=("tp",), sizes=(2,)))]
    [('num_attention_heads', False)]

A vocabulary that does not divide is not a problem: it is padded to the split
(:mod:`autoshard.passes.pad`) and the plan says so; in 1d and 1d-sp heads, kv heads
and intermediate sizes are padded too (a warning with each rank's share).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..ir.errors import AutoshardWarning, ConfigError
from ..ir.log import warn
from ..ir.mesh import Mesh

__all__ = ["Problem", "smallest_batch", "check_environment", "check_group", "check_model", "check_dims", "check_example_inputs",
           "raise_problems", "dims_of", "check_batch", "check_seq", "check_min_seq"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Problem:
    """One finding: ``what`` names the input or dimension, ``message`` says why and
    what would work; ``error=False`` marks an exact fallback worth a warning."""

    what: str
    message: str
    error: bool = True

    def __str__(self) -> str:
        return self.message if self.message.startswith(self.what) else f"{self.what}: {self.message}"


def check_environment(environ: Mapping[str, str]) -> list[Problem]:
    """The torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): all
    present, integers where they must be, and consistent with each other."""
    present = [k for k in _ENV if k in environ]
    if not present:
        return [Problem("torchrun environment", "autoshard.shard needs torch.distributed: run under torchrun "
                        "(e.g. `torchrun --nproc-per-node 4 script.py`) or call init_process_group first; "
                        "to inspect a plan without processes use autoshard.plan(...)")]
    out = []
    missing = [k for k in _ENV if k not in environ]
    if missing:
        out.append(Problem("torchrun environment", f"{', '.join(missing)} not set while "
                           f"{', '.join(present)} {'is' if len(present) == 1 else 'are'}; run under torchrun, "
                           f"or set all of {', '.join(_ENV)}"))
    ints = {}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        if k in environ:
            try:
                ints[k] = int(environ[k])
            except ValueError:
                out.append(Problem("torchrun environment", f"{k}={environ[k]!r} is not an integer"))
    w, r = ints.get("WORLD_SIZE"), ints.get("RANK")
    if w is not None and w < 1:
        out.append(Problem("torchrun environment", f"WORLD_SIZE={w} must be >= 1"))
    if w is not None and r is not None and not 0 <= r < w:
        out.append(Problem("torchrun environment", f"RANK={r} is outside 0..{w - 1} (WORLD_SIZE={w})"))
    lw, lr = ints.get("LOCAL_WORLD_SIZE"), ints.get("LOCAL_RANK")
    if lw is not None and lr is not None and not 0 <= lr < lw:
        out.append(Problem("torchrun environment", f"LOCAL_RANK={lr} is outside 0..{lw - 1} "
                           f"(LOCAL_WORLD_SIZE={lw})"))
    if lw is not None and w is not None and lw > w:
        out.append(Problem("torchrun environment", f"LOCAL_WORLD_SIZE={lw} exceeds WORLD_SIZE={w}"))
    p = ints.get("MASTER_PORT")
    if p is not None and not 0 < p < 65536:
        out.append(Problem("torchrun environment", f"MASTER_PORT={p} is not a TCP port (1..65535)"))
    return out


def check_group(world: int, environ: Mapping[str, str]) -> list[Problem]:
    """The default process group against what torchrun announced (WORLD_SIZE)."""
    raw = environ.get("WORLD_SIZE")
    try:
        announced = int(raw) if raw is not None else None
    except ValueError:
        announced = None
    if announced is not None and announced != world:
        return [Problem("process group", f"the default process group has {world} ranks but WORLD_SIZE={announced}; "
                        f"autoshard shards over the whole default group: init_process_group with "
                        f"world_size={announced}, or launch {world} processes")]
    return []


def check_model(model: torch.nn.Module, *, weights_given: bool = False) -> list[Problem]:
    """Parameters and buffers: one floating dtype, one device (meta only if ``weights=`` fills them)."""
    out = []
    dtypes: dict[torch.dtype, list[str]] = {}
    devices: dict[str, list[str]] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and name in dict(model.named_parameters()):
            dtypes.setdefault(t.dtype, []).append(name)
        devices.setdefault(t.device.type, []).append(name)

    def some(names):
        return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")

    if len(dtypes) > 1:
        parts = "; ".join(f"{str(d).removeprefix('torch.')}: {some(n)}" for d, n in dtypes.items())
        out.append(Problem("dtype", f"parameters mix dtypes ({parts}); one dtype is sharded exactly: "
                           f"call model.to(torch.float32) (or bfloat16) first, or use autocast for mixed precision"))
    real = {d: n for d, n in devices.items() if d != "meta"}
    if len(real) > 1:
        parts = "; ".join(f"{d}: {some(n)}" for d, n in real.items())
        out.append(Problem("device", f"parameters and buffers live on several devices ({parts}); "
                           f"move the model to one device (model.to(...)) before sharding"))
    if "meta" in devices and not weights_given:
        out.append(Problem("device", f"{some(devices['meta'])} are on the meta device and no weights= callback "
                           f"fills them; load real weights, or use autoshard.from_pretrained(folder, ...)"))
    return out


def dims_of(config) -> dict[str, int]:
    """The dimensions a split depends on, read from a Hugging Face config (GPT-2 names too)."""
    def get(*names):
        for n in names:
            v = getattr(config, n, None)
            if isinstance(v, int) and v > 0:
                return v
        return None

    heads = get("num_attention_heads", "n_head")
    hidden = get("hidden_size", "n_embd", "d_model")
    out = {}
    if heads:
        out["num_attention_heads"] = heads
    kv = get("num_key_value_heads")
    if kv and kv != heads:
        out["num_key_value_heads"] = kv
    if hidden:
        out["hidden_size"] = hidden
    inter = get("intermediate_size", "n_inner", "ffn_dim")
    if inter is None and hidden and getattr(config, "model_type", "") == "gpt2":
        inter = 4 * hidden
    if inter:
        out["intermediate_size"] = inter
    vocab = get("vocab_size")
    if vocab:
        out["vocab_size"] = vocab
    return out


# What happens when a dimension does not divide: errors refuse; the others are exact
# replicated fallbacks the plan shows as rows (weight "replicated") and a warning names.
_SEVERE = {"num_attention_heads": "attention would be replicated or gathered on every rank",
           "hidden_size": "every Linear and norm would be gathered to a replicated layout"}
_MILD = {"num_key_value_heads": "k/v projections stay replicated (exact; the usual GQA fallback)",
         "intermediate_size": "the MLP Linears stay replicated (exact, no memory saving)",
         }


# what a mode that pads widths (Policy.width_multiple() > 1) pads instead of holding it whole
_PADDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def uneven_shares(n: int, c: int) -> str:
    """The real units each of ``c`` ranks holds of ``n`` padded to a multiple of ``c``
    (``torch.chunk``'s shares: ⌈n/c⌉ each, the last ones less, or none), as the plan prints them.

    >>> uneven_shares(8, 3), uneven_shares(12, 8)
    ('3, 3, 2', '2, 2, 2, 2, 2, 2, 0, 0')
    """
    k = -(-n // c)
    return ", ".join(str(max(0, min(k, n - r * k))) for r in range(c))


#: config fields naming a norm's epsilon: RMSNorm (``rms_norm_eps``) or LayerNorm, whose statistics
#: the pad pass takes over the dense hidden size (:func:`autoshard.passes.pad.pad_hidden`)
_NORM_EPS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


def check_dims(config, policy, mesh: Mesh | None = None, *, strict: bool = True) -> list[Problem]:
    """Heads / kv heads / hidden / intermediate / vocab against ``policy``'s split.

    ``policy`` is a :class:`~autoshard.policies.base.Policy` (on its mesh), or a
    mode name with its ``mesh``. A dimension the split does not divide is named
    with the world sizes that would divide it. Heads and hidden are errors
    (``strict=False``: warnings, as for ``mode='auto'``, which chose the layout
    knowing it); kv heads and intermediate fall back to replicated weights,
    exactly, with a warning; a vocabulary is padded (:mod:`autoshard.passes.pad`).
    A mode that pads widths (1d, 1d-sp: :meth:`~autoshard.policies.base.Policy.width_multiple`)
    pads heads, kv heads and intermediate sizes too: a warning with each rank's share."""
    if config is None:
        return []
    if isinstance(policy, str):
        from ..policies import POLICIES

        if policy not in POLICIES:
            raise ConfigError(f"unknown mode {policy!r}; valid modes: {', '.join(repr(m) for m in POLICIES)}")
        policy = POLICIES[policy](mesh)
    splits, label = policy.dim_splits()
    out = []
    pads = policy.width_multiple() > 1
    for what, n in dims_of(config).items():
        c = splits.get(what, 1)
        if c <= 1 or n % c == 0 or what == "vocab_size":   # the vocabulary is padded (passes/pad.py)
            continue
        heads = dims_of(config).get("num_attention_heads", 0)
        if pads and what == "num_key_value_heads" and n < c and c % n == 0 and heads % n == 0:
            out.append(Problem(what, f"{what}={n} is fewer than the {policy.name} split {c} ({label}): each kv head "
                               f"is held by the {c // n} ranks whose query heads read it, its gradient summed over "
                               f"them (exact)", error=False))
            continue
        if pads and what in _PADDED:
            # padded with zero units (passes/pad.py, pad_widths): exact; said so, with each rank's share
            out.append(Problem(what, f"{what}={n} does not divide the {policy.name} split {c} ({label}): "
                               f"padded to {-(-n // c) * c}, each rank holds {uneven_shares(n, c)} of them "
                               f"(exact; the largest share sets the memory and time per rank)", error=False))
            continue
        if pads and what == "hidden_size" and any(getattr(config, k, None) is not None for k in _NORM_EPS):
            # passes/pad.py, pad_hidden: an RMSNorm's mean rescaled to the dense width, a LayerNorm's mean and
            # variance taken over the dense columns only
            out.append(Problem(what, f"{what}={n} does not divide the {policy.name} split {c} ({label}): padded with "
                               f"zero columns to {-(-n // c) * c}, the norms' statistics taken over the dense {n} "
                               f"(exact)", error=False))
            continue
        worlds = policy.valid_world_sizes(n)
        valid = ", ".join(map(str, worlds[:8])) + (" …" if len(worlds) > 8 else "") or "none"
        severe = what in _SEVERE
        why = _SEVERE.get(what) or _MILD[what]
        out.append(Problem(what, f"{what}={n} is not divisible by the {policy.name} split {c} ({label}); {why}. "
                           f"Valid {policy.size_unit} for {n}: {valid}", error=severe and strict))
    return out


def check_example_inputs(example_inputs, *, config=None, batch_split: int = 1, batch_label: str = "") -> list[Problem]:
    """The inputs lead with a main input (``input_ids``, ``pixel_values``,
    ``input_features``, ...; :data:`~autoshard.ir.signature.MAIN_INPUTS`); token ids
    are a 2-D integer [batch, seq] tensor; the other tensors agree with the batch
    (and the sequence); seq fits the positions; the batch splits over the batch axes."""
    from autoshard.ir.signature import MAIN_INPUTS, main_input

    if example_inputs is None:
        return []
    if not isinstance(example_inputs, Mapping):
        return [Problem("example_inputs", f"must be a dict of Hugging Face keyword arguments, "
                        f"got {type(example_inputs).__name__}")]
    main = main_input(example_inputs)
    if main is None:
        return [Problem("example_inputs", f"must contain a main input tensor (one of {', '.join(MAIN_INPUTS)}), "
                        f"got keys {sorted(example_inputs)}")]
    ids = example_inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor):       # images, audio, embeddings: the batch is the main input's dim 0
        lead = example_inputs[main]
        b = int(lead.shape[0])
        out = [Problem(k, f"shape {list(v.shape)} does not match {main} {list(lead.shape)} (expected [{b}, ...])")
               for k, v in example_inputs.items()
               if isinstance(v, torch.Tensor) and k != main and v.dim() >= 1 and v.shape[0] != b]
        if lead.dim() < 2:
            out.append(Problem(main, f"must have a batch dim, got shape {list(lead.shape)}; "
                                     f"add it with {main}.unsqueeze(0)"))
        return out + check_batch(b, batch_split, batch_label, source=f"example_inputs[{main!r}]")
    out = []
    if ids.dim() != 2:
        return [Problem("input_ids", f"must be [batch, seq], got shape {list(ids.shape)}"
                        + ("; add the batch dim with input_ids.unsqueeze(0)" if ids.dim() == 1 else ""))]
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        out.append(Problem("input_ids", f"must hold integer token ids, got dtype {str(ids.dtype).removeprefix('torch.')}"))
    b, s = ids.shape
    if b < 1 or s < 2:
        out.append(Problem("input_ids", f"example shape [{b}, {s}]: capture needs batch >= 1 and seq >= 2 "
                           f"(export specialises sequence lengths 0 and 1)"))
    for k, v in example_inputs.items():
        if k == "input_ids" or not isinstance(v, torch.Tensor):
            continue
        same = k in ("attention_mask", "token_type_ids", "position_ids")
        if (same and tuple(v.shape) != (b, s) and not (k == "position_ids" and tuple(v.shape) == (1, s))) or \
                (not same and v.dim() >= 1 and v.shape[0] != b):
            want = f"[{b}, {s}]" if same else f"[{b}, ...]"
            out.append(Problem(k, f"shape {list(v.shape)} does not match input_ids {list(ids.shape)} (expected {want})"))
    limit = None
    for n in ("max_position_embeddings", "n_positions"):
        v = getattr(config, n, None) if config is not None else None
        if isinstance(v, int) and v > 0:
            limit, lname = v, n
            break
    if limit is not None and s > limit:
        out.append(Problem("input_ids", f"sequence length {s} exceeds the model's {lname}={limit}"))
    vocab = getattr(config, "vocab_size", None) if config is not None else None
    if isinstance(vocab, int) and ids.numel() and not ids.dtype.is_floating_point and ids.device.type != "meta":
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            out.append(Problem("input_ids", f"token ids span {lo}..{hi}, outside the vocabulary 0..{vocab - 1}"))
    return out + check_batch(b, batch_split, batch_label, source="example_inputs['input_ids']")


def check_batch(batch: int, split: int, label: str, *, source: str) -> list[Problem]:
    """A batch of ``batch`` rows (from ``source``) against the ``split`` blocks it is
    cut into (``label`` names the axes): each block must hold whole rows.

    >>> [str(p) for p in check_batch(6, 4, "2d splits the batch over row[4]", source="batch_size")]
    ['batch size 6 of batch_size is not divisible by the batch split 4 (2d splits the batch over row[4]); use a multiple of 4, e.g. 4, 8']
    """
    if split <= 1 or batch % split == 0:
        return []
    lo = batch - batch % split
    sug = ", ".join(str(x) for x in (lo, lo + split) if x > 0)
    return [Problem("batch", f"batch size {batch} of {source} is not divisible by the batch split {split} "
                             f"({label}); use a multiple of {split}, e.g. {sug}")]


def check_seq(seq: int, split: int, *, source: str, why: str = "") -> list[Problem]:
    """A sequence of ``seq`` tokens against the sequence split (1d-sp's ``tp``, context
    parallelism's ``cp`` blocks, twice as many chunks in its balanced order); ``why`` says
    what cuts it (:meth:`autoshard.policies.base.Policy.seq_split_why`).

    >>> [str(p) for p in check_seq(6, 4, source="input_ids")]
    ["sequence length 6 of input_ids is not divisible by the sequence split 4 (the sequence is cut into 4 blocks); valid lengths are the multiples of 4 (4 or 8 near 6): pad the sequence, or use mode='1d' with cp=1"]
    """
    if split <= 1 or seq % split == 0:
        return []
    below, above = seq - seq % split, seq + split - seq % split
    near = f"{below} or {above}" if below else f"{above}"
    return [Problem("seq", f"sequence length {seq} of {source} is not divisible by the sequence split {split} "
                           f"({why or f'the sequence is cut into {split} blocks'}); valid lengths are the "
                           f"multiples of {split} ({near} near {seq}): pad the sequence, or use mode='1d' with cp=1")]


def raise_problems(problems: list[Problem], context: str, *, stacklevel: int = 3) -> None:
    """Raise one :class:`ConfigError` listing every error; warn about the rest."""
    errors = [p for p in problems if p.error]
    for p in problems:
        if not p.error:
            warn(f"{context}: {p}", AutoshardWarning, stacklevel=stacklevel)
    if len(errors) == 1:
        raise ConfigError(f"{context}: {errors[0]}")
    if errors:
        raise ConfigError(f"{context}: {len(errors)} problems:\n" + "\n".join(f"  - {p}" for p in errors))


def smallest_batch(policy, dp: int = 1, rows: int = 1) -> tuple[int, str]:
    """The smallest global batch that splits over ``policy``'s batch axes and ``dp``
    replicas (with at least ``rows`` rows per replica), and a sentence saying so."""
    split, label = policy.batch_split()
    split = max(split, 1)
    b = split * -(-rows // split) * dp
    why = label if split > 1 else "no batch split"
    least = f", at least {rows} rows per replica" if rows > 1 else ""
    return b, f"batch {b}: the smallest global batch that splits ({why}" + (f", × dp{dp}" if dp > 1 else "") + \
        f"{least}); pass --batch-size to choose another"


def check_min_seq(seq: int, plan, *, source: str) -> list[Problem]:
    """A sequence of ``seq`` tokens against :attr:`~autoshard.ir.plan.ShardingPlan.min_seq_len`:
    a convolution along a cp-split sequence reads its halo from the neighbouring block only,
    so each block must be at least as long as the halo."""
    need = plan.min_seq_len
    if seq >= need:
        return []
    blocks = plan.cp_blocks
    return [Problem("seq", f"sequence length {seq} of {source} is shorter than {need}: a convolution along the "
                           f"sequence reaches {need // blocks} row(s) past the edge of each of its {blocks} cp blocks, "
                           f"so each needs {need // blocks}; valid lengths: multiples of {blocks} from {need}")]


def check_ep(ep, *, mode: str, dp: int, cp: int, fsdp: bool = False) -> list[Problem]:
    """Expert parallelism's size against the layout, before any collective: an integer
    ``>= 1``; above 1, ``mode="1d"`` (the one mode it composes with today; ``"auto"`` searches
    the 1d layouts whose dp × cp ``ep`` divides), a divisor of
    the data-parallel × context-parallel ranks it borrows (below their number, each block
    of experts is held by ``dp·cp / ep`` of them), without FSDP (docs/design.md, "Expert
    parallelism").

    >>> [p.message for p in check_ep(3, mode="1d", dp=4, cp=1)]
    ['ep=3 must divide dp × cp = 4 (the ranks expert parallelism borrows); valid ep: 1, 2, 4']
    >>> check_ep(2, mode="1d", dp=4, cp=1)
    []
    """
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return [Problem("ep", f"ep={ep!r} must be a positive integer (1: the experts on every rank)")]
    if ep == 1:
        return []
    n = dp * cp
    out = []
    if n % ep and not (mode == "auto" and n == 1):      # "auto" with dp = cp = 1 searches dp (and cp)
        valid = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        out.append(Problem("ep", f"ep={ep} must divide dp × cp = {n} (the ranks expert parallelism borrows); "
                                 f"valid ep: {valid}"))
    if mode not in ("1d", "auto"):         # "auto": the search keeps its 1d candidates
        out.append(Problem("ep", f"ep={ep} composes with mode='1d' only today, got mode={mode!r}; valid: mode='1d' "
                                 f"(or 'auto', which searches the 1d layouts with ep) or ep=1"))
    if fsdp:
        out.append(Problem("ep", f"ep={ep} with fsdp=True is not implemented yet; valid: fsdp=False or ep=1"))
    return out
