"""Host side: compile schedules with the CuTe DSL, report on them, cache and launch them.

* :func:`compile_report` cross-compiles a schedule for any target (no GPU needed) and reads
  the cubin: registers, spills, dynamic shared memory, stages, tensor-core opcodes.
* :func:`compile` returns a :class:`CompiledGemm` callable on torch CUDA tensors, compiled
  once per (kernel class, schedule, operand signature) with symbolic M, N, K, so a new
  shape never recompiles. Compiled kernels are kept in memory for the process.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cute_fp4.errors import CompileError, InputError
from cute_fp4.families import family_of, resolve
from cute_fp4.formats import Operand
from cute_fp4.plan import Plan, plan
from cute_fp4.schedule import Mainloop, OutDtype, Problem, Schedule
from cute_fp4.targets import Target, get_target
from cute_fp4.tuning import resolution_deadline

if TYPE_CHECKING:
    from cute_fp4.operands import Operands


def kernel_class(schedule: Schedule) -> type:
    """The kernel class that implements ``schedule``: its kernel family's
    (``families.family_of``), dense or grouped."""
    fam = family_of(schedule)
    return resolve(fam.grouped_kernel if schedule.scheduler.grouped else fam.kernel)


def mma_opcode(schedule: Schedule) -> str:
    """The tensor-core SASS opcode prefix ``schedule``'s kernel must contain (its family's:
    ``OMMA.SF`` on SM12x, ``HGMMA`` on sm_90a, ``HMMA`` for the ``stream`` mainloop's
    warp-level 16-bit ``mma.sync``)."""
    return family_of(schedule).sass_mma(schedule)


def retarget(schedule: Schedule, target: str | Target | None) -> Schedule:
    """``schedule`` for another target of the same family (sm_120a <-> sm_121a), or of any
    family a ``stream`` schedule plans for (its kernel is one for all)."""
    if target is None:
        return schedule
    t = get_target(target)
    if t.family != schedule.arch.family and schedule.mainloop is not Mainloop.STREAM:
        raise InputError(f"schedule {schedule.name or schedule.label()} is for "
                         f"{schedule.target}; it cannot be compiled for {t.name}")
    return schedule if schedule.target == t.name else dataclasses.replace(schedule,
                                                                          target=t.name)


def _options(target: str, dump_dir: str | None) -> str:
    opts = f"--gpu-arch {target}"
    if dump_dir:
        opts += f" --keep-cubin --keep-ptx --dump-dir {dump_dir}"
    return opts


def default_problem(schedule: Schedule) -> Problem:
    """The problem a schedule compiles for when none is given: the operand formats of its
    catalogue file (``catalogue.formats_of``: ``PROBLEM``), else NVFP4 (``Problem()``)."""
    from cute_fp4.catalogue import formats_of

    return formats_of(schedule) or Problem()


def cross_compile(schedule: Schedule, problem: Problem | None = None,
                  dump_dir: str | None = None):
    """Compile for ``schedule.target`` (no GPU needed). Returns (compiled, kernel, seconds).

    With ``dump_dir`` (cubin and PTX written there) and a build cache
    (``CUTE_FP4_BUILD_CACHE``, see :func:`cross_build`), a kernel built before is not
    compiled again: its files are copied, ``compiled`` is None and the kernel object holds
    what tracing set (``smem_bytes``).
    Raises ScheduleError (with the plan's reasons) before the DSL sees an invalid schedule.
    Without ``problem``: the operand formats the schedule's catalogue file names, as
    ``plan()`` takes them (:func:`default_problem`).
    """
    problem = problem or default_problem(schedule)
    kernel = _make_kernel(schedule, problem)
    compiled, secs = cross_build(kernel, lambda opts: _dsl_compile(kernel, schedule, opts),
                                 schedule.target, dump_dir, schedule.key(), repr(problem))
    return compiled, kernel, secs


def cross_build(kernel, compile_fn, target: str, dump_dir: str | Path | None, *key: str,
                tag: str = ""):
    """``compile_fn(options)`` of ``kernel`` for ``target``, writing cubin and PTX to
    ``dump_dir`` when one is given. Returns (what ``compile_fn`` returned, seconds).

    With ``dump_dir`` and the build cache on (:func:`cute_fp4.cache.build_cache`; the tests
    and CI turn it on), the products are looked up by the kernel's class (+ ``tag``),
    ``key`` (its schedule or spec and problem: what decides the code, as for the runtime
    cache), the options and the fingerprint of the kernel's module and what it imports
    (``cache.kernel_fingerprint``). A hit copies them to
    ``dump_dir``, sets the attributes tracing set on the kernel (numbers and strings, e.g.
    ``smem_bytes``) from the entry, and returns None for the compiled object: nothing is
    compiled twice."""
    from cute_fp4 import cache

    t0 = time.perf_counter()
    bc = cache.build_cache(type(kernel).__module__) if dump_dir is not None else None
    if bc is None:
        compiled = compile_fn(_options(target, str(dump_dir) if dump_dir else None))
        return compiled, time.perf_counter() - t0

    def build(d: Path):
        before = _traced_facts(kernel)
        compiled = compile_fn(_options(target, str(d)))
        return compiled, {k: v for k, v in _traced_facts(kernel).items()
                          if k not in before or before[k] != v}

    name = type(kernel).__name__ + tag
    compiled, facts, _ = bc.fetch(
        cache.entry_key("cross", name, *key, _options(target, None), bc.fingerprint),
        dump_dir, build)
    for k, v in facts.items():
        setattr(kernel, k, v)
    return compiled, time.perf_counter() - t0


def _traced_facts(kernel) -> dict:
    """The kernel object's plain attributes (numbers, strings, None): what tracing sets
    and a cached build must restore."""
    return {k: v for k, v in getattr(kernel, "__dict__", {}).items()
            if v is None or isinstance(v, (bool, int, float, str))}


def _make_kernel(schedule: Schedule, problem: Problem):
    """The kernel object for an accepted (schedule, problem); ScheduleError otherwise."""
    plan(schedule, problem).raise_if_invalid()
    return kernel_class(schedule)(schedule, problem)


def _dsl_compile(kernel, schedule: Schedule, options: str | None = None):
    """``cute.compile`` against the kernel's fake arguments, failures as CompileError."""
    import cutlass.cute as cute

    kwargs = {"options": options} if options else {}
    try:
        return cute.compile(kernel, *kernel.fake_args(), **kwargs)
    except Exception as e:  # the DSL raises many types; keep the message
        raise CompileError(f"CuTe DSL failed on {schedule.label()}: {e}") from e


def compile_report(schedule: Schedule | str, target: str | None = None,
                   problem: Problem | tuple | None = None, dump_dir: str | Path | None = None
                   ) -> dict:
    """Compile-only report for a schedule or catalogue name (JSON-ready); ``problem`` may be
    an ``(m, n, k)`` tuple. A schedule that cannot be implemented gives ``ok: False`` and a
    ``reason`` with the byte counts.

    Besides registers, spills, shared memory and the tensor-core opcodes, ``kloop`` holds
    the measures of the mainloop read from the SASS (``cute_fp4.inspect.find_kloop``:
    instructions, MMAs, LDSMs, non-MMA instructions per MMA, MMAs overlapping the stage
    wait, ldmatrix registers never read), or None when no loop holds an MMA.
    ``dump_dir``: keep ``<name>.<target>.cubin``, ``.ptx`` and ``.sass`` there."""
    from cute_fp4.catalogue import resolve
    from cute_fp4.inspect import cubin_sass, inspect_cubin

    schedule, problem = resolve(schedule, problem)

    s = retarget(schedule, target)
    pl: Plan = plan(s, problem)
    problem = pl.problem
    row = {"name": s.name, "target": s.target, "tile": list(s.tile), "roles":
           s.warps.roles.value, "stages": pl.stages, "smem_bytes": pl.smem_bytes,
           "smem_limit": pl.smem_limit, "ok": pl.ok}
    if not pl.ok:
        row.update(reason="; ".join(pl.reasons), refused_by_plan=True)
        return row
    with tempfile.TemporaryDirectory(prefix="cute_fp4_") as d:
        try:
            _, kernel, secs = cross_compile(s, problem, dump_dir=d)
        except CompileError as e:
            row.update(ok=False, reason=str(e))
            return row
        cubins = sorted(Path(d).glob("*.cubin"))
        if not cubins:
            row.update(ok=False, reason=f"the DSL wrote no cubin to {d}")
            return row
        sass = cubin_sass(cubins[-1])
        rep = inspect_cubin(cubins[-1], (mma_opcode(s),), sass)
        if dump_dir is not None:
            row["dumped"] = _dump(Path(d), cubins[-1], sass, Path(dump_dir),
                                  f"{_file_stem(s)}.{s.target}")
    row.update(registers=rep.registers, spills=rep.spills,
               kernel_smem_bytes=kernel.smem_bytes, mma_instructions=list(rep.mma_instructions),
               mma_count=rep.mma_count, compile_s=round(secs, 2),
               kloop=rep.kloop.as_dict() if rep.kloop is not None else None)
    if kernel.smem_bytes != pl.smem_bytes:
        row.update(ok=False, reason=f"kernel allocates {kernel.smem_bytes:,} B of shared memory "
                   f"but plan() accounts {pl.smem_bytes:,} B")
    return row


def _file_stem(s: Schedule) -> str:
    """A file-name-safe name for a schedule (its catalogue name, else its label)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in (s.name or s.label()))


def _dump(build_dir: Path, cubin: Path, sass: str, dump_dir: Path, stem: str) -> list[str]:
    """Copy the cubin and PTX the DSL wrote to ``build_dir`` into ``dump_dir`` as
    ``<stem>.cubin``/``.ptx`` and write the SASS as ``<stem>.sass``; returns the paths."""
    import shutil

    dump_dir.mkdir(parents=True, exist_ok=True)
    out = [dump_dir / f"{stem}.cubin", dump_dir / f"{stem}.sass"]
    shutil.copyfile(cubin, out[0])
    out[1].write_text(sass)
    ptx = sorted(build_dir.glob("*.ptx"))
    if ptx:
        out.append(dump_dir / f"{stem}.ptx")
        shutil.copyfile(ptx[-1], out[-1])
    return [str(p) for p in out]


# ----------------------------------------------------------------------------- runtime

@dataclasses.dataclass(frozen=True, repr=False)
class Signature:
    """What a compiled kernel is specialised on besides the schedule (not M, N, K): the
    activation's format (a block format, W4A4, or ``"bf16"``/``"fp16"``, W4A16) and the
    weight's block format (:class:`~cute_fp4.formats.Operand`; strings accepted)."""

    a_format: Operand = Operand.NVFP4
    b_format: Operand = Operand.NVFP4

    def __post_init__(self) -> None:
        object.__setattr__(self, "a_format", Operand.of(self.a_format, "Signature.a_format"))
        object.__setattr__(self, "b_format", Operand.of(self.b_format, "Signature.b_format"))

    def __repr__(self) -> str:
        # the weight format only where it is not the default: the disk cache keys builds by
        # this repr, and the entries of NVFP4 kernels stay valid
        extra = "" if self.b_format is Operand.NVFP4 else f", b_format={self.b_format!r}"
        return f"Signature(a_format={self.a_format!r}{extra})"

    @property
    def problem(self) -> Problem:
        """The symbolic problem of this signature (M, N, K any)."""
        return Problem(a_format=self.a_format, b_format=self.b_format)


TVM_FFI_ENV = "CUTE_FP4_TVM_FFI"  # "0": compile without the TVM-FFI entry


def tvm_ffi_enabled() -> bool:
    """Whether kernels are compiled with the DSL's TVM-FFI entry (``--enable-tvm-ffi``):
    ``apache-tvm-ffi`` is importable and ``CUTE_FP4_TVM_FFI`` is not "0". That entry takes
    plain ints, so a launch costs well under a microsecond of Python instead of the tens
    the DSL's own argument packing takes; without the package everything works the same,
    only the host side of each call is slower."""
    import importlib.util

    if os.environ.get(TVM_FFI_ENV, "1") == "0":
        return False
    try:
        return importlib.util.find_spec("tvm_ffi") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


def ffi_function(compiled):
    """The ``tvm_ffi.Function`` a kernel compiled with ``--enable-tvm-ffi`` is called
    through (the DSL's object when built, the function itself when loaded from the disk
    cache), or None for a kernel compiled without it."""
    try:
        import tvm_ffi
    except ImportError:
        return None
    inner = getattr(compiled, "__tvm_ffi_object__", None)
    if inner is not None:
        compiled = inner()
    return compiled if isinstance(compiled, tvm_ffi.Function) else None


def stream_getter():
    """``device index -> raw handle of torch's current stream there``. torch's own raw
    getter (what Inductor uses) skips building a ``torch.cuda.Stream`` object per call."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class CompiledGemm:
    """A compiled kernel for one schedule and operand signature.

    Launched by the launch path (``cute_fp4.run``: ``run_compiled(kernel, a, b)`` checks the
    operands, allocates and launches; ``run_grouped`` for a grouped kernel). ``call_path``
    is "tvm-ffi" (the kernel's TVM-FFI entry, called with ints) or "dsl" (the DSL's call
    path with its pointer objects, when apache-tvm-ffi is absent or disabled).
    """

    def __init__(self, schedule: Schedule, signature: Signature, compiled, kernel,
                 compile_s: float, source: str = "built", rebuild=None,
                 max_ctas: int | None = None):
        from cute_fp4.operands import out_dtype_of

        self.schedule = schedule
        self._rebuild = rebuild  # compiles afresh (used if a cached kernel fails to launch)
        self.source = source  # "built", "loaded" (disk cache) or "built-uncached"
        self.signature = signature
        self._kernel = kernel
        self.compile_s = compile_s
        self.validated = False
        self.out_dtype = out_dtype_of(schedule)
        self.max_ctas = max_ctas  # None: the device's SM count (see kernels/launch.py)
        self._planned: set[tuple] = set()  # (M, N, K, a_format[, E]) plan() accepted
        self._stream_of = stream_getter()
        self._made: dict[tuple[int, int], object] = {}  # (slot, value) -> DSL object
        self._ctas: dict[int, int] = {}  # SM count per device index
        self._set_compiled(compiled)

    def _set_compiled(self, compiled) -> None:
        self._compiled = compiled
        self._ffi = ffi_function(compiled)
        self.call_path = "dsl" if self._ffi is None else "tvm-ffi"

    def check_plan(self, dims: tuple) -> None:
        """``plan(schedule, problem).raise_if_invalid()`` once per (M, N, K, a_format) (a
        grouped call's: (M, N, K, a_format, E)), the weight's format this kernel's
        (``signature.b_format``): plan() is pure but costs ~150 us of Python. A refusal is
        not remembered, so it is raised with its reasons on every call."""
        if dims not in self._planned:
            plan(self.schedule, Problem(*dims, b_format=self.signature.b_format)
                 ).raise_if_invalid()
            if len(self._planned) >= 4096:
                self._planned.clear()
            self._planned.add(dims)

    def launch(self, ops: Operands) -> None:
        """Launch on a call's checked operands (the launch path's job: ``cute_fp4.run``),
        on torch's current stream of the output's device (so CUDA-graph capture records
        it)."""
        args = self.raw_args(ops)
        ffi = self._ffi
        if ffi is None:
            args = self._dsl_args(args)
        try:
            ffi(*args) if ffi is not None else self._compiled(*args)
        except Exception as e:
            if self.source != "loaded" or self._rebuild is None:
                raise
            self._recompile(e)
            self.launch(ops)

    def raw_args(self, ops: Operands) -> tuple:
        """The launch's arguments as ints (``kernels.launch.raw_args``: addresses, sizes,
        the SM count, the raw handle of torch's current stream on the output's device)."""
        out = ops.out
        dev = (out.data if hasattr(out, "global_scale") else out).get_device()  # nvfp4_out
        ctas = self.max_ctas or self._ctas.get(dev) or self._sm_count(dev)
        return self._kernel.raw_args(ops, ctas, self._stream_of(dev))

    def bound_args(self, raw: tuple[int, ...]):
        """``raw`` (:meth:`raw_args`) with the per-call arguments left open
        (``kernels.launch.BoundArgs``)."""
        return self._kernel.bound_args(raw)

    @property
    def ffi(self):
        """The TVM-FFI entry (called with :meth:`raw_args`' ints), or None."""
        return self._ffi

    @property
    def unfused_schedule(self) -> Schedule:
        """This kernel's schedule without its fused epilogue ops and with FP32 output: the
        GEMM of the unfused pipeline ``check=True`` compares a fused call with."""
        return self.schedule.replace(ops=(), out_dtype=OutDtype.FP32)

    @property
    def silu_group(self) -> int:
        """Gate/up rows per group of a ``silu_mul`` weight for this kernel
        (``planning.common.silu_group``)."""
        from cute_fp4.planning.common import silu_group

        return silu_group(self.schedule)

    @property
    def split_slots(self) -> int:
        """Split-K arrival counters per output tile of this kernel (kernels/launch.py)."""
        return self._kernel.split_slots

    @property
    def split_values(self) -> int:
        """Split-K partial values per counter slot (accumulator values per thread)."""
        return self._kernel.split_values

    def stream_handle(self, dev: int) -> int:
        """The raw handle of torch's current stream on device ``dev`` (what launches use)."""
        return self._stream_of(dev)

    def _sm_count(self, dev: int) -> int:
        from cute_fp4.kernels.launch import sm_count

        n = self._ctas[dev] = sm_count(dev)
        return n

    def _dsl_args(self, raw: tuple[int, ...]) -> tuple:
        """The DSL call path's arguments for ``raw`` (:func:`kernels.launch.raw_args`): its
        pointer objects, Int32s and a CUstream, each made once per value and kept (making
        the pointers alone took ~15 us per call)."""
        made = self._made
        if len(made) >= 4096:  # many distinct addresses: don't grow forever
            made.clear()
        args = []
        last = len(raw) - 1  # the stream; pointers first, Int32 sizes between
        for i, v in enumerate(raw):
            obj = made.get((i, v))
            if obj is None:
                obj = made[(i, v)] = self._dsl_object(i, v, last)
            args.append(obj)
        return tuple(args)

    def _dsl_object(self, slot: int, value: int, last: int):
        import cutlass

        slots = self._kernel.pointer_slots()
        if slot < len(slots):
            from cutlass.cute.runtime import make_ptr

            dtype, align = slots[slot]
            return make_ptr(dtype, value, cutlass.AddressSpace.gmem, assumed_align=align)
        if slot < last:
            return cutlass.Int32(value)
        from cuda.bindings import driver

        return driver.CUstream(value)

    def _recompile(self, error: Exception) -> None:
        """A disk-cache entry that loaded but cannot run here: compile it afresh (once)."""
        import warnings

        from cute_fp4.cache import CacheWarning

        warnings.warn(f"cute_fp4 cache: a cached kernel failed to launch "
                      f"({type(error).__name__}: {error}); recompiling", CacheWarning,
                      stacklevel=3)
        self._set_compiled(self._rebuild())
        self.source = "built"

    def __repr__(self) -> str:
        return (f"CompiledGemm({self.schedule.name or self.schedule.label()}, "
                f"{self.signature.a_format}, {self.source} in {self.compile_s:.2f} s, "
                f"{self.call_path})")


_CACHE: dict[tuple, CompiledGemm] = {}
_LOCK = threading.Lock()


def compile(schedule: Schedule, signature: Signature | None = None) -> CompiledGemm:  # noqa: A001
    """Compile ``schedule`` for the present GPU, through the memory and disk caches.

    Compiled once per (kernel class, schedule, signature) with symbolic M, N, K: any shape
    of that signature reuses it. ``CompiledGemm.source`` says whether it was loaded from
    disk or built."""
    from cute_fp4.targets import emulated_target, require_device

    sig = signature or Signature()
    if emulated_target() is not None and schedule.arch.family == "sm120":
        # cute_fp4.emulation.emulate(): block-scaled kernels with the MMA emulated, the
        # stream kernel (one for both families) as the present GPU's
        if schedule.mainloop is not Mainloop.STREAM:
            return compile_emulated(schedule, sig)
        dev = require_device()
    else:
        dev = require_device(schedule.arch.family)
    s = retarget(schedule, dev.target.name)
    key = (kernel_class(s).__name__, s, sig, tvm_ffi_enabled())
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = _build(s, sig)
    return hit


# (schedule argument, what its resolution depends on, device) -> (argument, kernel, deadline)
_RESOLVED: dict[tuple, tuple] = {}


def kernel_for(schedule, key: tuple, signature: Signature, device_index: int,
               resolve: Callable[[], Schedule]) -> CompiledGemm:
    """The kernel a call runs for its ``schedule`` argument (a Schedule, a catalogue name or
    "auto"), memoised per (argument, ``key``, device): resolving "auto" (tuning store,
    heuristic, ``Schedule.replace``) and finding the compiled kernel cost ~100 us of Python
    per call, more than a decode kernel. ``key``: everything the resolution depends on
    besides the argument (a dense call's M, N, K, A format, output dtype, fused ops and
    weight layout; a grouped call's regime); ``resolve()``: the Schedule, made on a miss
    (``tuning.resolve_schedule`` and its kin: this layer does not choose). The kernel is
    compiled for ``signature`` (A's and B's formats; ``key`` must hold them too).

    A Schedule argument is memoised by identity (the memo holds it, so the id stays its
    own); "auto" is resolved again every ``tuning.AUTO_RECHECK_S`` seconds, so a tuning
    stored meanwhile is picked up; :func:`clear_cache` forgets everything."""
    memo = (schedule if isinstance(schedule, str) else id(schedule), key, device_index)
    hit = _RESOLVED.get(memo)
    if hit is not None and hit[0] is schedule and time.monotonic() < hit[2]:
        return hit[1]
    kern = compile(resolve(), signature)
    if len(_RESOLVED) >= 4096:
        _RESOLVED.clear()
    _RESOLVED[memo] = (schedule, kern, resolution_deadline(schedule))
    return kern


def _build(schedule: Schedule, sig: Signature, kernel=None, tag: str = "") -> CompiledGemm:
    """Compile (or load from the disk cache) with the TVM-FFI entry when
    :func:`tvm_ffi_enabled`; if that build fails where a plain one works (an
    apache-tvm-ffi this DSL cannot use), warn once and keep the plain one."""
    kernel = kernel or _make_kernel(schedule, sig.problem)
    if not tvm_ffi_enabled():
        return _build_with(schedule, sig, kernel, tag, ffi=False)
    try:
        return _build_with(schedule, sig, kernel, tag, ffi=True)
    except CompileError as e:
        plain = _build_with(schedule, sig, kernel, tag, ffi=False)
        _warn_once(f"the TVM-FFI build failed ({e}); launching through the DSL's own call "
                   f"path (slower host side; set {TVM_FFI_ENV}=0 to skip the attempt)")
        return plain


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    import warnings

    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"cute_fp4: {message}", RuntimeWarning, stacklevel=3)


def _build_with(schedule: Schedule, sig: Signature, kernel, tag: str,
                ffi: bool) -> CompiledGemm:
    fn, secs, how, build = cached_build(
        lambda opts: _dsl_compile(kernel, schedule, opts), ffi,
        type(kernel).__name__ + tag, schedule.key(), repr(sig), schedule.target)
    return CompiledGemm(schedule, sig, fn, kernel, secs, how, build)


def cached_build(compile_fn: Callable[[str | None], object], ffi: bool, name: str,
                 *key: str):
    """``compile_fn(options)`` through the disk cache (``cute_fp4.cache``): loaded when an
    entry of (``name``, ``key``, the package's source fingerprint) exists, else built and
    stored; with the TVM-FFI entry when ``ffi``. Returns (the DSL function, seconds, how:
    "loaded", "built" or "built-uncached", the build itself for a later rebuild). The
    GEMMs (:func:`compile`) and the activation kernels (``cute_fp4.quant``) build so."""
    from cute_fp4 import cache

    entry = cache.entry_key(name + ("+tvmffi" if ffi else ""), *key,
                            cache.source_fingerprint())

    def build():
        return compile_fn("--enable-tvm-ffi" if ffi else None)

    t0 = time.perf_counter()
    if cache.enabled():
        export, load = _exporter(f"cute_fp4_{entry}", ffi)
        fn, how = cache.DiskCache().get_or_build(entry, build, export, load)
    else:
        fn, how = build(), "built-uncached"
    return fn, time.perf_counter() - t0, how, build


def _exporter(prefix: str, ffi: bool):
    """(export, load) of a compiled kernel for the disk cache: an object file holding the
    host entry (``prefix``) and the cubin; the TVM-FFI entry is saved and loaded as such."""
    import cutlass.cute as cute

    from cute_fp4.cache import OBJECT

    if ffi:
        def export(compiled, directory: Path) -> None:
            compiled.export_to_c(str(directory / OBJECT), prefix)

        def load(path: Path):
            return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), prefix)
    else:
        def export(compiled, directory: Path) -> None:
            compiled.export_to_c(str(directory), Path(OBJECT).stem, function_prefix=prefix)

        def load(path: Path):
            return getattr(cute.runtime.load_module(str(path)), prefix)
    return export, load


_ON_CLEAR: list = []  # what the layers above keep of these kernels (on_clear)


def on_clear(forget) -> None:
    """Have :func:`clear_cache` call ``forget()`` too: a module above this one that keeps
    what the kernels made (the launch path's bindings) registers it, so this module never
    imports it."""
    if forget not in _ON_CLEAR:
        _ON_CLEAR.append(forget)


def clear_cache() -> None:
    """Forget every compiled kernel and memoised schedule resolution of this process, and
    what was kept of them above (the launch path's bindings: :func:`on_clear`), so the next
    calls build or load their kernels again."""
    with _LOCK:
        _CACHE.clear()
        _RESOLVED.clear()
    for forget in _ON_CLEAR:
        forget()


# ----------------------------------------------------------------------------- emulated SM120

EMULATION_TARGET = "sm_90a"
EMULATION_NOTE = ("emulated: the SM120 kernel on SM90 with its block-scaled MMA (OMMA.SF) "
                  "replaced by 4 exact BF16 mma.sync each; a data-path check (TMA, barriers, "
                  "ldmatrix, scales, scheduler, epilogue), not of the OMMA, the sm_120a "
                  "binary or the 99 KiB limit")


def emulated_kernel(schedule: Schedule, problem: Problem | None = None):
    """The SM120 kernel of ``schedule`` built with its MMA emulated
    (``cute_fp4/kernels/mma_emulation.py``: what such a run checks and what not), for an SM90
    GPU. ScheduleError (with the plan's reasons) when ``plan()`` refuses the schedule."""
    problem = problem or Problem()
    if schedule.arch.family != "sm120":
        raise InputError(f"schedule {schedule.name or schedule.label()} is for "
                         f"{schedule.target}; only SM120 schedules have an emulated build")
    if problem.w4a16:
        raise InputError(f"the SM120 kernel takes block-scaled A (W4A4) only, got "
                         f"{problem.a_format}")
    plan(schedule, problem).raise_if_invalid()
    return kernel_class(schedule)(schedule, problem, emulate=True)


def cross_compile_emulated(schedule: Schedule, problem: Problem | None = None,
                           dump_dir: str | None = None):
    """:func:`cross_compile` of the emulated build for sm_90a (no GPU needed).
    Returns (compiled, kernel, seconds)."""
    problem = problem or default_problem(schedule)
    kernel = emulated_kernel(schedule, problem)
    compiled, secs = cross_build(kernel, lambda opts: _dsl_compile(kernel, schedule, opts),
                                 EMULATION_TARGET, dump_dir, schedule.key(), repr(problem),
                                 tag="+emulated")
    return compiled, kernel, secs


def compile_emulated(schedule: Schedule, signature: Signature | None = None) -> CompiledGemm:
    """:func:`compile` of an SM120 schedule for the present SM90 GPU, its MMA emulated
    (:data:`EMULATION_NOTE`). Same caches as :func:`compile`, keyed apart ("+emulated");
    the result runs like any CompiledGemm (planned against the schedule's own target)."""
    from cute_fp4.targets import require_device

    sig = signature or Signature()
    require_device("sm90")
    key = ("Sm120Gemm+emulated", schedule, sig)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is None:
            kernel = emulated_kernel(schedule, sig.problem)
            hit = _CACHE[key] = _build(schedule, sig, kernel, "+emulated")
    return hit


def capped(kern: CompiledGemm, max_ctas: int) -> CompiledGemm:
    """The same compiled kernel, launched with at most ``max_ctas`` CTAs: a persistent
    schedule's CTAs then walk more work units each (``max_ctas=1``: one CTA walks them all).
    For tests; a one-CTA-per-tile schedule ignores it."""
    if max_ctas < 1:
        raise InputError(f"max_ctas must be >= 1, got {max_ctas}")
    return CompiledGemm(kern.schedule, kern.signature, kern._compiled, kern._kernel,
                        kern.compile_s, kern.source, kern._rebuild, max_ctas=max_ctas)
