"""cute_fp4: NVFP4 GEMM kernels declared as composable schedules, compiled with the CuTe DSL.

Importing the package is cheap and has no side effects: torch is imported, the CuTe DSL
and CUDA only when something is compiled or run.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Two modules share their name with their main function; binding the functions here, when
# the package loads, keeps ``cute_fp4.plan``/``cute_fp4.compile`` the functions (a later
# ``import cute_fp4.plan`` does not rebind an already-loaded submodule). Both modules are
# light: they import the CuTe DSL only inside functions.
from cute_fp4.compile import compile as compile  # noqa: E402
from cute_fp4.plan import plan as plan  # noqa: E402

# public name -> module that defines it (resolved on first use)
_EXPORTS = {
    "NVFP4Tensor": "nvfp4", "quantize": "nvfp4", "swizzle_scales": "nvfp4",
    "unswizzle_scales": "nvfp4", "scale_offset": "nvfp4",
    "Schedule": "schedule", "Tile": "schedule", "Warps": "schedule", "WarpRoles": "schedule",
    "SFLoad": "schedule", "Scheduler": "schedule", "Raster": "schedule",
    "Epilogue": "schedule", "OutDtype": "schedule", "Problem": "schedule",
    "Plan": "plan",
    "Target": "targets", "TARGETS": "targets", "get_target": "targets",
    "detect_device": "targets",
    "CompiledGemm": "compile", "compile_report": "compile",
    "gemm": "api", "validate": "api", "grouped_gemm": "grouped",
    "NVFP4Linear": "nn", "convert": "conversion", "NVFP4GatedMLP": "mlp",
    "NVFP4MoE": "moe", "reference_execution": "targets", "reference_mode": "targets",
}
# the modules the documentation reaches through the package (``cf.packed.repack(w)``),
# imported on first use
_SUBMODULES = ("api", "bench", "catalogue", "conversion", "emulation", "errors", "fused",
               "grouped", "hf", "layers", "mlp", "moe", "nn", "nvfp4", "operands", "ops",
               "packed", "quant", "reference", "schedule", "targets", "tune", "tuning")

__all__ = sorted([*_EXPORTS, "plan", "compile"]) + list(_SUBMODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"cute_fp4.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"cute_fp4.{name}")
    raise AttributeError(f"module 'cute_fp4' has no attribute {name!r}")
