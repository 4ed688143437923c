"""A small interpreter of the straight-line conversion PTX the kernels inline (sm90_convert,
mma_emulation, sm90_rs_wide), so CPU tests can run the very strings the GPU runs on every
input code and scale. Registers are Python ints (32-bit words, 16-bit halves) or floats
(``.f32``); FP16/BF16 arithmetic rounds to nearest even exactly like the hardware for the
operations modelled, and any other instruction fails loudly."""

from __future__ import annotations

import re
import struct

M32 = 0xFFFFFFFF


def f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def to_f16(x: float) -> int:
    return struct.unpack("<H", struct.pack("<e", x))[0]  # round to nearest even


def to_bf16(x: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", x))[0]  # x is exact in FP32 here
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def f16x2_mul(a: int, b: int) -> int:
    lo = to_f16(f16(a) * f16(b))  # the product of two FP16 is exact in a double
    hi = to_f16(f16(a >> 16) * f16(b >> 16))
    return lo | hi << 16


def bf16x2_mul(a: int, b: int) -> int:
    lo = to_bf16(bf16(a) * bf16(b))  # exact products here; to_bf16 rounds a double's
    hi = to_bf16(bf16(a >> 16) * bf16(b >> 16))
    return lo | hi << 16


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """``lop3.b32``: bit ``i`` of the result is bit ``(a_i << 2 | b_i << 1 | c_i)`` of ``lut``
    read with ``a`` = 0xF0, ``b`` = 0xCC, ``c`` = 0xAA."""
    out = 0
    for i in range(32):
        idx = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def e4m3(code: int) -> float:
    """An E4M3 (fn) byte's value (NaN for 0x7F / 0xFF)."""
    from cute_fp4.nvfp4 import e4m3_decode

    return e4m3_decode(code)


def to_f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even), subnormals kept."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32(operand: str, regs: dict) -> float:
    """A ``.f32`` operand: a float register, a 32-bit register read as float32 bits, or a
    ``0fXXXXXXXX`` immediate."""
    operand = operand.strip()
    v = regs.get(operand)
    if isinstance(v, float):
        return v
    bits = v if v is not None else int(operand[2:], 16)
    return struct.unpack("<f", struct.pack("<I", bits & M32))[0]


def run_ptx(ptx: str, reads: list[int], n_writes: int) -> list[int]:
    """Run ``ptx`` with ``{$r0}..`` = ``reads``; returns ``{$w0}..{$w<n_writes - 1>}``."""
    regs: dict[str, object] = {f"{{$r{i}}}": v & M32 for i, v in enumerate(reads)}

    def val(x: str):
        x = x.strip()
        return regs[x] if x in regs else int(x, 0) & M32

    for raw in ptx.splitlines():
        line = raw.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*\})", rest)]
        d = args[0]
        if op == "mov.b32" and d.startswith("{") and not d.startswith("{$"):
            h0, h1 = (x.strip() for x in d.strip("{}").split(","))
            w = val(args[1])
            regs[h0], regs[h1] = w & 0xFFFF, w >> 16
        elif op == "mov.b32" and args[1].startswith("{") and not args[1].startswith("{$"):
            h0, h1 = (x.strip() for x in args[1].strip("{}").split(","))
            regs[d] = (regs[h0] & 0xFFFF) | (regs[h1] & 0xFFFF) << 16
        elif op == "mov.b32":
            regs[d] = val(args[1])
        elif op == "shl.b32":
            regs[d] = (val(args[1]) << val(args[2])) & M32
        elif op in ("shr.b32", "shr.u32"):
            regs[d] = val(args[1]) >> val(args[2])
        elif op == "and.b32":
            regs[d] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            regs[d] = val(args[1]) | val(args[2])
        elif op == "prmt.b32":
            regs[d] = prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "add.u32":
            regs[d] = (val(args[1]) + val(args[2])) & M32
        elif op == "mul.lo.u32":
            regs[d] = (val(args[1]) * val(args[2])) & M32
        elif op == "mul.rn.f16x2":
            regs[d] = f16x2_mul(val(args[1]), val(args[2]))
        elif op == "mul.rn.bf16x2":
            regs[d] = bf16x2_mul(val(args[1]), val(args[2]))
        elif op == "lop3.b32":
            regs[d] = lop3(val(args[1]), val(args[2]), val(args[3]), val(args[4]))
        elif op == "cvt.u16.u32":
            regs[d] = val(args[1]) & 0xFFFF
        elif op == "cvt.rn.f16x2.e4m3x2":  # byte i -> half i, exact
            w = val(args[1])
            regs[d] = to_f16(e4m3(w & 0xFF)) | to_f16(e4m3(w >> 8 & 0xFF)) << 16
        elif op == "mul.rn.f32":
            regs[d] = to_f32(f32(args[1], regs) * f32(args[2], regs))
        elif op == "cvt.f32.f16":
            regs[d] = f16(val(args[1]))
        elif op == "cvt.rn.bf16x2.f32":
            regs[d] = to_bf16(regs[args[1]]) << 16 | to_bf16(regs[args[2]])
        else:
            raise AssertionError(f"instruction not modelled: {raw.strip()}")
    return [regs[f"{{$w{i}}}"] for i in range(n_writes)]
