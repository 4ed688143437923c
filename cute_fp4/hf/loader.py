"""``from_pretrained``: a ModelOpt NVFP4 checkpoint directory -> the transformers model, with
quantized linears as ``NVFP4Linear`` and MoE experts on the grouped kernels.

transformers does the loading (``AutoModelForCausalLM.from_pretrained``: the model built on
the meta device, the safetensors shards streamed onto the device, the model's own weight
conversions); the quantizer plugin of ``cute_fp4.hf.quantizer`` checks the checkpoint
before any tensor is read and turns the loaded tensors into cute_fp4's layers.
"""

from __future__ import annotations

import os

import torch

from cute_fp4.errors import DeviceError, InputError
from cute_fp4.hf import mxfp4
from cute_fp4.hf.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, read_quant_format
from cute_fp4.hf.quantizer import register
from cute_fp4.layers.common import mode_of

__all__ = ["from_pretrained"]


def from_pretrained(path: str | os.PathLike, *, device: str | torch.device = "cuda",
                    mode: str = "auto", layout: str = "auto", fuse_mlp: bool = True,
                    gate_up_group: int | None = None, tp_plan=None, **transformers_kwargs):
    """Load the ModelOpt NVFP4 checkpoint in directory ``path`` (config.json with a
    ``quantization_config``, or hf_quant_config.json; safetensors shards) as a transformers
    causal LM on ``device``; or a gpt-oss MXFP4 checkpoint (``quant_method: "mxfp4"``):
    its experts on the grouped kernels (``cute_fp4.hf.mxfp4``; W4A16, ``fuse_mlp`` their
    bias and clamped SwiGLU in the GEMM's epilogue), ``modules_to_not_convert`` in BF16.

    ``mode``: "w4a16", "w4a4" or "auto" (W4A4 where the GPU has FP4 MMA, SM12x, and the
    checkpoint has input scales; W4A16 elsewhere). ``layout``: the weight layout of the
    layers (``NVFP4Linear``; "auto": fragment order on SM90). ``device="cpu"`` loads for
    inspection (a forward then raises DeviceError). ``fuse_mlp``: a dense gated SiLU MLP
    whose gate and up share their global scale (and W4A4 input scale) becomes one
    ``cute_fp4.mlp.NVFP4GatedMLP`` (SiLU-and-mul in the gate_up GEMM); on the CPU only with
    ``gate_up_group`` (8 or 32: the target GPU's gate/up group). ``model.cute_fp4_mlps``:
    (fused names, (name, reason) of those left as three layers). Other keyword arguments go to
    ``AutoModelForCausalLM.from_pretrained`` (``dtype`` defaults to bfloat16, the dtype of
    the layers left unquantized). ``tp_plan``: tensor parallelism, one process per device
    under torchrun ("auto": the model's own plan, or a dict): each rank loads and prepares
    its shard of every NVFP4 layer the plan shards (``cute_fp4.hf.tp``; MLPs stay unfused),
    on ``torch.distributed``'s device for the rank (``device="cpu"`` with gloo).

    Quantized tensors are never converted to BF16: device memory peaks at the NVFP4 bytes
    plus the BF16 of the excluded modules plus one layer's transient. A checkpoint that
    does not hold what its config promises raises ``CheckpointError`` (file, key,
    expectation) before anything is loaded.
    """
    mode = mode_of(mode)
    if gate_up_group not in (None, 8, 32):
        raise InputError(f"gate_up_group must be None, 8 or 32, got {gate_up_group!r}")
    path = os.fspath(path)
    mxfp4_config = mxfp4.read_config(path) if os.path.isdir(path) else None
    fmt = None if mxfp4_config is not None else read_quant_format(path)
    _one_checkpoint(path)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device={str(device)!r} but CUDA is not available; "
                          "device='cpu' loads the checkpoint for inspection")
    if mxfp4_config is not None:
        if mode == "w4a4":
            raise InputError("gpt-oss MXFP4 checkpoints run W4A16 (bfloat16 activations): "
                             "mode must be 'auto' or 'w4a16'")
        return mxfp4.from_pretrained(path, mxfp4_config, dev, layout,
                                     "auto" if fuse_mlp else False, **transformers_kwargs)
    method = register()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = transformers_kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    qc = fmt.to_dict()
    qc.pop("producer", None)
    config.quantization_config = {**qc, "quant_method": method, "source": fmt.source,
                                  "cute_fp4": {"mode": mode, "layout": layout,
                                               "fuse_mlp": fuse_mlp,
                                               "gate_up_group": gate_up_group}}
    transformers_kwargs.setdefault("dtype", torch.bfloat16)
    if tp_plan is not None:
        from transformers.distributed import DistributedConfig

        transformers_kwargs["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    if "distributed_config" not in transformers_kwargs:  # else the rank's device
        transformers_kwargs.setdefault("device_map", {"": dev})
    transformers_kwargs.setdefault("experts_implementation", "cute_fp4")
    return AutoModelForCausalLM.from_pretrained(path, config=config, **transformers_kwargs)


def _one_checkpoint(path: str) -> None:
    """Refuse a directory holding both an index (with its shards) and a single-file
    checkpoint: which one is meant is unknown (transformers and the header checks would
    each pick one), so nothing is loaded."""
    both = [n for n in (INDEX_FILE, SINGLE_FILE) if os.path.exists(os.path.join(path, n))]
    if len(both) == 2:
        raise CheckpointError(SINGLE_FILE, "(file)", f"one checkpoint: {INDEX_FILE} with "
                              f"its shards, or {SINGLE_FILE}", f"both {INDEX_FILE} and "
                              f"{SINGLE_FILE} in {path}",
                              "remove the files of the one that is not the checkpoint")
