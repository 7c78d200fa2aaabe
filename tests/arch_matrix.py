"""The architecture × mode support matrix and the report made from it.

Each cell is planned without processes (one meta-device export per
architecture, shared by every mode) and classified as *pass* (no fallback),
*fallbacks* (exact, with re-layouts to whole tensors: how many, which ops) or
*refused* (a ShardingError / ConfigError naming the node and reason).
``tests/test_arch_matrix.py`` runs every cell on gloo ranks against the dense
model and regenerates the report to compare it with ``docs/support.md``.

Rewrite the report after a change to the rules::

    .venv/bin/python tests/arch_matrix.py            # writes docs/support.md
    .venv/bin/python tests/arch_matrix.py --check    # exit 1 if it differs
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from arch_models import ARCHS  # noqa: E402

SUPPORT_MD = os.path.join(os.path.dirname(_HERE), "docs", "support.md")

# (mode, world, depth): the mesh each mode is proven on
MODES = (("1d", 4, None), ("2d", 4, None), ("2.5d", 8, 2), ("3d", 8, None))
MESH = {"1d": "tp=4", "2d": "q=2", "2.5d": "q=2, d=2", "3d": "q=2"}

# gpt2 / llama / bert in every mode are cases of tests/test_equivalence.py (the same
# model, batch, mode and mesh, the same comparisons, fallbacks == [] and AdamW
# steps on top): test_arch_matrix.py does not run them a second time.
IN_EQUIVALENCE = {(a, m) for a in ("gpt2", "llama", "bert") for m, _, _ in MODES}
# mixtral in every mode is a case of tests/test_moe.py (the same comparisons, AdamW steps and
# the parameter-bytes bound on top): not run a second time here
IN_MOE = {("mixtral", m) for m, _, _ in MODES}

# cells run by the default selection; the rest are @pytest.mark.slow (8-rank runs
# cost 20-60 s each on a 2-core box).
EIGHT_RANK_DEFAULT = {("bloom", "2.5d"), ("phi3", "3d"), ("falcon", "2.5d")}

# The verdict every cell must keep: these have fallbacks, these are refused (the
# error names the node), every other cell passes. A change here is a regression or
# an improvement to record, not only a docs/support.md to regenerate.
# (gemma's one kv head: held as copies by the ranks reading it in 2d, 2.5d and 3d since issue 59)
EXPECTED_FALLBACKS = {(a, m) for a in ("bloom", "gpt_bigcode", "falcon") for m in ("2d", "2.5d", "3d")}
EXPECTED_REFUSED = {("debertav2", m) for m in ("2d", "2.5d", "3d")}

# architectures added in round 2: their 8-rank cells are outside `make test` (marked
# `extended`, ‡ in the report; `make test-extended` runs them) to keep the suite's time
ROUND2 = ("mixtral", "qwen3", "gptneo", "debertav2", "mistral", "opt")


def expected_status(arch: str, mode: str) -> str:
    if (arch, mode) in EXPECTED_REFUSED:
        return "refused"
    return "fallbacks" if (arch, mode) in EXPECTED_FALLBACKS else "pass"


def is_extended(arch: str, mode: str) -> bool:
    return arch in ROUND2 and dict((m, w) for m, w, _ in MODES)[mode] == 8 and (arch, mode) not in IN_MOE


# 1d cells whose 2d cell `make test` runs and whose 1d layout another cell already shows
# (mistral: llama's, opt: gpt2's, gpt_neox: the fused per-head QKV of bloom and falcon, t5: bart's
# encoder-decoder with cross-attention): slow, to keep `make test`'s time
SLOW_1D = {("mistral", "1d"), ("opt", "1d"), ("gpt_neox", "1d"), ("t5", "1d")}


def is_slow(arch: str, mode: str) -> bool:
    if (arch, mode) in SLOW_1D:
        return True
    if (arch, mode) in IN_EQUIVALENCE or (arch, mode) in IN_MOE:
        return False
    return dict((m, w) for m, w, _ in MODES)[mode] == 8 and (arch, mode) not in EIGHT_RANK_DEFAULT


@dataclass
class Cell:
    """What a plan says about one architecture in one mode."""

    status: str                                             # pass | fallbacks | refused
    fallbacks: list = field(default_factory=list)           # [(node, op, first note)]
    replicated: list = field(default_factory=list)          # Linears kept whole: [module path]
    reason: str = ""                                        # refused: first line of the error + node
    vs_ideal: float = 0.0                                   # param bytes per rank / the mode's ideal
    params_split: float = 0.0                               # share of parameters split
    flops_split: float = 0.0                                # share of Linear FLOPs with a split weight
    whole: list = field(default_factory=list)               # parameters furthest above their ideal share

    @property
    def fallback_nodes(self) -> list[str]:
        return [f[0] for f in self.fallbacks]


def reported(arch: str, mode: str, text: str | None = None) -> Cell:
    """The cell as the committed docs/support.md reports it: status, fallback node names
    and a refusal's reason, read back from the table row and the cell's section (what
    `make test`'s cells are run against without planning all 84; the slow
    test_support_md_is_generated_from_the_matrix checks the file against the plans)."""
    import re

    if text is None:
        with open(SUPPORT_MD) as f:
            text = f.read()
    i = 1 + [m for m, _, _ in MODES].index(mode)
    row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{arch}` ("))
    verdict = row.split(" | ")[i + 1]
    m = re.search(rf"^### {re.escape(arch)}, {re.escape(mode)}\n(.*?)(?=^### |\Z)", text, re.S | re.M)
    section = m.group(1) if m else ""
    if "**refused**" in verdict:
        reason = next(ln[len("- refused: "):] for ln in section.splitlines() if ln.startswith("- refused: "))
        return Cell(status="refused", reason=reason)
    fallbacks = [(n, op, "") for n, op in re.findall(r"^- fallback `([^`]+)` \(([^)]*)\)", section, re.M)]
    return Cell(status="fallbacks" if fallbacks else "pass", fallbacks=fallbacks)


def classify(plan) -> Cell:
    fb = [(n.name, n.op, next((x for x in n.notes if x.startswith("fallback")), "")) for n in plan.fallbacks]
    rep = [n.module or n.name for n in plan.nodes if n.kind == "linear" and n.weight == "replicated"]
    f = plan.parallel_fraction()
    return Cell(status="fallbacks" if fb else "pass", fallbacks=fb, replicated=rep, vs_ideal=f["vs_ideal"],
                params_split=f["params_split"], flops_split=f["flops_split"], whole=f["held_back"])


# a cell whose parameter bytes per rank exceed its mode's ideal by more than this
# lists the parameters that keep it there
IDEAL_SLACK = 1.15


def refused(err: Exception) -> Cell:
    lines = str(err).splitlines()
    node = next((x.strip() for x in lines if x.strip().startswith("node:")), "")
    return Cell(status="refused", reason=f"{type(err).__name__}: {lines[0] if lines else ''}" + (f" ({node})" if node else ""))


def build_meta(arch: str):
    import torch
    import transformers

    cls, cfg_cls, kw, _ = ARCHS[arch]
    with torch.device("meta"):
        model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw))
    return model.train()


def capture_arch(arch: str):
    """One export of ``arch`` (meta weights) with the test batch's shapes."""
    import models
    from autoshard.passes.capture import capture

    return capture(build_meta(arch), example_inputs=models.batch(arch))


def plan_cell(captured, mode: str):
    """The plan ``shard()`` makes (the whole pipeline: expert folding, padding,
    propagation and the meta trace that refuses an inconsistent plan)."""
    from autoshard.ir.signature import batch_of, seq_of
    from autoshard.passes.pipeline import plan_captured
    from autoshard.policies import make_policy

    _, world, depth = next(m for m in MODES if m[0] == mode)
    ex = captured.example_inputs
    return plan_captured(captured, make_policy(mode, world, depth, 1), batch_size=batch_of(ex),
                         seq_len=seq_of(ex) or 1)


def collect(archs=None) -> dict:
    """``{(arch, mode): Cell}`` for every cell, from plans only."""
    from autoshard.ir.errors import AutoshardError

    out = {}
    for arch in archs or ARCHS:
        try:
            cap = capture_arch(arch)
        except AutoshardError as e:
            for mode, _, _ in MODES:
                out[arch, mode] = refused(e)
            continue
        out.update(_cells_of(arch, cap))
    return out


def _cells_of(name: str, cap) -> dict:
    """``{(name, mode): Cell}``: ``cap`` planned in every mode (a refusal is a cell too)."""
    from autoshard.ir.errors import AutoshardError

    out = {}
    for mode, _, _ in MODES:
        try:
            out[name, mode] = classify(plan_cell(cap, mode))
        except AutoshardError as e:
            out[name, mode] = refused(e)
    return out


def collect_modality() -> dict:
    """``{(family, mode): Cell}`` of the models led by images or audio
    (tests/modality.py), planned as ``shard(model)`` plans them: captured from the
    model's own inputs (a batch of 4), no example inputs."""
    import modality
    from autoshard.passes.capture import capture

    out = {}
    for name in modality.FAMILIES:
        model = modality.build_meta(name)
        out.update(_cells_of(name, capture(model, example_inputs=modality.inputs(name, model, b=4))))
    return out


# decoders whose layers needed new rules to split (tests/models.py's configs), and what each brings
RECENT = {
    "olmo2": "q/k RMSNorm over the whole projection (a distributed norm in 1d)",
    "gemma3": "per-head q/k norms in float cast back (type_as), sliding and global layers",
    "gptoss": "attention sinks, experts with biases and an interleaved, clamped gate/up",
    "mamba": "selective scan (a Python loop over the sequence: a static sequence), W @ x projections",
    "jamba": "hybrid: scan layers, attention layers and experts",
    "falconh1": "hybrid: attention and a Mamba-2 mixer side by side in every layer (chunked scan, einsums, "
                "the batch read from the mask)",
    "bamba": "hybrid: Mamba-2 mixer layers (chunked scan, gated RMSNorm) with attention layers among them",
    "modernbert": "encoder; fused Wqkv viewed as (3, heads, head_dim) and unbound (split per block), local and "
                  "global attention layers",
}


def collect_recent() -> dict:
    """``{(model, mode): Cell}`` of :data:`RECENT`, captured from the model on meta with the
    test batch's shapes (4 × 8) and planned as the matrix plans its cells."""
    import torch
    import transformers

    import models
    from autoshard.passes.capture import capture

    out = {}
    for name in RECENT:
        cls, cfg_cls, kw = models.TINY[name]
        with torch.device("meta"):
            model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw)).train()
        out.update(_cells_of(name, capture(model, example_inputs=models.batch(name))))
    return out


# modules that are not transformers models (tests/plain_models.py), and what each brings
# (report name: (tests/plain_models.py name, class, patterns)); named apart from the
# transformers families (the report's details are keyed by name)
PLAIN = {
    "torch_tp_transformer": ("transformer", "Transformer", "PyTorch's tensor-parallel test model: no config, "
                             "forward(tokens), separate wq/wk/wv/wo, GELU MLP, tied output head, logits returned "
                             "as a tensor"),
    "timm_vit": ("vit", "ViT", "timm's VisionTransformer layout: no config, forward(x), fused qkv reshaped to "
                 "(3, heads, head_dim) and unbound, class-token pooling"),
}

# client libraries run on a sharded model (tests/test_clients.py), and what each calls
CLIENTS = (
    ("sentence-transformers 6.2", "`SentenceTransformer` with its BERT sharded: `encode()` at other batch sizes "
                                  "and lengths, a training step through the client (`return_dict=True` on every call)",
     "`encode()` within 1e-5; loss and every local gradient within 1e-5"),
    ("TRL 1.16", "`SFTTrainer` mixed with `ShardedTrainer` on a sharded Llama: `add_model_tags`, "
                 "`gradient_checkpointing_enable`, its fused LM head (`fused_lm_head=True`), its collator",
     "3 steps' losses and the weights after them within 1e-5 of the same steps on the dense model"),
)


def collect_plain() -> dict:
    """``{(module, mode): Cell}`` of :data:`PLAIN`, captured from a batch of 4 (× 8 tokens)
    passed positionally, as ``shard(module, example_inputs=(x,))`` captures it."""
    import plain_models
    from autoshard.hf_face import bind_call, forward_names
    from autoshard.passes.capture import capture

    out = {}
    for name, (built, _, _) in PLAIN.items():
        model = plain_models.BUILD[built]().train()
        x, _ = plain_models.inputs_of(built)
        out.update(_cells_of(name, capture(model, example_inputs=bind_call(forward_names(model), (x,), {}))))
    return out


def _cell_text(c: Cell) -> str:
    if c.status == "refused":
        return "**refused**"
    txt = "pass"
    if c.fallbacks:
        ops = Counter(op for _, op, _ in c.fallbacks)
        txt += f", {len(c.fallbacks)} fallback{'s' if len(c.fallbacks) > 1 else ''} (" + \
            ", ".join(f"{op} ×{k}" for op, k in sorted(ops.items())) + ")"
    if c.replicated:
        txt += f"; {len(c.replicated)} Linear{'s' if len(c.replicated) > 1 else ''} whole"
    return txt + f" · ×{c.vs_ideal:.2f}, {c.params_split:.0%} / {c.flops_split:.0%}"


def _table(title: str, blurb: str, cells: dict, modes: list, describe) -> list[str]:
    """The lines of a report table of ``cells``: a row per model, its class and patterns
    from ``describe(name) -> (class name, patterns)``, a column per mode."""
    lines = ["", f"## {title}", "", blurb, "",
             "| model | patterns | " + " | ".join(f"{m} ({MESH[m]})" for m in modes) + " |",
             "|---|---|" + "---|" * len(modes)]
    for name in dict.fromkeys(a for a, _ in cells):
        cls, patterns = describe(name)
        row = [f"`{name}` ({cls})", patterns]
        row += [_cell_text(cells[name, m]) if (name, m) in cells else "—" for m in modes]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def render(cells: dict, modality_cells: dict | None = None, recent_cells: dict | None = None,
           plain_cells: dict | None = None) -> str:
    """The markdown report (deterministic: a function of the cells only)."""
    archs = list(dict.fromkeys(a for a, _ in cells))
    modes = [m for m, _, _ in MODES]
    lines = [
        "# Architecture support",
        "",
        "Generated by `tests/arch_matrix.py` from the architecture matrix; "
        "`tests/test_arch_matrix.py` fails when this file is stale. Rewrite it with",
        "`.venv/bin/python tests/arch_matrix.py`.",
        "",
        "Tiny random configs of transformers 5.23 (hidden 64, 2 layers, 4 heads, vocab 128, dropout 0; "
        "configs in `tests/arch_models.py`), batch 4 × seq 8 with a left-padded row, fp32. "
        "Every cell is run on gloo ranks against the dense model: logits, loss and every local "
        "gradient within atol = rtol = 1e-5, parameter bytes and the collective ledger equal "
        "to the plan; a refused cell is checked to refuse on the ranks too. Cells marked † are "
        "`@pytest.mark.slow`, ‡ are outside `make test` (`make test-extended` runs them); the gpt2, "
        "llama and bert cells are cases of `tests/test_equivalence.py` (which adds AdamW steps in 2d, "
        "2.5d and 3d), the mixtral cells of `tests/test_moe.py` (AdamW steps, the router's loss and "
        "logits).",
        "",
        "- **pass**: every node has an exact rule; no re-layout to a whole tensor.",
        "- **fallbacks**: exact, but the named ops gather a split input (a rule would keep it split); "
        "`autoshard check` lists them, the plan table shows them in yellow.",
        "- **N Linears whole**: the weight is replicated because its split could not pass a later op "
        "(e.g. a single kv head); exact, not parallel.",
        "- **refused**: planning raises a ShardingError naming the node and reason (never a silent "
        "wrong answer).",
        "- **· ×r, a / b**: the parallel fraction (`ShardingPlan.parallel_fraction()`): r is the parameter "
        "bytes per rank over the mode's ideal (dense bytes / TP size; / q² in 2.5d, whose depth axis "
        "replicates the weights by design); a the share of parameter elements split over a tensor-parallel "
        f"axis; b the share of the Linears' FLOPs (2·rows·k·n each) run with a split weight. A cell with "
        f"r > {IDEAL_SLACK} lists in its details the parameters furthest above their ideal share.",
        "",
        "| architecture | patterns | " + " | ".join(f"{m} ({MESH[m]})" for m in modes) + " |",
        "|---|---|" + "---|" * len(modes),
    ]
    for a in archs:
        row = [f"`{a}` ({ARCHS[a][0]})", ARCHS[a][3]]
        for m in modes:
            c = cells.get((a, m))
            row.append("—" if c is None else _cell_text(c) + (" ‡" if is_extended(a, m) else " †" if is_slow(a, m)
                                                              else ""))
        lines.append("| " + " | ".join(row) + " |")
    if modality_cells:
        import modality

        lines += _table("Images, audio, image-text",
                        "Models led by `pixel_values` or `input_features` (configs in `tests/modality.py`), planned as "
                        "`shard(model)` plans them with no example inputs: the inputs come from the model's forward and "
                        "config (a batch of 4). `tests/test_modality.py` runs each of them in every mode (1d on 2 "
                        "ranks, 2d on 4, 2.5d and 3d on 8) on gloo ranks against the dense model, starting from "
                        "`shard(model)` (ViT 1d and 2d, CLIP 1d and 2d, LLaVA 1d in `make test`, the rest slow). "
                        "CLIP and LLaVA read their batch as a Python int, so their graphs have a static batch: every "
                        "mode keeps it whole on every rank (weights still split; the Linears' rows whole, so the "
                        "FLOPs share counts split weights, not split rows), and dp or cp is refused.",
                        modality_cells, modes, lambda n: (modality.FAMILIES[n][0], modality.PATTERNS[n]))
        cells = {**cells, **modality_cells}
    if recent_cells:
        import models

        lines += _table("Recent decoders and state-space models",
                        "Decoders whose layers needed rules of their own to split (configs in `tests/models.py`), "
                        "planned from a capture on meta with a batch of 4 × 8. Run against the dense model on gloo "
                        "ranks: OLMo-2 and Gemma-3 at 1d@2 and gpt-oss at 1d@2 and 2d@4 "
                        "(`tests/passes/test_propagate.py`), Mamba, Jamba, Falcon-H1 and Bamba at 1d@2 and 2d@4, "
                        "Falcon-H1 at 2.5d@8 too (`tests/test_modality.py`), ModernBERT at 1d@2 and 2d@4 "
                        "(`tests/test_fused_blocks.py`).",
                        recent_cells, modes, lambda n: (models.TINY[n][0], RECENT[n]))
        cells = {**cells, **recent_cells}
    if plain_cells:
        lines += _table("Modules that are not transformers models",
                        "Any `nn.Module` (`tests/plain_models.py`): no config, its inputs under its own names, "
                        "positional or by keyword, its outputs a tensor, tuple, dict or `ModelOutput`, the loss "
                        "computed by the caller. `tests/test_plain_modules.py` runs them on gloo ranks against the "
                        "dense module: outputs, the caller's loss, every local gradient and 3 optimizer steps "
                        "within 1e-5 (the Transformer and the ViT at 1d@2 in `make test`; 2d and 2.5d, and the "
                        "tuple, dict and `ModelOutput` returns, in `make test-extended`). timm itself is not "
                        "installed in the tests (its torchvision dependency replaces the pinned CPU torch); the ViT "
                        "is its layout.",
                        plain_cells, modes, lambda n: PLAIN[n][1:])
        cells = {**cells, **plain_cells}
        lines += ["", "## Client libraries", "",
                  "Run by `tests/test_clients.py` (`make test-extended`; skipped without `pip install "
                  "'autoshard[clients]'`), 1d@2 and 2d@4; usage in `docs/clients.md`.", "",
                  "| client | what it does with the sharded model | checked |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in CLIENTS]
    details = [(a, m, c) for (a, m), c in cells.items()
               if c.status != "pass" or c.replicated or c.vs_ideal > IDEAL_SLACK]
    if details:
        lines += ["", "## Details", ""]
        for a, m, c in details:
            lines.append(f"### {a}, {m}")
            lines.append("")
            if c.status == "refused":
                lines.append(f"- refused: {c.reason}")
            for name, op, note in c.fallbacks:
                lines.append(f"- fallback `{name}` ({op}): {note.removeprefix('fallback: ')}")
            if c.replicated:
                counts = Counter(c.replicated)
                lines.append("- whole Linears: " + ", ".join(f"`{p}`" + (f" ×{k}" if k > 1 else "")
                                                              for p, k in counts.items()))
            if c.status != "refused" and c.vs_ideal > IDEAL_SLACK:
                lines.append(f"- ×{c.vs_ideal:.2f} of the ideal; held back most by (whole, or split fewer ways): "
                             + ", ".join(f"`{p}`" for p in c.whole))
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def dump_plans(folder: str) -> int:
    """Every cell's plan JSON (``plan.to_json()``) in ``folder``: a refactor that must not
    change behaviour leaves ``diff -r`` of two dumps empty."""
    import json

    from autoshard.ir.errors import AutoshardError

    os.makedirs(folder, exist_ok=True)
    for arch in ARCHS:
        try:
            cap, err = capture_arch(arch), None
        except AutoshardError as e:
            cap, err = None, e
        for mode, _, _ in MODES:
            try:
                text = plan_cell(cap, mode).to_json() if cap is not None else None
            except AutoshardError as e:
                err = e
                text = None
            with open(os.path.join(folder, f"{arch}-{mode}.json"), "w") as f:
                f.write(text if text is not None else json.dumps({"refused": f"{type(err).__name__}: {err}"}))
    print(f"wrote {len(ARCHS) * len(MODES)} plans to {folder}")
    return 0


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Regenerate docs/support.md from the architecture matrix.")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if docs/support.md differs")
    ap.add_argument("--out", default=SUPPORT_MD)
    ap.add_argument("--dump", metavar="DIR", help="instead: write every cell's plan as DIR/ARCH-MODE.json (a refused "
                                                   "cell as its error), to compare the plans of two checkouts with diff -r")
    args = ap.parse_args(argv)
    if args.dump:
        return dump_plans(args.dump)
    text = render(collect(), collect_modality(), collect_recent(), collect_plain())
    if args.check:
        cur = open(args.out).read() if os.path.exists(args.out) else ""
        print("up to date" if cur == text else f"{args.out} is stale")
        return 0 if cur == text else 1
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
