"""Safetensors I/O: lazy slice reads with a bound on mapped pages, a stream
writer (header first, then tensors in order), and an atomic text write.

No process group and no model here: these are the bytes on disk.

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> w = StreamWriter(d / "x.safetensors", [("w", (2, 2), torch.float32)])
    >>> w.write("w", torch.eye(2)); size, sha = w.commit()
    >>> HFFolder(d).shape("w")
    (2, 2)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from ..ir.errors import CheckpointError, ConfigError, ShardingError
from ..ir.mesh import Mesh
from ..ir.spec import ShardSpec

__all__ = ["LazyFiles", "HFFolder", "StreamWriter", "read_local", "write_atomic", "fsync_dir", "itemsize",
           "DTYPE_CODES", "FLOAT_CODES"]

MAP_BUDGET = 32 << 20      # mapped file bytes a read may leave resident before the file is re-opened

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
FLOAT_CODES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def read_local(source, spec: ShardSpec, mesh: Mesh, rank: int, *, shape=None,
               dtype: torch.dtype | None = None, padded=None) -> torch.Tensor:
    """``rank``'s block of a global tensor read lazily from ``source``.

    ``source`` is anything indexable by a tuple of slices that returns a tensor: a
    safetensors ``get_slice`` object (pass ``shape``, or it calls ``get_shape()``) or a
    tensor. Each rectangular piece is read once; equals ``spec.local(full, mesh, rank)``.
    With ``padded`` (a larger global shape: a padded vocabulary) the tensor is read
    as if grown with zeros to that shape.

    >>> from autoshard.ir.mesh import Mesh
    >>> s, m = ShardSpec(dims=(("tp",),)), Mesh(axes=("tp",), sizes=(2,))
    >>> read_local(torch.arange(5.), s, m, 1, padded=(6,)).tolist()
    [3.0, 4.0, 0.0]
    """
    if spec.partial:
        raise ShardingError(f"cannot read a partial-sum spec {spec} from a file")
    shape = tuple(int(s) for s in (shape if shape is not None else
                                   (source.get_shape() if hasattr(source, "get_shape") else source.shape)))
    if padded is not None and tuple(padded) != shape:
        return _read_padded(source, spec, mesh, rank, shape, tuple(int(s) for s in padded), dtype)
    if not shape:       # a scalar
        t = source[()] if isinstance(source, torch.Tensor) else source[...]
        return t.to(dtype) if dtype is not None else t
    pieces = list(spec.pieces(shape, mesh, rank))
    if len(pieces) == 1:
        t = source[pieces[0][0]]
        t = t.to(dtype) if dtype is not None else t
        return t.clone(memory_format=torch.contiguous_format) if isinstance(source, torch.Tensor) else t.contiguous()
    out = None
    for gidx, lidx in pieces:
        t = source[gidx]
        if out is None:
            out = torch.empty(spec.local_shape(shape, mesh), dtype=dtype or t.dtype, device=t.device)
        out[lidx] = t
    return out


def _read_padded(source, spec, mesh, rank, shape, padded, dtype) -> torch.Tensor:
    """:func:`read_local` of a tensor of ``shape`` grown with zeros to ``padded``."""
    out = None
    for gidx, lidx in spec.pieces(padded, mesh, rank):
        g, lo_ = [], []
        for d, (gs, ls) in enumerate(zip(gidx, lidx)):
            hi = min(gs.stop, shape[d])
            g.append(slice(gs.start, max(hi, gs.start)))
            lo_.append(slice(ls.start, ls.start + max(hi - gs.start, 0)))
        t = source[tuple(g)] if all(x.stop > x.start for x in g) else None
        if out is None:
            ref_dtype = dtype or (t.dtype if t is not None else None)
            if ref_dtype is None:
                ref_dtype = source[tuple(slice(0, 1) for _ in shape)].dtype
            out = torch.zeros(spec.local_shape(padded, mesh), dtype=ref_dtype, device="cpu")   # read on the host
        if t is not None:
            out[tuple(lo_)] = t
    return out


class LazyFiles:
    """Open safetensors files on demand. safe_open maps the whole file; pages a read
    touches stay resident (and count in RSS) while the map lives, so a file is
    re-opened after ``MAP_BUDGET`` bytes of touched spans."""

    def __init__(self, budget: int = MAP_BUDGET):
        self.budget = budget
        self._open: dict[Path, list] = {}     # path -> [handle, touched bytes]

    def handle(self, path: Path, upcoming: int = 0):
        """The open file; re-opened first if ``upcoming`` more touched bytes would
        take its mapped pages over the budget."""
        from safetensors import safe_open

        ent = self._open.get(path)
        if ent is not None and ent[1] and ent[1] + upcoming > self.budget:
            del self._open[path]
            ent = None
        if ent is None:
            try:
                ent = self._open[path] = [safe_open(str(path), framework="pt"), 0]
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{path}: cannot open as safetensors: {e}") from e
        return ent[0]

    def touched(self, path: Path, nbytes: int) -> None:
        ent = self._open.get(path)
        if ent is not None:
            ent[1] += nbytes

    def close(self) -> None:
        self._open.clear()


def _span_bytes(spec: ShardSpec, shape, size: int, mesh: Mesh) -> int:
    """Upper bound of the file bytes a block read touches (whole tensor unless only dim 0 splits)."""
    n = size
    for s in shape:
        n *= s
    if all(not d for d in spec.dims[1:]):
        return n // max(1, mesh.size(spec.dims[0]) if spec.dims and spec.dims[0] else 1)
    return n


class HFFolder:
    """Tensor name -> file of a Hugging Face folder (``model.safetensors`` or a
    sharded ``model.safetensors.index.json``)."""

    def __init__(self, path: Path, prefix: str = ""):
        self.path = Path(path)
        self.prefix = prefix
        self.files = LazyFiles()
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        self.where: dict[str, Path] = {}
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{index}: unreadable index: {e}") from e
            self.where = {k: self.path / v for k, v in wm.items()}
        else:
            found = [single] if single.exists() else sorted(self.path.glob("*.safetensors"))
            if not found:
                raise CheckpointError(f"{self.path}: no model.safetensors, model.safetensors.index.json "
                                      f"or *.safetensors file")
            for f in found:
                for k in self.files.handle(f).keys():
                    self.where[k] = f
        self.bytes_read = 0

    def key_for(self, names) -> str | None:
        p = self.prefix + "." if self.prefix else None
        for n in names:
            cands = [n]
            if p:
                cands += [n[len(p):]] if n.startswith(p) else [p + n]
            for c in cands:
                if c in self.where:
                    return c
        return None

    def slice(self, key: str, upcoming: int = 0):
        f = self.where[key]
        try:
            return f, self.files.handle(f, upcoming).get_slice(key)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{f}: cannot read tensor {key!r}: {e}") from e

    def shape(self, key: str) -> tuple:
        return tuple(self.slice(key)[1].get_shape())

    def read(self, key: str, spec: ShardSpec, mesh: Mesh, rank: int, dtype=None, padded=None) -> torch.Tensor:
        _, sl = self.slice(key)
        shape = tuple(sl.get_shape())
        size = itemsize(sl.get_dtype())
        span = _span_bytes(spec, shape, size, mesh)
        del sl
        f, sl = self.slice(key, upcoming=span)
        try:
            if not shape:
                t = self.files.handle(f).get_tensor(key)
                t = t.to(dtype) if dtype is not None else t
            else:
                t = read_local(sl, spec, mesh, rank, shape=shape, dtype=dtype, padded=padded)
        except ShardingError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{f}: cannot read tensor {key!r}: {e}") from e
        del sl
        self.bytes_read += t.numel() * size
        self.files.touched(f, span)
        return t


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code (``"F32"`` -> 4)."""
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
            "U16": 2}.get(code, 1)


class StreamWriter:
    """Writes a safetensors file tensor by tensor: the header (shapes and dtypes
    known up front) first, then each tensor's bytes as it arrives. Hashes the file
    and each tensor on the way; ``<path>.tmp`` + fsync + rename on :meth:`commit`."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple, torch.dtype]], metadata: dict | None = None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        off = 0
        self.sizes = {}
        for name, shape, dtype in entries:
            if dtype not in DTYPE_CODES:
                raise ConfigError(f"cannot store dtype {dtype} of {name!r} in safetensors")
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype, device="meta").element_size()
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            self.sizes[name] = n
            off += n
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        self.data_start = 8 + len(hb)
        self.order = [e[0] for e in entries]
        self.expect = {e[0]: (tuple(e[1]), e[2]) for e in entries}
        self.offsets = {name: (self.data_start + h["data_offsets"][0], self.data_start + h["data_offsets"][1])
                        for name, h in header.items() if name != "__metadata__"}
        self.tensor_sha: dict[str, str] = {}
        self._next = 0
        self._sha = hashlib.sha256()
        self._f = open(self.tmp, "wb")
        self._raw(struct.pack("<Q", len(hb)) + hb)

    def _raw(self, b) -> None:
        self._f.write(b)
        self._sha.update(b)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.order) or self.order[self._next] != name:
            raise RuntimeError(f"stream writer: got {name!r}, expected "
                               f"{self.order[self._next] if self._next < len(self.order) else 'nothing'}")
        shape, dtype = self.expect[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(f"stream writer: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                               f"header says {shape} {dtype}")
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        mv = memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""
        self._raw(mv)
        self.tensor_sha[name] = hashlib.sha256(mv).hexdigest()
        self._next += 1

    def commit(self) -> tuple[int, str]:
        if self._next != len(self.order):
            self.abort()
            raise RuntimeError(f"stream writer: {len(self.order) - self._next} tensor(s) never written "
                               f"to {self.path}")
        self._f.flush()
        os.fsync(self._f.fileno())
        size = self._f.tell()
        self._f.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return size, self._sha.hexdigest()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._f.close()
        with contextlib.suppress(Exception):
            self.tmp.unlink()


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` all or nothing: ``<path>.tmp``, fsync, rename, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
