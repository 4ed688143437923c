"""NVFP4 checkpoints in Hugging Face transformers (``pip install cute-fp4[hf]``).

* :func:`from_pretrained`: a ModelOpt NVFP4 checkpoint directory -> the transformers model,
  quantized linears as ``NVFP4Linear``, MoE experts on the grouped kernels, no BF16 copy of
  a quantized weight;
* :func:`quantize_model`: a BF16 transformers model quantized in place, layer by layer
  (optionally calibrating input scales);
* :func:`save_pretrained`: such a model written as a ModelOpt NVFP4 checkpoint (bit-exact
  round trip with ``from_pretrained``);
* :func:`fake_quantize`: the fake-quantized BF16 reference of an NVFP4 model.

Importing this package imports neither transformers nor anything that registers with it:
the functions do, on their first call (``cute_fp4.hf.quantizer.register``).
See ``docs/hf.md``.
"""

from __future__ import annotations

import importlib

__all__ = ["CheckpointError", "QuantizeReport", "fake_quantize", "from_pretrained",
           "quantize_model", "save_pretrained"]

_EXPORTS = {"from_pretrained": "loader", "save_pretrained": "save",
            "quantize_model": "quantize", "QuantizeReport": "quantize",
            "fake_quantize": "quantize",
            "CheckpointError": "checkpoint"}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"cute_fp4.hf.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cute_fp4.hf' has no attribute {name!r}")
