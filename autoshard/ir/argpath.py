"""Argument paths: where a value sits among an fx node's arguments.

A path is ``(i,)`` for ``node.args[i]``, ``(i, j)`` for ``node.args[i][j]`` and
``("kw", name)`` for ``node.kwargs[name]``. Plans name inputs by path so they stay
plain data; every pass reads and writes arguments through these three functions.
They work on anything with ``args`` / ``kwargs`` (an fx node, or the namespace the
activation trace builds).

Example:
    >>> from types import SimpleNamespace
    >>> n = SimpleNamespace(args=("x", [2, 3]), kwargs={"dim": 1})
    >>> get_arg(n, (1, 0)), get_arg(n, ("kw", "dim"))
    (2, 1)
    >>> set_arg(n, (1, 1), 5); apply_patches(n, [((1,), {"at": [[0, 7]]})]); n.args
    ('x', [7, 5])
"""

from __future__ import annotations

import operator

__all__ = ["get_arg", "set_arg", "apply_patches"]


def get_arg(node, path):
    """The argument of ``node`` at ``path``."""
    if path[0] == "kw":
        return node.kwargs[path[1]]
    a = node.args[path[0]]
    return a if len(path) == 1 else a[path[1]]


def set_arg(node, path, value) -> None:
    """Replace the argument of ``node`` at ``path`` (an omitted optional positional
    argument, such as slice's end, is filled with ``None`` up to it)."""
    if path[0] == "kw":
        kw = dict(node.kwargs)
        kw[path[1]] = value
        node.kwargs = kw
        return
    args = list(node.args)
    if len(path) == 1:
        args += [None] * (path[0] + 1 - len(args))
        args[path[0]] = value
    else:
        inner = list(args[path[0]])
        inner[path[1]] = value
        args[path[0]] = inner
    node.args = tuple(args)


def apply_patches(node, patches) -> None:
    """Set a plan's literal patches (local sizes) in ``node``'s arguments. A patch
    value ``{"at": [[position, local size], ...]}`` edits single entries of a size list."""
    for path, value in patches:
        if isinstance(value, dict):
            cur = get_arg(node, path)
            scalar = not isinstance(cur, (list, tuple))     # one size given as a value (position 0)
            sizes = [cur] if scalar else list(cur)
            for j, v in value.get("at", ()):
                sizes[j] = v
            for key, op in (("div", operator.floordiv), ("mul", operator.mul)):
                # a symbolic size read from a tensor split otherwise than this dim: divided to its
                # local part ("div": read whole) or multiplied back ("mul": read from a split tensor)
                for j, n in value.get(key, ()):
                    if hasattr(sizes[j], "graph"):      # an fx node: the arithmetic in the graph
                        with node.graph.inserting_before(node):
                            sizes[j] = node.graph.call_function(op, (sizes[j], n))
                    else:
                        sizes[j] = op(sizes[j], n)
            value = sizes[0] if scalar else sizes
        set_arg(node, path, value)
