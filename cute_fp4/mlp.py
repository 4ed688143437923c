"""A gated (SwiGLU) MLP on NVFP4 weights with the activation fused into the gate_up GEMM:
:class:`NVFP4GatedMLP`.

``y = down(silu(gate(x)) * up(x))`` (Llama, Qwen, Mistral MLPs). Unfused, a W4A16 decode
step of such an MLP is three GEMMs and two elementwise kernels (``NVFP4Linear`` per
projection, ``F.silu``, the product); here it is two GEMMs: gate and up are one weight
``[2I, H]`` with their rows interleaved in the kernel's gate/up groups
(``cute_fp4.fused``; converted once, at construction), and the gate_up GEMM's epilogue
computes ``silu(gate) * up`` (``gemm(..., silu_mul=True)``: the bits of the unfused
``F.silu(gate) * up`` on the GEMM's own output). The down projection is an
:class:`~cute_fp4.nn.NVFP4Linear`. One global scale for gate and up (quantized together).
"""

from __future__ import annotations

import torch

from cute_fp4.api import gemm
from cute_fp4.errors import InputError
from cute_fp4.fused import interleave_gate_up
from cute_fp4.nn import NVFP4Linear
from cute_fp4.nvfp4 import quantize
from cute_fp4.packed import repack

__all__ = ["NVFP4GatedMLP"]


class NVFP4GatedMLP(torch.nn.Module):
    """SwiGLU MLP, W4A16, the activation fused into the gate_up GEMM (module docstring).

    ``gate_up``: the interleaved NVFP4 weight (or its packed form on sm_90a), ``group``
    its gate/up group, ``down``: the down projection's ``NVFP4Linear``."""

    def __init__(self, gate_up, group: int, down: NVFP4Linear, schedule="auto"):
        super().__init__()
        if not isinstance(down, NVFP4Linear):
            raise InputError(f"down must be an NVFP4Linear, got {type(down).__name__}")
        self.gate_up, self.group, self.down, self.schedule = gate_up, group, down, schedule
        self.intermediate = gate_up.shape[0] // 2

    @classmethod
    def from_linears(cls, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear,
                     schedule="auto") -> NVFP4GatedMLP:
        """Quantize a float MLP's three projections (gate and up together, one global
        scale) for the GPU they are on."""
        from cute_fp4.planning.common import silu_group
        from cute_fp4.targets import require_device

        if gate.bias is not None or up.bias is not None:
            raise InputError("gate/up projections with a bias are not supported by the fused "
                             "MLP (convert them as NVFP4Linear layers)")
        target = require_device().target
        w13 = quantize(torch.cat([gate.weight.detach(), up.weight.detach()]))
        from cute_fp4 import catalogue

        probe = catalogue.get("sm90_rs_packed_decode" if target.family == "sm90"
                              else "sm120_stream_decode")
        group = silu_group(probe)
        w13 = interleave_gate_up(w13, group)
        if target.family == "sm90" or w13.shape[1] % 64 == 0 and target.family == "sm120":
            w13 = repack(w13)
        return cls(w13, group, NVFP4Linear.from_linear(down, schedule=schedule), schedule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        h = gemm(x.reshape(-1, x.shape[-1]), self.gate_up, silu_mul=True, out_dtype=x.dtype,
                 schedule=self.schedule)
        return self.down(h).reshape(*lead, -1)
