"""Lazily registered torch custom ops of the ``cute_fp4`` namespace (``cute_fp4::mm``,
``cute_fp4::quantize*`` in ``cute_fp4.api``, ``cute_fp4::grouped_mm`` in
``cute_fp4.grouped``): nothing is registered at import; the first call (eager, or while
Dynamo traces one) registers, once per process, thread-safe, and a reloaded module finds
the op defined already."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class LazyOp:
    """One op (``name``: the first of those ``define()`` registers) of ``torch.ops.cute_fp4``."""

    def __init__(self, name: str, define: Callable[[], None]):
        self.name = name
        self._define = define
        self.registered = False
        self._lock = threading.Lock()

    def exists(self) -> bool:
        """Whether ``torch.ops.cute_fp4.<name>`` is defined (by this process, any module)."""
        try:
            getattr(torch.ops.cute_fp4, self.name)
        except (AttributeError, RuntimeError):
            return False
        return True

    def ready(self) -> None:
        """Registered before an eager call (the first one registers: no lock after it)."""
        if not self.registered:
            self.register()

    def register(self):
        """Define the op(s) once (idempotent); returns the ``torch.ops.cute_fp4`` namespace."""
        with self._lock:
            if not self.registered:
                if not self.exists():
                    self._define()
                self.registered = True
        return torch.ops.cute_fp4


_LIBRARY: list = []  # the one torch.library.Library fragment (kept alive: dropping it
# would remove the registrations)


def define(schema: str, impl: Callable, fake: Callable) -> None:
    """Define ``cute_fp4::<schema>`` with ``impl`` for every backend and ``fake`` for
    tracing, through ``torch.library.Library``. The dispatcher calls ``impl`` directly: ~9 us
    of host time per call, where ``torch.library.custom_op``'s Python autograd and
    redispatch layers cost ~32 us (torch 2.13, CPU). The ops have no autograd formula
    (inference kernels): a backward through one warns, as torch does for such ops."""
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("cute_fp4", "FRAGMENT"))
    lib = _LIBRARY[0]
    name = schema.split("(", 1)[0]
    lib.define(schema)
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"cute_fp4::{name}", fake, lib=lib)


def traced(schedule) -> bool:
    """Whether torch.compile is tracing the call (which then becomes an op node, whose
    schema takes the schedule as a string: a catalogue name or "auto")."""
    if not torch.compiler.is_compiling():
        return False
    if not isinstance(schedule, str):
        from cute_fp4.errors import InputTypeError

        raise InputTypeError("under torch.compile, pass schedule as a catalogue name or "
                             "'auto'")
    return True


def while_tracing(fn: Callable, fallback: Callable) -> None:
    """Run ``fn(ctx)`` at trace time from inside a function Dynamo is tracing (defining a
    custom op cannot be traced), through ``torch._dynamo.comptime``: it adds nothing to the
    graph. ``fn`` must have no free variables (comptime refuses closures): a lambda calling
    a module-level ``register_op``. Without comptime (another torch) nothing happens, and
    the op must have been registered before tracing (any eager call, or
    ``cute_fp4.ops.register()``)."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:
        return
    comptime(fn, fallback)


__all__ = ["LazyOp", "define", "traced", "while_tracing"]
