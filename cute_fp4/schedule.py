"""Schedules: how a GEMM is run, as small frozen, hashable components.

A schedule says nothing about the problem (M, N, K, operand formats); ``plan()`` checks a
schedule against its target and, optionally, a problem. Derive variants with
``dataclasses.replace`` (or :meth:`Schedule.replace`, which also accepts component fields)::

    s = catalogue.get("sm120_128x128x128")
    deep = s.replace(tile=Tile(128, 128, 256), epilogue=Epilogue(tile=(64, 32)))
"""

from __future__ import annotations

import dataclasses
import enum

from cute_fp4.errors import InputError
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


class OutDtype(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def nbytes(self) -> int:
        return 4 if self is OutDtype.FP32 else 2

    @classmethod
    def of(cls, x: object) -> OutDtype:
        """Accept an OutDtype, its value string, or a torch dtype."""
        if isinstance(x, cls):
            return x
        names = {"torch.bfloat16": cls.BF16, "torch.float16": cls.FP16,
                 "torch.float32": cls.FP32}
        if str(x) in names:
            return names[str(x)]
        try:
            return cls(str(x))
        except ValueError:
            raise InputError(f"unsupported output dtype {x!r}: use bfloat16, float16 "
                             "or float32") from None


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
        if len(self.mma) != 2:
            raise InputError(f"Warps.mma must be (along M, along N), got {self.mma!r}")
        for v in self.mma:
            _positive("Warps.mma entry", v)

    @property
    def groups(self) -> int:
        return 2 if self.roles is WarpRoles.PINGPONG else 1


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """Tile scheduler: persistent CTAs (one per SM) or one CTA per tile."""

    persistent: bool = True
    raster: Raster = Raster.ALONG_M
    group_size: int = 8  # tiles along the raster direction before moving on (L2 reuse)

    def __post_init__(self) -> None:
        _positive("Scheduler.group_size", self.group_size)


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """Alpha, conversion and the store. ``tile=None`` stores the whole CTA tile at once."""

    out_dtype: OutDtype = OutDtype.BF16
    tile: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.tile is not None:
            if len(self.tile) != 2:
                raise InputError(f"Epilogue.tile must be (m, n), got {self.tile!r}")
            for v in self.tile:
                _positive("Epilogue.tile entry", v)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Everything that decides how a GEMM runs, hashable so it can key a compile cache.

    ``stages=None`` means auto: as many mainloop stages as fit in shared memory.
    ``split_k > 1`` splits the K loop over that many CTAs per output tile and reduces the
    FP32 partials in a fixed order (deterministic).
    ``swap_ab`` (sm_90a decode): the weight B is WGMMA's A operand (64 rows per CTA,
    converted in registers) and the activations are its N (``tile.m`` columns); the kernel
    computes ``D^T`` tiles and stores them transposed. ``tile.n`` must be 64.
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
    name: str = dataclasses.field(default="", compare=False)
    doc: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", get_target(self.target).name)
        if self.stages is not None:
            _positive("Schedule.stages", self.stages)
        _positive("Schedule.split_k", self.split_k)
        if not isinstance(self.swap_ab, bool):
            raise InputError(f"Schedule.swap_ab must be a bool, got {self.swap_ab!r}")
        for f, typ in (("tile", Tile), ("warps", Warps), ("scheduler", Scheduler),
                       ("epilogue", Epilogue), ("sf_load", SFLoad)):
            if not isinstance(getattr(self, f), typ):
                raise InputError(f"Schedule.{f} must be a {typ.__name__}, "
                                 f"got {type(getattr(self, f)).__name__}")

    @property
    def arch(self) -> Target:
        return get_target(self.target)

    def replace(self, **changes: object) -> Schedule:
        """``dataclasses.replace`` that also takes component fields by their own names:
        ``roles``, ``raster``, ``persistent``, ``group_size``, ``out_dtype``, ``epi_tile``."""
        nested = {
            "roles": ("warps", "roles"), "mma": ("warps", "mma"),
            "raster": ("scheduler", "raster"), "persistent": ("scheduler", "persistent"),
            "group_size": ("scheduler", "group_size"),
            "out_dtype": ("epilogue", "out_dtype"), "epi_tile": ("epilogue", "tile"),
        }
        top: dict[str, object] = {}
        for key, value in changes.items():
            if key in nested:
                comp, field = nested[key]
                base = top.get(comp, getattr(self, comp))
                if field == "out_dtype":
                    value = OutDtype.of(value)
                top[comp] = dataclasses.replace(base, **{field: value})
            else:
                top[key] = value
        if isinstance(top.get("tile"), tuple):
            top["tile"] = Tile(*top["tile"])
        return dataclasses.replace(self, **top)

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
        if self.epilogue.tile:
            parts.append(f"epi={self.epilogue.tile[0]}x{self.epilogue.tile[1]}")
        return " ".join(parts)

    def key(self) -> str:
        """A stable text key of every field that affects code generation."""
        d = dataclasses.asdict(self)
        d.pop("name")
        d.pop("doc")
        if not d["swap_ab"]:
            d.pop("swap_ab")  # keys of existing schedules (and their caches) are unchanged
        return repr(_plain(d))


def _plain(x: object) -> object:
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return tuple(_plain(v) for v in x)
    return x


@dataclasses.dataclass(frozen=True)
class Problem:
    """A GEMM problem: ``D[M, N] = alpha * A[M, K] @ B[N, K]^T`` (TN).

    ``a_format`` is ``"nvfp4"`` (W4A4) or ``"bf16"``/``"fp16"`` (W4A16: A is 16-bit).
    B is always NVFP4. A dimension of 0 means "any" (symbolic) for planning.
    """

    m: int = 0
    n: int = 0
    k: int = 0
    a_format: str = "nvfp4"

    def __post_init__(self) -> None:
        for f in ("m", "n", "k"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise InputError(f"Problem.{f} must be an int >= 0, got {v!r}")
        if self.a_format not in ("nvfp4", "bf16", "fp16"):
            raise InputError(f"Problem.a_format must be nvfp4, bf16 or fp16, "
                             f"got {self.a_format!r}")

    @property
    def w4a16(self) -> bool:
        return self.a_format != "nvfp4"
