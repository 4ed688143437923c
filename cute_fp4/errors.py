"""Typed errors. Every message names the problem and the numbers involved."""

from __future__ import annotations


class CuteFp4Error(Exception):
    """Base class of every error this package raises on purpose."""


class FormatError(CuteFp4Error, ValueError):
    """A tensor does not hold a valid NVFP4 encoding (shape, dtype, scale layout)."""


class InputError(CuteFp4Error, ValueError):
    """A GEMM operand or output is unusable: shape, dtype, device, layout or alignment."""


class OffsetsError(InputError):
    """A grouped GEMM's ``offsets`` break the contract (``offsets[0] = 0``, non-decreasing,
    ``offsets[E] = total_M``); ``index`` and ``value`` name the first bad entry."""

    def __init__(self, message: str, index: int, value: int):
        super().__init__(message)
        self.index, self.value = index, value


class InputTypeError(CuteFp4Error, TypeError):
    """An argument has the wrong Python or torch type."""


class ScheduleError(CuteFp4Error, ValueError):
    """A schedule cannot be implemented on its target (carries the plan's reasons)."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()):
        super().__init__(message)
        self.reasons = reasons


class DeviceError(CuteFp4Error, RuntimeError):
    """The GPU needed for this operation is absent or of the wrong architecture."""


class CompileError(CuteFp4Error, RuntimeError):
    """The CuTe DSL failed to compile a schedule that plan() accepted (a bug: report it)."""


class ValidationError(CuteFp4Error, AssertionError):
    """A kernel's output disagrees with the exact reference beyond the error rule."""


class CuteFp4Warning(UserWarning):
    """A legal call that probably does not do what was meant (the message says why)."""
