"""The parameters of vLLM layers around the prepared ones: checked once loaded, then
replaced by the prepared tensors (one copy in memory, module parameters as vLLM expects)."""

from __future__ import annotations

import torch

from cute_fp4.errors import FormatError

__all__ = ["check_loaded", "keep_as_parameters"]


def check_loaded(layer: torch.nn.Module, names, prefix: str) -> None:
    """The scales ``names`` of ``layer`` were all loaded: created NaN, a NaN left means the
    checkpoint has no such tensor for this layer (stored unquantized but not excluded, or
    input scales on some layers only). Read once, at load time."""
    for name in names:
        t = getattr(layer, name).data
        missing = int(torch.isnan(t.float()).sum())
        if missing:
            raise FormatError(f"{prefix}.{name}: {missing} of {t.numel()} values were not "
                              "in the checkpoint (a module stored unquantized must be named "
                              "in the quantization config's exclude_modules / ignore; input "
                              "scales must exist for every quantized layer or for none)")


def keep_as_parameters(layer: torch.nn.Module, tensors: dict) -> None:
    """Replace ``layer``'s parameters of these names by ``tensors`` (a None drops the
    parameter), as parameters without gradients."""
    for name, t in tensors.items():
        if name in layer._parameters:
            del layer._parameters[name]
        if t is not None:
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
