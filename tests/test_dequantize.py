"""The NVFP4 -> BF16 dequantization kernel (``cute_fp4.kernels.dequantize``) without a GPU:
its PTX, run by the interpreter of ``tests/ptx_model.py``, gives ``block_values`` bit for
bit for every code in every element position and every finite scale; it compiles for every
target without spills, one 8-byte load of codes and two 16-byte stores per block; its scale
offsets are the blocked layout's; bad input raises typed errors. On a GPU:
tests/gpu/test_dequantize.py."""

from __future__ import annotations

import random
import re

import cutlass.cute as cute
import pytest
import torch
from ptx_model import run_ptx, to_bf16

from cute_fp4 import quant
from cute_fp4.errors import DeviceError, InputTypeError
from cute_fp4.formats import sf_offset, sf_offset_shifts
from cute_fp4.kernels.dequantize import DequantizeKernel, DequantSpec, block_ptx
from cute_fp4.nvfp4 import E2M1_VALUES, e4m3_decode, quantize

PTX = block_ptx()


def _expected(words: tuple[int, int], sf: int) -> list[int]:
    """BF16 bits of the 16 block values (element 2j in the low half of word j)."""
    s = e4m3_decode(sf)
    vals = []
    for i in range(16):
        code = (words[i // 8] >> (4 * (i % 8))) & 0xF
        v = E2M1_VALUES[code & 7] * s
        vals.append(to_bf16(-v if code & 8 else v))
    return [vals[2 * j] | vals[2 * j + 1] << 16 for j in range(8)]


@pytest.mark.parametrize("sf", range(0x7F))  # every finite UE4M3 scale, subnormals included
def test_block_ptx_is_exact_for_every_code_position_and_scale(sf):
    rng = random.Random(sf)
    cases = [(0x11111111 * c, 0x11111111 * ((c + 7) % 16)) for c in range(16)]
    cases += [(rng.getrandbits(32), rng.getrandbits(32)) for _ in range(8)]
    for words in cases:
        assert run_ptx(PTX, [*words, sf], 8) == _expected(words, sf), (hex(words[0]), sf)


def test_block_ptx_catches_a_wrong_value():
    """The check above can fail: a scale off by one code, or a swapped pair, is caught."""
    words = (0x76543210, 0xFEDCBA98)
    got = run_ptx(PTX, [*words, 0x38], 8)
    assert got != _expected(words, 0x39)
    assert got != _expected((words[1], words[0]), 0x38)


def test_kernel_scale_offsets_are_the_blocked_layout():
    for kbp in (4, 8, 260):
        for r in (0, 1, 31, 32, 127, 128, 300, 4097):
            for c in range(kbp):
                assert sf_offset_shifts(r, c, kbp) == sf_offset(r, c, kbp // 4)


@pytest.mark.compile
@pytest.mark.parametrize("target", ["sm_90a", "sm_120a", "sm_121a"])
def test_kernel_compiles_without_spills(target, tmp_path):
    from cute_fp4.inspect import cubin_sass, inspect_cubin

    k = DequantizeKernel(DequantSpec(target))
    cute.compile(k, *k.fake_args(),
                 options=f"--gpu-arch {target} --keep-cubin --dump-dir {tmp_path}")
    cubin = sorted(tmp_path.glob("*.cubin"))[-1]
    rep = inspect_cubin(cubin, ())
    sass = cubin_sass(cubin)
    assert rep.spills == 0 and rep.registers <= 64, rep
    assert len(re.findall(r"STG\.E\.128", sass)) == 2, "two 16-byte stores per block"
    assert len(re.findall(r"LDG\.E\.64", sass)) == 1, "one 8-byte load of codes per block"
    assert "F2FP" in sass  # the packing conversion (and the scale's on SM90)


def test_bad_input_raises_typed_errors():
    with pytest.raises(InputTypeError, match="takes an NVFP4Tensor"):
        quant.dequantize_activation(torch.zeros(4, 32))
    a = quantize(torch.randn(4, 32))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="runs on a CUDA device"):
            quant.dequantize_activation(a)


def test_raw_args_are_the_runtime_args_as_ints():
    k = DequantizeKernel(DequantSpec())
    q, sf = torch.zeros(3, 32, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8)
    out = torch.zeros(3, 64, dtype=torch.bfloat16)
    gs = [torch.ones(()) for _ in range(3)]
    for scales, flag in ((None, 0), (gs, 1)):
        real = k.runtime_args(q, sf, out, scales, 0x5000)
        raw = k.raw_args(q, sf, out, scales, 0x5000)
        fake = k.fake_args()
        assert len(real) == len(raw) == len(fake) == 10
        for f, r in zip(fake[:6], real[:6]):
            assert (f.dtype, f._assumed_align) == (r.dtype, r._assumed_align)
        assert [r._pointer for r in real[:6]] == list(raw[:6])
        if scales:
            assert list(raw[3:6]) == [t.data_ptr() for t in gs]
        assert [int(v) for v in real[6:9]] == list(raw[6:9]) == [3, 64, flag]
        assert raw[9] == 0x5000


def test_w4a16_operands_takes_alpha_from_the_launch_unless_one_is_given(monkeypatch):
    """The W4A4-through-W4A16 operands that gemm and NVFP4Linear share: without an alpha
    the dequantize launch writes the scales' product; a given alpha is kept as it is."""
    calls = []
    monkeypatch.setattr(quant, "dequantize_activation",
                        lambda a: calls.append("values") or "a16")
    monkeypatch.setattr(quant, "dequantize_with_alpha",
                        lambda a, other: calls.append(("with_alpha", other)) or ("a16", "prod"))
    a, ws, given = object(), torch.ones(()), torch.full((), 0.5)
    assert quant.w4a16_operands(a, ws) == ("a16", "prod")
    assert quant.w4a16_operands(a, ws, given) == ("a16", given)
    assert calls == [("with_alpha", ws), "values"]
