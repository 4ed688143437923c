"""The block-format descriptors (``cute_fp4.formats``) on the CPU: their fields, the scale
types' codecs against values written by hand, the layout rules and byte counts, and the
typed operand format (strings accepted and equal)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cute_fp4 import formats
from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.formats import (
    E2M1,
    NVFP4,
    UE4M3,
    BlockFormat,
    Operand,
    get_format,
    sf_offset,
    sf_offset_shifts,
)
from cute_fp4.schedule import Problem


def test_nvfp4_fields():
    assert (NVFP4.name, NVFP4.block, NVFP4.global_scale) == ("nvfp4", 16, True)
    assert NVFP4.element is E2M1 and NVFP4.scale is UE4M3
    assert (NVFP4.mma_kind, NVFP4.scale_vec, NVFP4.scales_per_mma) == ("mxf4nvf4", "4X", 4)
    assert NVFP4.sass_mma == "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"
    assert NVFP4.atom_k == 64 and str(NVFP4) == "nvfp4"
    assert UE4M3.torch_dtype is torch.float8_e4m3fn and UE4M3.dsl_name == "Float8E4M3FN"
    assert (UE4M3.max, UE4M3.min_positive) == (448.0, 2.0**-9)
    assert E2M1.values() == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    assert (E2M1.bits, E2M1.per_byte, E2M1.max, E2M1.dsl_name) == (4, 2, 6.0, "Float4E2M1FN")
    with pytest.raises(dataclasses.FrozenInstanceError):
        NVFP4.block = 32
    assert hash(NVFP4) == hash(BlockFormat(**{f.name: getattr(NVFP4, f.name)
                                              for f in dataclasses.fields(NVFP4)}))


# UE4M3 codes written out by hand: (code, value); the sign bit is ignored
UE4M3_VECTORS = [(0x00, 0.0), (0x01, 2.0**-9), (0x07, 7 * 2.0**-9), (0x08, 2.0**-6),
                 (0x38, 1.0), (0x39, 1.125), (0x40, 2.0), (0x7E, 448.0), (0xB8, 1.0),
                 (0xFE, 448.0)]


@pytest.mark.parametrize("code, value", UE4M3_VECTORS)
def test_ue4m3_decode_by_hand(code, value):
    assert UE4M3.decode(code) == value
    got = UE4M3.decode_tensor(torch.tensor([code], dtype=torch.uint8))
    assert float(got) == value


def test_ue4m3_decode_every_code_and_nan():
    raw = torch.arange(256, dtype=torch.uint8)
    want = (raw & 0x7F).view(torch.float8_e4m3fn).double()
    got = torch.tensor([UE4M3.decode(c) for c in range(256)], dtype=torch.float64)
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 2
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(UE4M3.decode_tensor(raw)[ok], want[ok])
    with pytest.raises(InputError, match="0..255"):
        UE4M3.decode(256)


def test_ue4m3_encode_rounds_to_nearest_even():
    # 1.0625 lies halfway between 1.0 (mantissa 0) and 1.125 (1): even -> 1.0; 1.1875
    # halfway between 1.125 and 1.25 -> 1.25 (mantissa 2)
    vals = torch.tensor([1.0625, 1.1875, 448.0, 2.0**-10, 3 * 2.0**-10])
    codes = UE4M3.encode(vals).view(torch.uint8).tolist()
    assert codes == [0x38, 0x3A, 0x7E, 0x00, 0x02]


@pytest.mark.parametrize("rows, k, shape", [(1, 16, (128, 4)), (1, 32, (128, 4)),
                                            (130, 96, (256, 8)), (300, 1040, (384, 68))])
def test_scale_shape_and_byte_counts(rows, k, shape):
    assert NVFP4.scale_shape(rows, k) == shape
    assert NVFP4.scale_bytes(rows, k) == math.prod(shape)
    assert NVFP4.scale_row_bytes(k) == shape[1]
    assert NVFP4.data_row_bytes(k) == k // 2
    assert NVFP4.scale_cols(k) == -(-k // 16)
    # atom column groups from the packed row bytes (what the kernels compute)
    assert NVFP4.atom_cols(k // 2) == shape[1] // 4


def test_scale_offsets_by_hand():
    # row 0 col 0 -> 0; row 1 -> 16; row 32 -> 4; row 127 col 3 -> 31*16 + 3*4 + 3; the next
    # 4-column block starts 512 on; row 128 starts a new atom row (K = 128: 8 columns)
    k = 128
    assert [NVFP4.scale_offset(r, c, k) for r, c in
            [(0, 0), (1, 0), (32, 0), (127, 3), (0, 4), (128, 0), (129, 5)]] == \
        [0, 16, 4, 31 * 16 + 12 + 3, 512, 1024, 1024 + 512 + 16 + 1]


def test_shift_form_equals_the_definition():
    for r in range(0, 400, 7):
        for c in range(0, 20):
            padded = 20
            assert sf_offset_shifts(r, c, padded) == sf_offset(r, c, padded // 4)


def test_operand_is_a_typed_str():
    assert Operand.of("bf16") is Operand.BF16 and Operand.BF16 == "bf16"
    assert Operand.of("NVFP4") is Operand.NVFP4 and Operand.of(NVFP4) is Operand.NVFP4
    assert Operand.of(torch.float16) is Operand.FP16
    assert hash(Operand.NVFP4) == hash("nvfp4") and {"nvfp4": 1}[Operand.NVFP4] == 1
    assert repr(Operand.FP16) == "'fp16'" and f"{Operand.BF16}" == "bf16"
    assert Operand.NVFP4.block_format is NVFP4 and Operand.BF16.block_format is None
    assert Operand.BF16.sixteen_bit and not Operand.NVFP4.sixteen_bit
    with pytest.raises(InputError, match="did you mean 'nvfp4'"):
        Operand.of("nvfp5")
    with pytest.raises(InputError, match="unknown format 3"):
        Operand.of(3)


def test_get_format():
    assert get_format("nvfp4") is NVFP4 and get_format(NVFP4) is NVFP4
    assert get_format(Operand.NVFP4) is NVFP4 and formats.FORMATS["nvfp4"] is NVFP4
    with pytest.raises(InputError, match="did you mean 'nvfp4'"):
        get_format("nvpf4")
    with pytest.raises(InputError, match="unknown block format 'bf16'"):
        get_format(Operand.BF16)
    with pytest.raises(InputTypeError):
        get_format(16)


def test_problem_formats_are_typed_and_keep_their_repr():
    p = Problem(8, 16, 32, "bf16")
    assert p.a_format is Operand.BF16 and p.a_format == "bf16" and p.w4a16
    assert p.b_format is Operand.NVFP4 and p.fmt is NVFP4
    # the repr keys the build caches: unchanged for NVFP4 weights
    assert repr(p) == "Problem(m=8, n=16, k=32, a_format='bf16', groups=0)"
    assert p == Problem(8, 16, 32, Operand.BF16) and hash(p) == hash(Problem(8, 16, 32, "bf16"))
    with pytest.raises(InputError, match="b_format must be a block format"):
        Problem(b_format="bf16")
    with pytest.raises(InputError, match="did you mean"):
        Problem(a_format="bf61")
