"""The on-disk cache folder that the capture cache and the launch cache share.

Both caches keep pickles (:mod:`autoshard.launch.capture_share`: captured graphs;
:mod:`autoshard.launch.launch_cache`: each rank's rewritten graph and plan) in one
folder: ``AUTOSHARD_CACHE`` (``off`` / ``0`` / empty turns both off), by default
``~/.cache/autoshard/captures``; captures as ``KEY.pt2`` in it, launch entries as
``launch/KEY.bin``. This module owns what the two have in common:

* the folder (:func:`root`, :func:`folder`) and one key function (:func:`key`) that
  folds in a hash of autoshard's own source (:func:`source_hash`: every ``.py`` of
  ``autoshard``, ``autoshard.passes`` and ``autoshard.policies``), so an edited
  checkout never reuses a capture or a rewrite made by other code;
* entries behind their sha256, written atomically with mode 0o600 in folders made
  with mode 0o700 (:func:`write_hashed`, :func:`read_hashed`);
* the owner check (:func:`check_private`): loading a pickle runs code, so, as ssh
  refuses a key file others can write, a folder owned by someone else or writable
  by group or others is never read. Refusing does not stop the launch: the cache
  warns once (:func:`autoshard.ir.log.warn`) and the launch runs uncached;
* the size bound (``AUTOSHARD_CACHE_MAX_MB``, default 2048): after each store the
  least recently used entries (by mtime; a hit touches its entry) are evicted until
  the folder is under it;
* a failed store is a warning (once per folder and reason), not silence;
* listing and clearing (:func:`entries`, :func:`clear`; ``autoshard cache list`` /
  ``autoshard cache clear``).

Nothing here imports torch.

    >>> root({"AUTOSHARD_CACHE": "off"}) is None
    True
    >>> folder("launch", {"AUTOSHARD_CACHE": "/tmp/c"})
    PosixPath('/tmp/c/launch')
    >>> max_bytes({"AUTOSHARD_CACHE_MAX_MB": "1.5"})
    1572864
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ..ir import log
from ..ir.env import positive_number
from ..ir.errors import AutoshardWarning, ConfigError

__all__ = ["KINDS", "SOURCE_PACKAGES", "DEFAULT_MAX_MB", "CacheEntry", "root", "folder", "enabled", "max_bytes",
           "source_roots", "source_hash", "key", "check_private", "check_folders", "read_hashed", "write_hashed", "load", "store",
           "discard", "entries", "evict", "clear", "warn_once"]

# kind -> (subfolder of the root, file suffix)
KINDS = {"capture": ("", ".pt2"), "launch": ("launch", ".bin")}
SOURCE_PACKAGES = ("autoshard", "autoshard.passes", "autoshard.policies")
DEFAULT_MAX_MB = 2048
_OFF = ("", "0", "off", "false", "no")


# ------------------------------------------------------------------ where

def _default_home(env) -> Path:
    """``autoshard`` in the user's cache folder: made by autoshard, so checked with the root."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autoshard"


def root(environ=None) -> Path | None:
    """The cache folder: ``AUTOSHARD_CACHE``, or ``~/.cache/autoshard/captures`` when unset;
    None when set to ``off`` (``0``, ``false``, ``no``, empty)."""
    env = os.environ if environ is None else environ
    raw = env.get("AUTOSHARD_CACHE")
    if raw is None:
        return _default_home(env) / "captures"
    return None if raw.strip().lower() in _OFF else Path(raw)


def folder(kind: str, environ=None) -> Path | None:
    """The folder of ``kind``'s entries (one of :data:`KINDS`), or None where it is off:
    ``AUTOSHARD_CACHE=off`` turns off both, ``AUTOSHARD_LAUNCH_CACHE=off`` the launch
    cache alone (a run that patches autoshard's rules at run time, which no key sees)."""
    env = os.environ if environ is None else environ
    sub, _ = _layout(kind)
    base = root(env)
    launch_off = env.get("AUTOSHARD_LAUNCH_CACHE", "").strip().lower() in ("0", "off", "false", "no")
    if base is None or (kind == "launch" and launch_off):
        return None
    return base / sub if sub else base


def enabled(kind: str, environ=None) -> bool:
    """Whether ``kind``'s entries are read and written (see :func:`folder`)."""
    return folder(kind, environ) is not None


def _layout(kind: str) -> tuple[str, str]:
    if kind not in KINDS:
        raise ConfigError(f"unknown cache kind {kind!r}: choose from {', '.join(KINDS)}")
    return KINDS[kind]


def max_bytes(environ=None) -> int:
    """The size bound in bytes: ``AUTOSHARD_CACHE_MAX_MB`` (MiB, default :data:`DEFAULT_MAX_MB`).

    Raises:
        ConfigError: the variable is not a positive number.
    """
    mb = positive_number("AUTOSHARD_CACHE_MAX_MB", DEFAULT_MAX_MB,
                         what="is not a size: give a positive number of megabytes", environ=environ)
    return int(mb * 2**20)


# ------------------------------------------------------------------ the key

def source_roots() -> dict[str, Path]:
    """The folders of :data:`SOURCE_PACKAGES` (found without importing them: no torch)."""
    out = {}
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        out[name] = Path(next(iter(spec.submodule_search_locations)))
    return out


_HASHED: dict[tuple, str] = {}      # the files' (name, mtime, size) -> their hash: the last one only


def source_hash() -> str:
    """sha256 over every ``.py`` file under :func:`source_roots` (recursively; each
    named by its package and path relative to it, then its bytes). Re-read only when a
    file's mtime or size changed, so an edit made while a process runs is seen."""
    files = []
    for name, top in sorted(source_roots().items()):
        for f in sorted(top.rglob("*.py")):
            st = f.stat()
            files.append((f"{name}:{f.relative_to(top).as_posix()}", f, st.st_mtime_ns, st.st_size))
    sig = tuple((rel, m, s) for rel, _, m, s in files)
    if sig not in _HASHED:
        h = hashlib.sha256()
        for rel, f, _, _ in files:
            h.update(rel.encode() + b"\0")
            h.update(f.read_bytes())
        _HASHED.clear()
        _HASHED[sig] = h.hexdigest()
    return _HASHED[sig]


def key(*parts: str) -> str:
    """The key of an entry of either cache: ``parts`` (what the entry depends on) and
    :func:`source_hash`, hashed; 32 hex digits."""
    return hashlib.sha256("\n".join((source_hash(),) + parts).encode()).hexdigest()[:32]


# ------------------------------------------------------------------ who may write there

def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private(path: Path) -> None:
    """Refuse a cache folder that someone else could fill with pickles.

    Raises:
        ConfigError: ``path`` is not owned by this user, or is writable by group or
            others; the message names the folder, its mode and owner, and the fix.
    """
    if not hasattr(os, "getuid"):       # no POSIX owners (Windows): nothing to compare
        return
    st = path.stat()
    me = os.getuid()
    mode = stat.S_IMODE(st.st_mode)
    fix = "set AUTOSHARD_CACHE to a private folder of yours, or AUTOSHARD_CACHE=off"
    if st.st_uid != me:
        raise ConfigError(f"autoshard cache folder {path} is owned by {_who(st.st_uid)}, not by this user "
                          f"({_who(me)}; mode {mode:#o}): loading its pickles would run code someone else "
                          f"wrote. Fix: {fix}")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"autoshard cache folder {path} is writable by group or others (mode {mode:#o}, "
                          f"owner {_who(st.st_uid)}): anyone who can write there could run code in every job "
                          f"that loads it. Fix: `chmod 700 {path}`, or {fix}")


def _guarded(kind: str, env) -> list[Path]:
    """The folders an entry of ``kind`` trusts: autoshard's own folder under the user's
    cache home (when the root is the default), the root, and ``kind``'s subfolder."""
    base, sub = root(env), _layout(kind)[0]
    out = [_default_home(env)] if "AUTOSHARD_CACHE" not in env else []
    return out + [base] + ([base / sub] if sub else [])


def check_folders(kind: str | None = None, environ=None) -> None:
    """:func:`check_private` of every existing folder that ``kind``'s entries (default: both
    kinds') trust: autoshard's folder in the user's cache home (when ``AUTOSHARD_CACHE`` is
    unset), the root, and the kind's subfolder.

    Raises:
        ConfigError: one of them is another user's, or writable by group or others.
    """
    env = os.environ if environ is None else environ
    if root(env) is None:
        return
    for p in _guarded(kind or "launch", env):       # the launch kind's folders hold the capture kind's
        if p.exists():
            check_private(p)


def _make_private(path: Path) -> None:
    """``path`` and its missing parents created with mode 0o700."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:         # another rank made it first
            pass


_WARNED: set[tuple] = set()


def warn_once(what: tuple, message: str) -> None:
    """:func:`autoshard.ir.log.warn` of ``message`` (an :class:`AutoshardWarning`), the first
    time this process meets ``what`` (a folder and a reason): a cache problem is said once,
    not at every launch of a job."""
    if what not in _WARNED:
        _WARNED.add(what)
        log.warn(message, AutoshardWarning, stacklevel=3)


def _usable(kind: str, create: bool) -> Path | None:
    """``kind``'s folder where it may be used (made when ``create``); None where it is
    off, or refused (warned once: the launch runs without the cache)."""
    env = os.environ
    d = folder(kind, env)
    if d is None:
        return None
    try:
        check_folders(kind, env)        # before making anything in a refused folder
        if create:
            _make_private(d)
            check_folders(kind, env)
    except ConfigError as e:
        warn_once(("refused", str(d)), f"{e}. Running without the {kind} cache.")
        return None
    except OSError as e:
        warn_once(("unusable", str(d), type(e).__name__),
                   f"autoshard cache folder {d} cannot be used ({type(e).__name__}: {e}); running without "
                   f"the {kind} cache")
        return None
    return d


# ------------------------------------------------------------------ entries

def read_hashed(f: Path) -> bytes | None:
    """The bytes :func:`write_hashed` stored at ``f``, or None: absent, or torn or corrupt
    (the file is removed: rebuilt, never trusted)."""
    try:
        data = f.read_bytes()
    except OSError:
        return None
    digest, _, blob = data.partition(b"\n")
    if hashlib.sha256(blob).hexdigest().encode() != digest:
        f.unlink(missing_ok=True)
        return None
    return blob


def write_hashed(f: Path, blob: bytes) -> None:
    """Store ``blob`` at ``f`` behind its sha256, atomically (a temporary file of mode
    0o600 renamed over ``f``: readers see all or nothing).

    Raises:
        OSError: the file could not be written (the temporary file is removed).
    """
    tmp = f.parent / f".{f.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(hashlib.sha256(blob).hexdigest().encode() + b"\n" + blob)
        os.replace(tmp, f)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def load(kind: str, name: str) -> bytes | None:
    """The stored bytes of ``kind``'s entry ``name``, or None (absent, corrupt, the
    cache off or refused: :func:`check_private`). A hit touches the entry, so eviction
    takes the least recently used first."""
    d = _usable(kind, create=False)
    if d is None:
        return None
    f = d / f"{name}{_layout(kind)[1]}"
    blob = read_hashed(f)
    if blob is not None:
        try:
            os.utime(f)
        except OSError:
            pass
    return blob


def store(kind: str, name: str, blob: bytes) -> bool:
    """Store ``blob`` as ``kind``'s entry ``name`` (best effort: a failure is a warning,
    once per folder and reason), then evict down to :func:`max_bytes`. Whether it was stored."""
    d = _usable(kind, create=True)
    if d is None:
        return False
    try:
        write_hashed(d / f"{name}{_layout(kind)[1]}", blob)
    except OSError as e:
        warn_once(("store", str(d), type(e).__name__),
                   f"autoshard {kind} cache: could not store an entry in {d} ({type(e).__name__}: {e}); "
                   f"the launch runs on, the next one does this work again")
        return False
    try:
        evict(root(), max_bytes())
    except (ConfigError, OSError) as e:
        warn_once(("bound", str(e)), f"autoshard cache: not trimmed to its bound ({type(e).__name__}: {e})")
    return True


def discard(kind: str, name: str) -> None:
    """Remove ``kind``'s entry ``name`` (one that does not load: rebuilt, never retried)."""
    d = folder(kind)
    if d is not None:
        (d / f"{name}{_layout(kind)[1]}").unlink(missing_ok=True)


@dataclass(frozen=True)
class CacheEntry:
    """One file of the cache: its kind, key, path, size in bytes and mtime (last stored or used)."""

    kind: str
    key: str
    path: Path
    size: int
    mtime: float

    def age(self, now: float | None = None) -> float:
        """Seconds since it was last stored or used."""
        return (time.time() if now is None else now) - self.mtime


def entries(base: Path | None = None, kind: str | None = None) -> list[CacheEntry]:
    """The entries under ``base`` (default :func:`root`), oldest first; of ``kind`` alone if given."""
    base = root() if base is None else base
    out = []
    for k, (sub, suffix) in KINDS.items():
        if base is None or kind not in (None, k):
            continue
        try:
            with os.scandir(base / sub if sub else base) as it:
                for e in it:
                    if e.name.endswith(suffix) and not e.name.startswith(".") and e.is_file(follow_symlinks=False):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:       # evicted by another rank meanwhile
                            continue
                        out.append(CacheEntry(k, e.name[:-len(suffix)], Path(e.path), st.st_size, st.st_mtime))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return sorted(out, key=lambda e: (e.mtime, e.path))


def evict(base: Path | None, limit: int) -> list[CacheEntry]:
    """Remove the least recently used entries under ``base`` until they total at most
    ``limit`` bytes; the entries removed."""
    if base is None:
        return []
    found = entries(base)
    total = sum(e.size for e in found)
    gone = []
    for e in found:
        if total <= limit:
            break
        e.path.unlink(missing_ok=True)
        total -= e.size
        gone.append(e)
    return gone


def clear(kind: str | None = None, base: Path | None = None) -> list[CacheEntry]:
    """Remove every entry under ``base`` (default :func:`root`), or ``kind``'s alone; the entries removed."""
    if kind is not None:
        _layout(kind)
    found = entries(base, kind)
    for e in found:
        e.path.unlink(missing_ok=True)
    return found
