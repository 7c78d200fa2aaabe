"""No host syncs in the runtime's kernels: an AST scan of ``autoshard/runtime``.

A read of a device tensor on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``)
or a tensor built on a device from a Python list (``torch.tensor([...], device=...)``, a
host-to-device copy) stops the host until the GPU has caught up: once per layer in
forward and backward, the step loses its overlap of launch and compute. Each call found
is refused unless it is on the allow-list below, with the reason it cannot stall a GPU
step (on a lent GPU, ``torch.cuda.set_sync_debug_mode("error")`` over a step checks the
same at run time: ``tests/gpu``).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
READS = {"item", "tolist", "cpu", "numpy"}

# (file, function, call): why it cannot stall a device step
ALLOWED = {
    ("kernels/dropout.py", "_dropout_mask", "item"): "reads a draw of the CPU generator (device='cpu'), on the CPU "
                                                  "branch only; CUDA draws through Philox offsets",
    ("kernels/attention.py", "_visible", "tolist"): "reads the mask only where it is on the CPU (a CPU tensor: no device)",
    ("groups.py", "check_same_rng", "numpy"): "once at shard(), of the host's RNG state (a CPU tensor)",
    ("groups.py", "check_same_rng", "tensor"): "once at shard(), before any step",
    ("collectives.py", "_order_index", "tensor"): "the balanced order's index, made once per device and cached",
    ("shm.py", "*", "*"): "the shared-memory transport carries CPU tensors only",
    ("experts.py", "ep_route", "tolist"): "dropless expert parallelism: all_to_all_single takes its uneven split "
                                          "sizes as host lists, so the exchanged counts are read once per MoE "
                                          "layer (a dropless dispatch cannot know them otherwise)",
}


def _python_list(node) -> bool:
    return isinstance(node, (ast.List, ast.ListComp, ast.Tuple)) or (
        isinstance(node, ast.Name))     # a name bound to a list: checked by the allow-list's eye


def sync_findings(source: str, where: str) -> list[tuple[str, str, str, int]]:
    """``(file, function, call, line)`` for each host read and each ``torch.tensor(..., device=)``."""
    out = []

    def visit(node, fn: str):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                attr = child.func.attr
                if attr in READS and not child.args:
                    out.append((where, fn, attr, child.lineno))
                elif attr == "tensor" and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch" \
                        and any(k.arg == "device" for k in child.keywords) and child.args \
                        and _python_list(child.args[0]):
                    out.append((where, fn, "tensor", child.lineno))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return out


def _runtime_files() -> dict[str, str]:
    """Every module of ``autoshard/runtime`` (its ``kernels/`` too), by its path there."""
    runtime = ROOT / "autoshard" / "runtime"
    return {p.relative_to(runtime).as_posix(): p.read_text() for p in sorted(runtime.rglob("*.py"))}


def _allowed(f: tuple) -> bool:
    where, fn, call, _ = f
    return any(k in ALLOWED for k in ((where, fn, call), (where, "*", "*"), (where, fn, "*")))


def test_no_kernel_of_the_runtime_reads_a_device_tensor_on_the_host():
    files = _runtime_files()
    assert len(files) > 8 and "kernels/linear.py" in files
    found = [f for p, src in files.items() for f in sync_findings(src, p) if not _allowed(f)]
    assert found == [], "\n".join(f"{w}:{line} {fn}(): .{c}()" for w, fn, c, line in found)


def test_the_scan_finds_each_kind():
    src = ("import torch\n"
           "def k(x, order):\n"
           "    a = x.item(); b = x.tolist(); c = x.cpu(); d = x.numpy()\n"
           "    i = torch.tensor(order, device=x.device)\n"
           "    j = torch.tensor([1, 2], device=x.device)\n"
           "    ok = x.to('cpu', non_blocking=True); fine = torch.tensor(3.0)\n")
    assert [(fn, c) for _, fn, c, _ in sync_findings(src, "f.py")] == [
        ("k", "item"), ("k", "tolist"), ("k", "cpu"), ("k", "numpy"), ("k", "tensor"), ("k", "tensor")]


def test_every_allowance_is_still_needed():
    """An allow-list entry whose call is gone is removed, so it cannot hide a new one."""
    found = [f for p, src in _runtime_files().items() for f in sync_findings(src, p)]
    stale = [k for k in ALLOWED if not any((f[0], f[1], f[2]) == k or (k[1] == "*" and f[0] == k[0])
                                           or (k[2] == "*" and (f[0], f[1]) == k[:2]) for f in found)]
    assert stale == [], stale
