"""The runnable examples in the docstrings of ``autoshard``, ``autoshard.passes`` and
``autoshard.policies``: every module is imported by its installed name (``passes/``
and ``policies/`` are ``autoshard.passes`` / ``autoshard.policies``, see pyproject's
package-dir mapping, so their relative imports resolve) and its doctests run as
``doctest.testmod`` would run them, with no option flags."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("autoshard", "autoshard.passes", "autoshard.policies")


def _modules() -> list[str]:
    out = []
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        out.append(name)
        out += [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{name}.")
                if m.name.split(".")[1] not in ("passes", "policies") or name != "autoshard"]
    return out


def _doctests(name: str) -> list[doctest.DocTest]:
    mod = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder().find(mod, name) if t.examples]


MODULES = _modules()
WITH_EXAMPLES = [name for name in MODULES if _doctests(name)]


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    tests = _doctests(name)
    runner = doctest.DocTestRunner(optionflags=0)
    out: list[str] = []
    for t in tests:
        runner.run(t, out=out.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(out)
    assert result.attempted > 0, "every example is marked +SKIP"


def test_the_examples_are_found():
    """The finder sees the examples where they are known to be (a finder that saw
    none would leave nothing above to run)."""
    found = set(WITH_EXAMPLES)
    assert {"autoshard.ir.spec", "autoshard.ir.mesh", "autoshard.api", "autoshard.passes.capture",
            "autoshard.policies.generic"} <= found, found
    assert len(found) >= 15, found
