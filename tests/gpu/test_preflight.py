"""``make test-gpu`` where torch sees no GPU (this machine): it fails, saying why,
instead of passing with every test skipped. Runs in ``make test``."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine: nothing to refuse")


def test_preflight_fails_saying_why_without_a_gpu(capsys):
    import preflight

    assert preflight.main() == 2
    err = capsys.readouterr().err
    assert err.startswith("make test-gpu: ") and ("CPU build" in err or "sees no CUDA GPU" in err), err


def test_the_gpu_suite_is_an_error_not_a_skip_without_a_gpu(monkeypatch):
    """``AUTOSHARD_GPU_TESTS=1`` (what make test-gpu sets) on a machine without GPUs: the
    suite's module raises at collection (pytest exits non-zero), naming the reason,
    instead of skipping every test (which passed)."""
    monkeypatch.setenv("AUTOSHARD_GPU_TESTS", "1")
    spec = importlib.util.spec_from_file_location("_gpu_suite_probe", ROOT / "tests" / "gpu" / "test_gpu.py")
    with pytest.raises(RuntimeError, match=r"^make test-gpu: "):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_make_test_gpu_runs_the_preflight_first():
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\ntest-gpu:", 1)[1].split("\n\n", 1)[0]
    lines = [ln.strip() for ln in recipe.splitlines()[1:]]
    assert lines[0] == "$(VPY) tests/gpu/preflight.py" and "pytest" in lines[1], lines
