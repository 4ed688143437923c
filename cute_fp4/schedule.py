"""Schedules: how a GEMM is run, as small frozen, hashable components.

A schedule says nothing about the problem (M, N, K, operand formats); ``plan()`` checks a
schedule against its target and, optionally, a problem. Derive variants with
:meth:`Schedule.replace`, which also takes component fields by name and enum values as
strings, and names the result after what changed::

    s = catalogue.get("sm120_default")
    deep = s.replace(tile=(128, 128, 256), epi_tile=(64, 32), roles="pingpong")
    deep.name  # 'sm120_default+tile=128x128x256+roles=pingpong+epi_tile=64x32'

Enum fields (``roles``, ``raster``, ``sf_load``, ``out_dtype``) are normalised on
construction, so a value string can never reach a kernel (which tests with ``is``) and
``key()`` always follows the generated code.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum

from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.formats import BlockFormat, Operand
from cute_fp4.targets import Target, get_target


class WarpRoles(enum.Enum):
    """How the MMA warps share output tiles (a producer warp always issues the loads)."""

    COOPERATIVE = "cooperative"  # all MMA warps work on one tile
    PINGPONG = "pingpong"  # two MMA warp groups alternate tiles; one's epilogue hides


class SFLoad(enum.Enum):
    """How scale factors travel from global to shared memory."""

    TMA = "tma"  # bulk tensor copies, same barrier as A and B
    CP_ASYNC = "cp_async"  # per-thread 16-byte cp.async by the producer warp


class Raster(enum.Enum):
    """Order in which a persistent CTA walks output tiles."""

    ALONG_M = "m"  # consecutive tiles share a column of B (good when N is large)
    ALONG_N = "n"  # consecutive tiles share a row block of A


class Mainloop(enum.Enum):
    """Which mainloop a kernel runs, where a family has more than one (sm_90a).

    ``STANDARD``: the family's mainloops on the plain cuBLAS-layout weight (on sm_90a the
    shared-memory sourced one, or the swap-AB decode one with ``swap_ab``).
    ``RS_PACKED`` (sm_90a): register-sourced WGMMA on a weight repacked offline into WGMMA
    A-fragment order (:mod:`cute_fp4.packed`); the weight is WGMMA's A operand, decoded in
    registers, the activations are its B, D^T is stored (kernels/sm90_rs_wide.py). Such a
    kernel reads only a packed weight, and a packed weight only such a kernel.
    ``STREAM`` (sm_90a and sm_120a/sm_121a, 16-bit activations, decode sizes): the same
    packed weight streamed from global memory straight into registers by every warp, decoded
    there and multiplied with warp-level ``mma.sync`` (kernels/stream.py); no shared memory,
    no producer warp, K split over CTAs and reduced in the kernel.
    """

    STANDARD = "standard"
    RS_PACKED = "rs_packed"
    STREAM = "stream"

    @property
    def reads_packed(self) -> bool:
        """Whether the mainloop reads the fragment-order packed weight (cute_fp4.packed)."""
        return self is not Mainloop.STANDARD


class OutDtype(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def nbytes(self) -> int:
        return 4 if self is OutDtype.FP32 else 2

    @classmethod
    def of(cls, x: object, field: str = "out_dtype") -> OutDtype:
        """Accept an OutDtype, its value string (``"fp16"``), a torch dtype name
        (``"float16"``) or a torch dtype; anything else is an InputError naming ``field``."""
        if isinstance(x, cls):
            return x
        alias = {"bfloat16": cls.BF16, "float16": cls.FP16, "half": cls.FP16,
                 "float32": cls.FP32, "float": cls.FP32}
        text = str(x).removeprefix("torch.").lower()
        if text in alias:
            return alias[text]
        try:
            return as_enum(cls, x, field)
        except InputError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise InputError(f"unsupported output dtype {x!r} for {field}: use one of "
                             f"{allowed}, a torch dtype or its name (float16, ...)") from None


def as_enum(cls: type[enum.Enum], value: object, field: str) -> enum.Enum:
    """``value`` as a member of ``cls``: a member, its value string (``"pingpong"``) or its
    name in any case (``"PINGPONG"``). Otherwise an InputError naming the field, the bad
    value, the allowed values and the closest of them."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if value.lower() in (str(member.value).lower(), member.name.lower()):
                return member
    values = [str(m.value) for m in cls]
    close = difflib.get_close_matches(str(value).lower(), values, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise InputError(f"{field} must be one of {', '.join(map(repr, values))} (or "
                     f"{cls.__name__}.<NAME>), got {value!r}{hint}")


class Choice(enum.StrEnum):
    """A named choice of the API (a mode, a layout, a fused operation): a ``str`` enum, so
    a member equals, hashes and prints as its string and ``repr`` is the string's (keys and
    messages read as before); :meth:`of` takes a member or its string at the API edge."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def of(cls, value: object, field: str):
        """``value`` as a member (:func:`as_enum`: a member, its string or name, any case);
        an InputError naming ``field``, the allowed values and the closest one otherwise."""
        return as_enum(cls, value, field)


def _set(obj: object, name: str, value: object) -> None:
    """Normalise a field of a frozen dataclass in ``__post_init__``."""
    object.__setattr__(obj, name, value)


def _pair(name: str, v: object) -> tuple[int, int]:
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise InputError(f"{name} must be a pair of positive ints, got {v!r}")
    for x in v:
        _positive(f"{name} entry", x)
    return tuple(v)


def _bool(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise InputError(f"{name} must be True or False, got {v!r}")


def _positive(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InputError(f"{name} must be a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Tile:
    """CTA tile in elements: M rows of A, N rows of B, K per mainloop step."""

    m: int = 128
    n: int = 128
    k: int = 128

    def __post_init__(self) -> None:
        for f in ("m", "n", "k"):
            _positive(f"Tile.{f}", getattr(self, f))

    def __iter__(self):
        return iter((self.m, self.n, self.k))

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


@dataclasses.dataclass(frozen=True)
class Warps:
    """Warp roles and the layout of MMA warps over the tile.

    ``mma`` is (warps along M, warps along N) of one MMA group. SM120 warps are single warps
    issuing m16n8k64 MMAs; SM90 "warps" are counted in warpgroups of 4 warps issuing WGMMA.
    """

    roles: WarpRoles = WarpRoles.COOPERATIVE
    mma: tuple[int, int] = (4, 2)

    def __post_init__(self) -> None:
        _set(self, "roles", as_enum(WarpRoles, self.roles, "Warps.roles"))
        _set(self, "mma", _pair("Warps.mma (along M, along N)", self.mma))

    @property
    def groups(self) -> int:
        return 2 if self.roles is WarpRoles.PINGPONG else 1


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """Tile scheduler: persistent CTAs (one per SM) or one CTA per tile."""

    persistent: bool = True
    raster: Raster = Raster.ALONG_M
    group_size: int = 8  # tiles along the raster direction before moving on (L2 reuse)
    # grouped (MoE): the work units of one GEMM per expert, walked from a device-side table
    # of group offsets (kernels/scheduler.py GroupedScheduler)
    grouped: bool = False

    def __post_init__(self) -> None:
        _bool("Scheduler.persistent", self.persistent)
        _bool("Scheduler.grouped", self.grouped)
        _set(self, "raster", as_enum(Raster, self.raster, "Scheduler.raster"))
        _positive("Scheduler.group_size", self.group_size)


# Fused epilogue operations, in the order they apply (kernels/epilogue.py):
# * "bias": D[:, n] += bias[n] in FP32, before the conversion (one rounding);
# * "silu_mul": the weight's rows are gate and up interleaved in groups of G rows (rows
#   2Gj .. 2Gj + G - 1 gate, the next G up: cute_fp4.fused.interleave_gate_up; G is
#   plan.silu_group(schedule), the width at which the kernel's MMA gives one thread both);
#   D has N / 2 columns, h = silu(g) * u with g and u rounded to the output type first and
#   silu(g) rounded again: the bits of the unfused ``gemm -> F.silu(g) * u`` in that type;
# * "swiglu_oai": gpt-oss's clamped SwiGLU on the same interleaved gate/up rows (or
#   silu_mul, not both): g = min(gate, 7), u = clamp(up, -7, 7), h = (u + 1) * (g *
#   sigmoid(1.702 g)), every operation rounded to the output type where transformers'
#   ``GptOssExperts._apply_gate`` rounds on that type (cute_fp4.fused.swiglu_oai_unfused);
# * "nvfp4_out": the output written as NVFP4 (the next W4A4 layer's activation) with a given
#   global scale. Rounding point: the output as the unfused pipeline has it, rounded to
#   the output type (after bias and the gated activation), then nvfp4's quantize rule
#   (``quantize(x, global_scale)``): the same codes and blocked scales, padding included,
#   bit for bit.
class EpilogueOp(Choice):
    """An operation fused into a GEMM's epilogue (in this order of application)."""

    BIAS = "bias"
    SILU_MUL = "silu_mul"
    SWIGLU_OAI = "swiglu_oai"
    NVFP4_OUT = "nvfp4_out"


EPILOGUE_OPS = tuple(EpilogueOp)
# activations of gate/up pairs: N / 2 output columns
GATED_OPS = (EpilogueOp.SILU_MUL, EpilogueOp.SWIGLU_OAI)
SWIGLU_ALPHA = 1.702  # gpt-oss's clamped SwiGLU: sigmoid(alpha g) ...
SWIGLU_LIMIT = 7.0  # ... of the gate clamped above, the up clamped to [-limit, limit]


def gated_op(ops: tuple[str, ...]) -> str | None:
    """The gated activation among ``ops`` (:data:`GATED_OPS`), None without one."""
    return next((o for o in ops if o in GATED_OPS), None)


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """Alpha, fused operations, conversion and the store. ``tile=None`` stores the whole CTA
    tile at once. ``ops``: the fused operations (:data:`EPILOGUE_OPS`, in that order);
    with any, the tile is stored from registers."""

    out_dtype: OutDtype = OutDtype.BF16
    tile: tuple[int, int] | None = None
    ops: tuple[EpilogueOp, ...] = ()

    def __post_init__(self) -> None:
        _set(self, "out_dtype", OutDtype.of(self.out_dtype, "Epilogue.out_dtype"))
        if self.tile is not None:
            _set(self, "tile", _pair("Epilogue.tile (m, n)", self.tile))
        _set(self, "ops", _ops(self.ops))

    def has(self, op: str) -> bool:
        return op in self.ops


def _ops(ops: object) -> tuple[EpilogueOp, ...]:
    """``ops`` as a tuple of known operations in their order of application."""
    if isinstance(ops, str):
        ops = tuple(o for o in ops.replace("+", ",").split(",") if o)
    if not isinstance(ops, (tuple, list)) or not all(isinstance(o, str) for o in ops):
        raise InputTypeError(f"Epilogue.ops must be a tuple of operation names, got {ops!r}")
    for o in ops:  # an unknown name: the allowed ones and the closest
        EpilogueOp.of(o, "each of Epilogue.ops")
    if len(set(ops)) != len(ops):
        raise InputError(f"Epilogue.ops names an operation twice: {tuple(ops)}")
    if sum(o in GATED_OPS for o in ops) > 1:
        raise InputError(f"Epilogue.ops takes one gated activation of "
                         f"{', '.join(GATED_OPS)}, got {tuple(ops)}")
    return tuple(o for o in EPILOGUE_OPS if o in ops)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Everything that decides how a GEMM runs, hashable so it can key a compile cache.

    ``stages=None`` means auto: as many mainloop stages as fit in shared memory.
    ``split_k > 1`` splits the K loop over that many CTAs per output tile and reduces the
    FP32 partials in a fixed order (deterministic).
    ``swap_ab`` (sm_90a decode): the weight B is WGMMA's A operand (64 rows per CTA,
    converted in registers) and the activations are its N (``tile.m`` columns); the kernel
    computes ``D^T`` tiles and stores them transposed. ``tile.n`` must be 64.
    ``mainloop`` (:class:`Mainloop`): ``rs_packed`` runs the register-sourced mainloop on a
    fragment-order packed weight (``tile.m`` activation rows are WGMMA's N, ``tile.n``
    weight rows are split over the consumer warpgroups along M).
    ``name`` and ``doc`` are labels only; they take no part in equality or hashing.
    """

    target: str = "sm_120a"
    tile: Tile = Tile()
    stages: int | None = None
    warps: Warps = Warps()
    sf_load: SFLoad = SFLoad.TMA
    scheduler: Scheduler = Scheduler()
    split_k: int = 1
    epilogue: Epilogue = Epilogue()
    swap_ab: bool = False
    mainloop: Mainloop = Mainloop.STANDARD
    name: str = dataclasses.field(default="", compare=False)
    doc: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", get_target(self.target).name)
        if self.stages is not None:
            _positive("Schedule.stages", self.stages)
        _positive("Schedule.split_k", self.split_k)
        _bool("Schedule.swap_ab", self.swap_ab)
        _set(self, "sf_load", as_enum(SFLoad, self.sf_load, "Schedule.sf_load"))
        _set(self, "mainloop", as_enum(Mainloop, self.mainloop, "Schedule.mainloop"))
        for f, typ in (("tile", Tile), ("warps", Warps), ("scheduler", Scheduler),
                       ("epilogue", Epilogue)):
            if not isinstance(getattr(self, f), typ):
                raise InputError(f"Schedule.{f} must be a {typ.__name__}, "
                                 f"got {type(getattr(self, f)).__name__}")

    @property
    def arch(self) -> Target:
        return get_target(self.target)

    def replace(self, **changes: object) -> Schedule:
        """``dataclasses.replace`` that also takes component fields by their own names
        (``roles``, ``mma``, ``raster``, ``persistent``, ``group_size``, ``out_dtype``,
        ``epi_tile``), a tuple for ``tile`` and value strings for enums (``roles="pingpong"``).

        The result is named after what changed, so a derived schedule never passes for its
        catalogue original: ``sm120_default+epi_tile=64x32``. A change of ``target`` (to
        another member of the family) keeps the name; ``name=`` sets one explicitly. A named
        schedule's ``target`` stays in its family (an InputError says why); an unnamed
        ``Schedule(...)`` may take any target, as its constructor does.
        """
        unknown = sorted(set(changes) - set(_NESTED) - {f.name for f in
                                                        dataclasses.fields(self)})
        if unknown:
            allowed = sorted({f.name for f in dataclasses.fields(self)} | set(_NESTED))
            raise InputError(f"Schedule.replace got unknown field(s) {', '.join(unknown)}; "
                             f"fields are {', '.join(allowed)}")
        if "target" in changes and self.name:
            _same_family(self, changes["target"])
        top: dict[str, object] = {}
        for key, value in changes.items():
            if key in _NESTED:
                comp, field = _NESTED[key]
                base = top.get(comp, getattr(self, comp))
                top[comp] = dataclasses.replace(base, **{field: value})
            else:
                top[key] = value
        if isinstance(top.get("tile"), tuple):
            top["tile"] = Tile(*top["tile"])
        new = dataclasses.replace(self, **top)
        if "name" not in changes and self.name:
            new = dataclasses.replace(new, name=_derived_name(self, new))
        return new

    def label(self) -> str:
        """A short human description, e.g. ``sm_120a 128x128x128 cooperative s=auto``."""
        parts = [self.target, str(self.tile), self.warps.roles.value,
                 f"s={self.stages or 'auto'}"]
        if self.sf_load is not SFLoad.TMA:
            parts.append(f"sf={self.sf_load.value}")
        if self.split_k > 1:
            parts.append(f"splitk={self.split_k}")
        if self.swap_ab:
            parts.append("swap_ab")
        if self.mainloop is not Mainloop.STANDARD:
            parts.append(self.mainloop.value)
        if self.scheduler.grouped:
            parts.append("grouped")
        if self.epilogue.tile:
            parts.append(f"epi={self.epilogue.tile[0]}x{self.epilogue.tile[1]}")
        if self.epilogue.ops:
            parts.append("+".join(self.epilogue.ops))
        return " ".join(parts)

    def key(self) -> str:
        """A stable text key of every field that affects code generation."""
        d = dataclasses.asdict(self)
        d.pop("name")
        d.pop("doc")
        if not d["swap_ab"]:
            d.pop("swap_ab")  # keys of existing schedules (and their caches) are unchanged
        if d["mainloop"] is Mainloop.STANDARD:
            d.pop("mainloop")  # likewise
        if not d["scheduler"]["grouped"]:
            d["scheduler"].pop("grouped")  # likewise
        if not d["epilogue"]["ops"]:
            d["epilogue"].pop("ops")  # likewise
        return repr(_plain(d))


def _same_family(s: Schedule, target: object) -> None:
    """Refuse moving the named schedule ``s`` to a target of another kernel family: its
    tile, warps and mainloop were chosen for its own family's kernel, and the name would
    no longer say what it is."""
    new = target if isinstance(target, Target) else get_target(target)
    old = s.arch
    if new.family != old.family:
        raise InputError(
            f"schedule {s.name} is for {old.name} (family {old.family}); "
            f"replace(target={new.name!r}) would move it to family {new.family}, whose "
            f"kernel takes other tiles, warps and mainloops: start from a {new.family} "
            f"catalogue schedule (e.g. {new.family}_default) or build "
            f"Schedule(target={new.name!r}, ...); replace(target=...) moves a schedule "
            f"between the targets of its family ({old.family}: "
            f"{', '.join(_family_targets(old.family))})")


def _family_targets(family) -> list[str]:
    from cute_fp4.targets import TARGETS

    return [t.name for t in TARGETS.values() if t.family == family]


# replace() keywords that name a field of a component: keyword -> (component, field)
_NESTED = {
    "roles": ("warps", "roles"), "mma": ("warps", "mma"),
    "raster": ("scheduler", "raster"), "persistent": ("scheduler", "persistent"),
    "group_size": ("scheduler", "group_size"), "grouped": ("scheduler", "grouped"),
    "out_dtype": ("epilogue", "out_dtype"), "epi_tile": ("epilogue", "tile"),
    "ops": ("epilogue", "ops"),
}


def _leaves(s: Schedule) -> dict[str, object]:
    """The fields that make up a schedule, by the short names ``replace`` takes."""
    out = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
           if f.name not in ("name", "doc", "target", "warps", "scheduler", "epilogue")}
    out.update({k: getattr(getattr(s, comp), field) for k, (comp, field) in _NESTED.items()})
    return out


def _text(key: str, v: object) -> str:
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, tuple):
        return ("+" if key == "ops" else "x").join(map(str, v)) or "none"
    if v is None:
        return "auto" if key == "stages" else "none"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _derived_name(old: Schedule, new: Schedule) -> str:
    """``old.name`` plus ``+field=value`` for each field that changed; a field changed again
    replaces its earlier entry (``a+stages=3`` -> ``a+stages=4``)."""
    base, *parts = old.name.split("+")
    changed = dict(p.split("=", 1) for p in parts if "=" in p)
    a, b = _leaves(old), _leaves(new)
    for key in b:
        if a[key] != b[key]:
            changed[key] = _text(key, b[key])
    return "+".join([base, *(f"{k}={v}" for k, v in changed.items())])


def _plain(x: object) -> object:
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return tuple(_plain(v) for v in x)
    return x


@dataclasses.dataclass(frozen=True, repr=False)
class Problem:
    """A GEMM problem: ``D[M, N] = alpha * A[M, K] @ B[N, K]^T`` (TN).

    ``a_format`` (:class:`~cute_fp4.formats.Operand`; its value strings are accepted and
    compare equal) is a block format (W4A4) or ``"bf16"``/``"fp16"`` (W4A16: A is 16-bit);
    ``b_format``, the weight's, is a block format (default NVFP4). W4A4 takes both in one
    format. A dimension of 0 means "any" (symbolic) for planning.
    ``groups`` > 0: a grouped (MoE) problem of that many experts, ``m`` their total rows
    (tokens sorted by expert), B ``[groups, N, K]``; 0: a dense GEMM.
    """

    m: int = 0
    n: int = 0
    k: int = 0
    a_format: Operand = Operand.NVFP4
    groups: int = 0
    b_format: Operand = Operand.NVFP4

    def __post_init__(self) -> None:
        for f in ("m", "n", "k", "groups"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise InputError(f"Problem.{f} must be an int >= 0, got {v!r}")
        _set(self, "a_format", Operand.of(self.a_format, "Problem.a_format"))
        _set(self, "b_format", Operand.of(self.b_format, "Problem.b_format"))
        if self.b_format.sixteen_bit:
            raise InputError(f"Problem.b_format must be a block format (the weight is "
                             f"block-scaled 4-bit), got {self.b_format!r}")
        if not self.a_format.sixteen_bit and self.a_format != self.b_format:
            raise InputError(f"Problem: A is {self.a_format} and B is {self.b_format}; W4A4 "
                             "takes both operands in one block format")

    def __repr__(self) -> str:
        # the weight format only where it is not the default: problems' reprs key the
        # build caches, whose entries of NVFP4 problems stay valid
        extra = "" if self.b_format is Operand.NVFP4 else f", b_format={self.b_format!r}"
        return (f"Problem(m={self.m}, n={self.n}, k={self.k}, a_format={self.a_format!r}, "
                f"groups={self.groups}{extra})")

    @property
    def w4a16(self) -> bool:
        return self.a_format.sixteen_bit

    @property
    def fmt(self) -> BlockFormat:
        """The weight's block format (and W4A4's activation's): its block size, scale type
        and layout rules (:class:`~cute_fp4.formats.BlockFormat`)."""
        return self.b_format.block_format

    @classmethod
    def of(cls, x: object) -> Problem | None:
        """Accept a Problem, ``None`` (any problem), an ``(m, n, k)`` tuple or an
        ``(m, n, k, a_format)`` tuple. A tuple names a concrete problem, so its sizes must
        be > 0 (a zero is an InputError; a Problem field left at 0 means "any")."""
        if x is None or isinstance(x, cls):
            return x
        if isinstance(x, (tuple, list)) and len(x) in (3, 4, 5):
            zero = [f"{d} = 0" for d, v in zip("MNK", x[:3]) if isinstance(v, int) and v == 0]
            if zero:
                raise InputError(f"problem {tuple(x)}: {', '.join(zero)}; a problem's sizes "
                                 "must be > 0 (Problem() leaves a size open: any)")
            return cls(*x)
        raise InputTypeError(f"a problem must be a Problem or an (m, n, k) tuple, "
                             f"got {type(x).__name__} {x!r}")
