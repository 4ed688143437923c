"""The GPUs this project compiles for, and the facts that drive schedules.

Numbers are public datasheet figures unless a comment says "measured" (with the date).
Shared memory per block is the opt-in maximum of dynamic shared memory
(``cudaDevAttrMaxSharedMemoryPerBlockOptin``), which is what a kernel's allocation is
compared with.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading

from cute_fp4.errors import DeviceError, InputError


class MmaKind(enum.Enum):
    """Tensor-core instruction families a target offers for NVFP4 work."""

    WARP_BLOCK_SCALED = "mma.sync kind::mxf4nvf4.block_scale (SASS OMMA.SF)"
    WGMMA_BF16 = "wgmma.mma_async bf16 (SASS HGMMA)"


class Family(str, enum.Enum):
    """A kernel family: the targets that share one kernel class and one set of planning rules.

    A ``str`` enum, so ``Family.SM90 == "sm90"`` and catalogue filters written with the
    strings keep working.
    """

    SM120 = "sm120"  # sm_120a, sm_121a: block-scaled warp MMA (OMMA.SF), 99 KiB smem
    SM90 = "sm90"  # sm_90a: FP4 dequantized in the kernel, BF16/FP16 WGMMA, 227 KiB smem

    def __str__(self) -> str:
        return self.value


# compute-capability majors each family covers
FAMILY_MAJORS: dict[Family, tuple[int, ...]] = {Family.SM120: (12,), Family.SM90: (9,)}


@dataclasses.dataclass(frozen=True)
class Target:
    """One compilation target (an ``sm_XXXa`` architecture) and its headline numbers.

    ``family`` is stated, not derived, and must agree with ``cc`` (checked on
    construction): a target of a capability no family covers (SM100, say) cannot be made,
    so it is never planned by another family's rules.
    """

    name: str  # e.g. "sm_120a": what ptxas is given
    cc: tuple[int, int]  # compute capability
    family: Family  # which kernel class and planning rules apply
    gpus: tuple[str, ...]  # products that are this target
    sm_count: int  # of the first product listed
    smem_per_block: int  # bytes, opt-in maximum of dynamic shared memory
    mma: MmaKind
    sass_mma_prefix: str  # opcode prefix the compile report looks for
    peak_tflops: float  # dense tensor-core TFLOP/s of the operation we run (FP4 or BF16)
    mem_bw_gbs: float  # DRAM bandwidth, GB/s

    def __post_init__(self) -> None:
        try:
            fam = Family(self.family)
        except ValueError:
            raise InputError(f"target {self.name}: unknown family {self.family!r}; known: "
                             f"{', '.join(f.value for f in Family)}") from None
        object.__setattr__(self, "family", fam)
        if self.cc[0] not in FAMILY_MAJORS[fam]:
            covered = ", ".join(f"{f.value} {'/'.join(f'{m}.x' for m in ms)}"
                                for f, ms in FAMILY_MAJORS.items())
            raise InputError(f"target {self.name}: compute capability {self.cc[0]}."
                             f"{self.cc[1]} is not in family {fam.value}; families cover "
                             f"{covered}, and no other capability is planned")


def _sm12x(name: str, minor: int, gpus: tuple[str, ...], sm_count: int, peak_tflops: float,
           mem_bw_gbs: float) -> Target:
    """An SM12x target: 99 KiB of shared memory per block, the warp-level block-scaled MMA
    (``OMMA.SF`` in SASS); the products differ in SMs, FP4 peak and memory bandwidth."""
    return Target(name=name, cc=(12, minor), family=Family.SM120, gpus=gpus,
                  sm_count=sm_count, smem_per_block=101_376, mma=MmaKind.WARP_BLOCK_SCALED,
                  sass_mma_prefix="OMMA.SF", peak_tflops=peak_tflops, mem_bw_gbs=mem_bw_gbs)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _sm12x("sm_120a", 0, ("RTX PRO 6000 Blackwell", "RTX 5090"), 188, 2000.0, 1790.0),
        _sm12x("sm_121a", 1, ("GB10",), 48, 450.0, 273.0),
        Target(
            name="sm_90a",
            cc=(9, 0),
            family=Family.SM90,
            gpus=("H200", "H100"),
            sm_count=132,
            smem_per_block=232_448,
            mma=MmaKind.WGMMA_BF16,
            sass_mma_prefix="HGMMA",
            # BF16 dense peak (there are no FP4 tensor cores on SM90); H200 SXM figures.
            peak_tflops=989.0,
            mem_bw_gbs=4800.0,
        ),
    )
}

# Per-product memory bandwidths that differ from the target's first product (the SM count
# is read from the device).
_PRODUCT_BW = {"RTX 5090": 1790.0, "H100": 3350.0, "H200": 4800.0}


def get_target(name: str | Target) -> Target:
    """Look a target up by name (``"sm_120a"``, ``"sm120"`` and ``"120"`` all work)."""
    if isinstance(name, Target):
        return name
    key = str(name).lower().replace("sm", "").strip("_").rstrip("af")
    for t in TARGETS.values():
        if t.name == name or f"{t.cc[0]}{t.cc[1]}" == key:
            return t
    raise InputError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}")


@dataclasses.dataclass(frozen=True)
class Device:
    """The GPU present in this process, as far as the framework cares."""

    index: int
    name: str
    cc: tuple[int, int]
    sm_count: int
    target: Target | None  # None: a GPU this project has no kernels for
    mem_bw_gbs: float


def detect_device(index: int | None = None) -> Device | None:
    """Describe the current CUDA device, or return None when there is no GPU.

    Imports torch lazily; never initialises CUDA when torch reports no device.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    idx = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(idx)
    cc = (props.major, props.minor)
    target = next((t for t in TARGETS.values() if t.cc == cc), None)
    bw = next((v for k, v in _PRODUCT_BW.items() if k in props.name), None)
    if bw is None:
        bw = target.mem_bw_gbs if target else 0.0
    return Device(idx, props.name, cc, props.multi_processor_count, target, bw)


def require_device(family: Family | str | None = None) -> Device:
    """The current device, or a DeviceError saying plainly what is missing."""
    dev = detect_device()
    if dev is None:
        raise DeviceError("no CUDA GPU is visible to this process (torch.cuda.is_available() "
                          "is False); only `schedules`, `plan` and `compile` work without one")
    if dev.target is None:
        raise DeviceError(f"GPU {dev.name!r} (sm_{dev.cc[0]}{dev.cc[1]}) has no kernels here; "
                          f"supported: {', '.join(TARGETS)}")
    if family is not None and dev.target.family != family:
        raise DeviceError(f"GPU {dev.name!r} is {dev.target.name}; this needs a {family} GPU")
    return dev


# ----------------------------------------------------------------------------- emulation

_EMULATING: list[Target] = []  # the target cute_fp4.emulation.emulate() stands in for


def emulated_target() -> Target | None:
    """The target ``cute_fp4.emulation.emulate`` stands in for, None outside it."""
    return _EMULATING[-1] if _EMULATING else None


def gemm_device() -> Device:
    """:func:`require_device` as the GEMM side sees it: inside ``emulate()``, the present
    GPU with the emulated target (and a name that says so, so no tuning of the real GPU
    applies)."""
    dev = require_device()
    t = emulated_target()
    if t is None:
        return dev
    return dataclasses.replace(dev, name=f"{dev.name} (emulating {t.name})", cc=t.cc,
                               target=t)


def capability_major(device) -> int:
    """The compute-capability major of the torch ``device`` as the GEMM side sees it (the
    emulated target's inside ``emulate()``); 0 off a GPU."""
    if getattr(device, "type", None) != "cuda":
        return 0
    t = emulated_target()
    if t is not None:
        return t.cc[0]
    import torch

    return torch.cuda.get_device_capability(device)[0]


# ----------------------------------------------------------------------------- reference execution

REFERENCE_ENV = "CUTE_FP4_REFERENCE"  # "1": every NVFP4 product computed by the exact reference
_REFERENCE = threading.local()  # .depth: reference_execution() blocks entered on this thread


def reference_mode() -> bool:
    """Whether NVFP4 products run on the exact reference instead of kernels: the environment
    variable ``CUTE_FP4_REFERENCE=1`` (worker processes inherit it) or inside
    :class:`reference_execution` on this thread. Then ``gemm``, ``grouped_gemm``, the
    activation quantizer and every layer built on them compute on any device, the CPU
    included, with ``cute_fp4.reference`` (float64 on the exact block values, one rounding
    to the output dtype; activations quantized by ``cute_fp4.quantize``, bit for bit the
    fused kernel's): integrations (vLLM on a CPU, transformers tensor parallelism over gloo)
    then run their real code end to end. Off by default: on a CPU without it, a call is a
    DeviceError."""
    return getattr(_REFERENCE, "depth", 0) > 0 or os.environ.get(REFERENCE_ENV, "") == "1"


class reference_execution:  # noqa: N801 (used as a function: ``with reference_execution():``)
    """Compute NVFP4 products with the exact reference inside the block (this thread):
    :func:`reference_mode`. Nests; the environment variable does the same process-wide."""

    __slots__ = ()

    def __enter__(self) -> None:
        _REFERENCE.depth = getattr(_REFERENCE, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _REFERENCE.depth -= 1
