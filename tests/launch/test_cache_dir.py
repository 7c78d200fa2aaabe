"""The on-disk cache folder both caches share (autoshard/launch/cache_dir.py): keys that
follow autoshard's source, a folder others can write refused before any pickle is
loaded, private modes, a failed store said once, the size bound, and
``autoshard cache list / clear``."""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch

import models
from autoshard.ir.errors import AutoshardWarning, ConfigError
from autoshard.launch import cache_dir

LOADED: list = []


def _record(what):
    """What a hostile pickle would run: here it only leaves a mark."""
    LOADED.append(what)
    return what


class _Hostile:
    def __reduce__(self):
        return _record, ("the pickle ran",)


def _counting_exports(monkeypatch) -> list:
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_editing_a_capture_pass_invalidates_the_captures_it_made(tmp_path, monkeypatch):
    """The key hashes every .py of autoshard, passes and policies (recursively): an
    edit to passes/capture.py in the hashed copy changes both caches' keys, and the
    capture made before it is not used (export runs again; the old entry stays, unread)."""
    from autoshard.launch.capture_share import cache_key, capture_shared
    from autoshard.launch.launch_cache import launch_key

    copies = {}
    for name, src in cache_dir.source_roots().items():
        copies[name] = tmp_path / "src" / name
        shutil.copytree(src, copies[name], ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache_dir, "source_roots", lambda: dict(copies))
    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path / "cache"))
    calls = _counting_exports(monkeypatch)
    model, inputs = models.build("gpt2"), models.batch("gpt2")

    before = (cache_dir.source_hash(), cache_key(model, inputs), launch_key("cap", rank=0))
    capture_shared(model, example_inputs=inputs)
    capture_shared(model, example_inputs=inputs)
    assert len(calls) == 1                                  # the second one hit

    capture_py = copies["autoshard.passes"] / "capture.py"
    capture_py.write_text(capture_py.read_text() + "\n# an edit\n")
    after = (cache_dir.source_hash(), cache_key(model, inputs), launch_key("cap", rank=0))
    assert all(a != b for a, b in zip(before, after)), (before, after)
    capture_shared(model, example_inputs=inputs)
    assert len(calls) == 2                                  # the stale capture was not used
    assert {p.stem for p in (tmp_path / "cache").glob("*.pt2")} == {before[1], after[1]}

    nested = copies["autoshard"] / "ir" / "spec.py"         # a file two folders down counts too
    nested.write_text(nested.read_text() + "\n# another\n")
    assert cache_dir.source_hash() != after[0]


def test_a_folder_others_can_write_is_refused_and_its_pickle_never_loaded(tmp_path, monkeypatch):
    """A cache folder of mode 0o777 holding a (hostile) entry under the very key a
    capture looks up: a warning naming the folder, its mode and the fix, the capture
    exports instead, the pickle never runs and nothing is stored there; chmod 700 and
    the same entry is read (so the refusal is what kept it out)."""
    from autoshard.launch import launch_cache as lc
    from autoshard.launch.capture_share import cache_key, capture_shared

    cache = tmp_path / "team"
    cache.mkdir()
    monkeypatch.setenv("AUTOSHARD_CACHE", str(cache))
    model, inputs = models.build("gpt2"), models.batch("gpt2")
    key = cache_key(model, inputs)
    hostile = pickle.dumps(_Hostile())
    cache_dir.write_hashed(cache / f"{key}.pt2", hostile)
    (cache / "launch").mkdir(mode=0o700)
    cache_dir.write_hashed(cache / "launch" / "k.bin", hostile)
    os.chmod(cache, 0o777)
    calls = _counting_exports(monkeypatch)
    LOADED.clear()

    with pytest.warns(AutoshardWarning, match=r"(?s)writable by group or others \(mode 0o777.*chmod 700 " + str(cache)):
        cap = capture_shared(model, example_inputs=inputs)
    assert len(calls) == 1 and cap.module is not None
    assert lc.read("k") is None
    assert LOADED == []
    assert (cache / f"{key}.pt2").read_bytes().endswith(hostile)        # nothing stored over it
    assert sorted(p.name for p in cache.iterdir()) == [f"{key}.pt2", "launch"]
    with pytest.raises(ConfigError, match="AUTOSHARD_CACHE=off"):
        cache_dir.check_private(cache)

    os.chmod(cache, 0o700)
    assert cache_dir.load("capture", key) == hostile                    # now trusted: it would load


def test_the_default_folder_checks_autoshards_own_parent(tmp_path):
    """Under the default location (AUTOSHARD_CACHE unset) the ``autoshard`` folder autoshard
    made in the user's cache home is checked too."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    (tmp_path / "autoshard" / "captures").mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "autoshard", 0o700)
    cache_dir.check_folders(environ=env)
    os.chmod(tmp_path / "autoshard", 0o770)
    with pytest.raises(ConfigError, match=str(tmp_path / "autoshard")):
        cache_dir.check_folders(environ=env)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown to another user needs root")
def test_a_folder_owned_by_another_user_is_refused(tmp_path):
    os.chown(tmp_path, 65534, -1)
    with pytest.raises(ConfigError, match=r"owned by uid 65534.*not by this user"):
        cache_dir.check_private(tmp_path)


def test_folders_are_made_private_and_entries_written_0600(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path / "a" / "b"))
    assert cache_dir.store("launch", "k", b"payload")
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "launch"):
        assert _mode(p) == 0o700, p
    assert _mode(tmp_path / "a" / "b" / "launch" / "k.bin") == 0o600
    assert cache_dir.load("launch", "k") == b"payload"
    assert not list((tmp_path / "a" / "b" / "launch").glob(".*"))       # no temporary file left


def test_a_failed_store_is_said_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))

    def full(f, blob):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_dir, "write_hashed", full)
    with pytest.warns(AutoshardWarning, match=rf"could not store an entry in {tmp_path}.*No space left"):
        assert not cache_dir.store("capture", "k1", b"x")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache_dir.store("capture", "k2", b"x")               # once per folder and reason


def test_the_size_bound_evicts_the_least_recently_used(tmp_path, monkeypatch):
    """AUTOSHARD_CACHE_MAX_MB of 10 KiB holds three 3 KiB entries of either kind: a fourth
    evicts the least recently used (a read counts as a use)."""
    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    monkeypatch.setenv("AUTOSHARD_CACHE_MAX_MB", str(10 / 1024))
    blob = b"x" * 3000
    t0 = time.time() - 100
    for i, name in enumerate(("a", "b", "c")):
        cache_dir.store("capture", name, blob)
        os.utime(tmp_path / f"{name}.pt2", (t0 + i, t0 + i))
    assert cache_dir.load("capture", "a") == blob                       # a is now the newest
    cache_dir.store("launch", "d", blob)
    assert [(e.kind, e.key) for e in cache_dir.entries()] == [("capture", "c"), ("capture", "a"), ("launch", "d")]
    assert sum(e.size for e in cache_dir.entries()) <= cache_dir.max_bytes() == 10240
    for bad in ("abc", "0", "-5"):
        with pytest.raises(ConfigError, match="positive number of megabytes"):
            cache_dir.max_bytes({"AUTOSHARD_CACHE_MAX_MB": bad})
    assert cache_dir.max_bytes({}) == 2048 * 2**20
    monkeypatch.setenv("AUTOSHARD_CACHE_MAX_MB", "lots")                # a bad bound: stored, untrimmed, said
    with pytest.warns(AutoshardWarning, match="not trimmed.*AUTOSHARD_CACHE_MAX_MB='lots'"):
        assert cache_dir.store("capture", "e", blob)


def test_cli_cache_list_and_clear(tmp_path, monkeypatch, capsys):
    from autoshard.cli import main

    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    cache_dir.store("capture", "c" * 32, b"x" * 2000)
    cache_dir.store("launch", "l" * 32, b"y" * 1000)
    cache_dir.store("launch", "m" * 32, b"y" * 1000)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert f"folder: {tmp_path}" in out and "refused" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("capture", "launch"))]
    assert sorted((r[0], r[1]) for r in rows) == [("capture", "c" * 32), ("launch", "l" * 32), ("launch", "m" * 32)]
    assert all(r[3] == "MB" and r[-1] == "s" for r in rows)              # size and age columns
    assert "3 entries" in out and "of 2,048.00 MB" in out

    os.chmod(tmp_path, 0o777)
    assert main(["cache", "list"]) == 0
    assert "refused (never read)" in capsys.readouterr().out
    os.chmod(tmp_path, 0o700)

    assert main(["cache", "clear", "--kind", "launch"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert [e.kind for e in cache_dir.entries()] == ["capture"]
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and cache_dir.entries() == []
    monkeypatch.setenv("AUTOSHARD_CACHE", "off")
    assert main(["cache", "list"]) == 0 and "the cache is off" in capsys.readouterr().out

    with pytest.raises(SystemExit) as e:
        main(["cache", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for what in ("list", "clear", "AUTOSHARD_CACHE_MAX_MB", "chmod 700", "examples:"):
        assert what in text, what
    with pytest.raises(SystemExit) as e:
        main(["cache", "clear", "--kind", "plans"])
    assert e.value.code == 2 and "invalid choice: 'plans'" in capsys.readouterr().err


def test_cli_cache_list_imports_no_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import sys\nfrom autoshard.cli import main\nmain(['cache', 'list'])\n"
                        "assert 'torch' not in sys.modules, 'torch imported'\n"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, AUTOSHARD_CACHE=str(tmp_path)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "0 entries" in r.stdout
