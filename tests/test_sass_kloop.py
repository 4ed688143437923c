"""The K-loop analysis of SASS text (``cute_fp4.inspect.find_kloop``) on synthetic snippets
in cuobjdump's and nvdisasm's formats: a loop, nested loops, out-of-line wait retries, no
loop, overlap with the stage wait through MOV chains, dead ldmatrix registers; and once on
a real sm_120a cubin (marked ``compile``)."""

from __future__ import annotations

import json

import pytest

from cute_fp4.inspect import find_kloop, mma_widths, parse_sass

OMMA = "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"


def sass(*blocks: list[str], names=("kernel",)) -> str:
    """cuobjdump-style text: one function per block, 16-byte addresses from 0. A line
    ``"BRA @N"`` branches to the instruction N of its block (N counted from 0)."""
    out = ["\tcode for sm_120a"]
    for name, lines in zip(names, blocks):
        out.append(f"\t\tFunction : {name}")
        for i, text in enumerate(lines):
            if "@" in text and "BRA" in text and text.split()[-1].startswith("@"):
                head, _, tgt = text.rpartition(" ")
                text = f"{head} {hex(int(tgt[1:]) * 16)}"
            out.append(f"        /*{i * 16:04x}*/                   {text} ;"
                       f"   /* 0x000000000000000000 */")
            out.append(" " * 51 + "/* 0x000fe20000000f00 */")
    return "\n".join(out) + "\n"


WAIT = "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R12"


def test_simple_loop_wait_at_the_top_overlaps_nothing():
    body = [
        "MOV R1, c[0x0][0x28]",                # 0 prologue
        WAIT,                                  # 1 loop head
        "@!P0 BRA @20",                        # 2 to the out-of-line retry
        "LDSM.16.M88.4 R8, [R2]",              # 3 A (4 registers)
        "LDSM.16.M88.4 R12, [R2+0x800]",       # 4 B: two MMAs read 2 each
        f"{OMMA} R20, R8, R12, R20, R30, R31, URZ",
        f"{OMMA} R24, R8, R14, R24, R30, R31, URZ",
        "IADD3 R2, R2, 0x1000, RZ",
        "BRA.U UP0, @1",                       # 8 back edge
        "EXIT",
    ]
    k = find_kloop(sass(body))
    assert (k.head, k.tail) == (0x10, 0x80)
    assert (k.instructions, k.mma, k.ldsm, k.mov, k.waits) == (8, 2, 2, 0, 1)
    assert k.non_mma_per_mma == 3.0
    assert k.mma_overlap == 0 and k.overlap_per_wait == (0,)
    assert (k.ldsm_registers, k.ldsm_dead_registers) == (8, 0)


def pipelined(prefetch_with_mov: bool) -> list[str]:
    """A peer-style loop: the last K block's fragments (R40.., R44..) were loaded before the
    wait; after it, the next stage's first block is loaded while the old one is consumed."""
    a = "R60" if prefetch_with_mov else "R8"
    return [
        "LDSM.16.M88.4 R40, [R2+0x400]",       # 0 head: K block 1 of this stage
        "LDSM.16.M88.4 R44, [R2+0xc00]",
        f"{OMMA} R20, R8, R12, R20, R30, R31, URZ",    # K block 0 (loaded last iteration)
        f"{OMMA} R24, R8, R14, R24, R30, R31, URZ",
        WAIT,                                  # 4 next stage
        "LDSM.16.M88.4 R8, [R5]",              # next stage, K block 0
        "LDSM.16.M88.4 R12, [R5+0x800]",
        "LDS R30, [R6]",                       # next stage's scale factors
        "MOV R60, R8",
        f"{OMMA} R20, R40, R44, R20, R32, R33, URZ",   # 9 old data: overlaps
        f"{OMMA} R24, R40, R46, R24, R32, R33, URZ",   # old data: overlaps
        f"{OMMA} R48, {a}, R46, R48, R32, R33, URZ",   # new A (directly or via the MOV)
        f"{OMMA} R52, R40, R46, R52, R30, R33, URZ",   # new scale factor (LDS)
        "BRA.U UP0, @0",
    ]


@pytest.mark.parametrize("via_mov", [False, True])
def test_overlap_counts_mmas_on_data_loaded_before_the_wait(via_mov):
    k = find_kloop(sass(pipelined(via_mov)))
    assert (k.instructions, k.mma, k.ldsm, k.waits) == (14, 6, 4, 1)
    # after the wait: two MMAs on R40/R44 (old), one on the fresh A (or its MOV copy),
    # one on the fresh scale factor; then the wrap-around to K block 0 (fresh R8)
    assert k.mma_overlap == 2


def test_accumulator_chain_is_not_a_dependency_on_the_load():
    body = [WAIT, "LDSM.16.M88.4 R8, [R5]",
            f"{OMMA} R20, R8, R12, R20, R30, R31, URZ",     # fresh
            f"{OMMA} R20, R40, R44, R20, R32, R33, URZ",    # reads the fresh MMA's D as C
            "BRA.U UP0, @0"]
    assert find_kloop(sass(body)).mma_overlap == 1


def test_a_predicated_write_keeps_a_register_fresh():
    body = [WAIT, "LDSM.16.M88 R12, [R5]",    # one register: R12 (B reads R12, R13)
            "@P1 MOV R12, R50",                 # may not happen: R12 stays fresh
            f"{OMMA} R20, R8, R12, R20, R30, R31, URZ",
            "MOV R12, R50",                     # overwritten from old data: stale again
            f"{OMMA} R24, R8, R12, R24, R30, R31, URZ",
            "BRA.U UP0, @0"]
    k = find_kloop(sass(body))
    assert k.mma_overlap == 1
    assert k.ldsm_dead_registers == 0  # a predicated write does not kill R12; the MMA reads it


def test_nested_loops_pick_the_innermost_with_mmas():
    body = [
        "S2R R0, SR_TID.X",                     # 0
        "IMAD R4, R0, 0x10, RZ",                # 1 outer (tile) loop head
        "LDSM.16.M88.4 R8, [R2]",               # 2 K loop head
        WAIT,                                   # 3 inline retry loop 3..5 (no MMA)
        "@!P0 NANOSLEEP.SYNCS 0x989680",
        "@!P0 BRA @3",
        f"{OMMA} R20, R8, R12, R20, R30, R31, URZ",
        f"{OMMA} R24, R8, R14, R24, R30, R31, URZ",
        f"{OMMA} R28, R8, R12, R28, R30, R31, URZ",
        "@P1 BRA @2",                           # 9 K loop back edge
        "STG.E.128 [R6], R20",                  # epilogue
        "@P2 BRA @1",                           # 11 tile loop back edge
        "EXIT",
    ]
    k = find_kloop(sass(body))
    assert (k.head, k.tail) == (0x20, 0x90)
    assert (k.instructions, k.mma, k.waits) == (8, 3, 1)
    assert k.ldsm_registers == 4 and k.ldsm_dead_registers == 0


def test_no_loop_or_no_mma_in_any_loop_gives_none():
    straight = [WAIT, "LDSM.16.M88.4 R8, [R2]", f"{OMMA} R20, R8, R12, R20, R30, R31, URZ",
                "EXIT"]
    assert find_kloop(sass(straight)) is None
    no_mma = ["IADD3 R1, R1, 0x1, RZ", "ISETP.NE.AND P0, PT, R1, 0x8, PT", "@P0 BRA @0",
              f"{OMMA} R20, R8, R12, R20, R30, R31, URZ", "EXIT"]
    assert find_kloop(sass(no_mma)) is None
    assert find_kloop("") is None


def test_the_function_with_the_most_mmas_wins():
    small = [f"{OMMA} R20, R8, R12, R20, R30, R31, URZ", "BRA @0"]
    big = ["LDSM.16.M88.4 R8, [R2]", *[f"{OMMA} R{20 + 4 * i}, R8, R12, R20, R30, R31, URZ"
                                       for i in range(3)], "BRA @0"]
    k = find_kloop(sass(small, big, names=("small", "big")))
    assert k.function == "big" and k.mma == 3
    assert k.waits == 0 and k.mma_overlap is None  # no wait in the loop: not measured


def test_dead_ldmatrix_registers():
    body = [
        WAIT,
        "LDSM.16.M88.4 R8, [R2]",      # B matrices 0..3, but only R8..R9 read: 2 dead
        "LDSM.16.M88.4 R16, [R2+0x800]",  # R16..R19 read as A: none dead
        "LDSM.16.M88.2 R24, [R2+0x1000]",  # R24 read, R25 overwritten before any read
        f"{OMMA} R40, R16, R8, R40, R30, R31, URZ",
        "MOV R60, R24",
        "MOV R25, RZ",
        "MOV R61, R25",
        "BRA @0",
    ]
    k = find_kloop(sass(body))
    assert k.ldsm_registers == 10 and k.ldsm_dead_registers == 3


def test_read_after_the_back_edge_is_a_use():
    body = [f"{OMMA} R40, R16, R8, R40, R30, R31, URZ",   # reads last iteration's R8..R9
            WAIT, "LDSM.16.M88.2 R8, [R2]", "BRA @0"]
    assert find_kloop(sass(body)).ldsm_dead_registers == 0


def test_hgmma_loops_are_found_but_overlap_is_not_measured():
    body = [WAIT, "WARPGROUP.ARRIVE",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "BRA @0"]
    k = find_kloop(sass(body))
    assert (k.mma, k.waits, k.mma_overlap, k.overlap_per_wait) == (2, 1, None, ())


def test_emulated_build_hmma_is_a_tensor_core_mma():
    hmma = "HMMA.16816.F32.BF16"
    body = [WAIT, "LDSM.16.M88.4 R8, [R2]", "LDSM.16.M88.2 R12, [R2+0x800]",
            *[f"{hmma} R{20 + 4 * i}, R8, R12, R{20 + 4 * i}" for i in range(4)], "BRA @0"]
    k = find_kloop(sass(body))
    assert (k.mma, k.ldsm, k.ldsm_dead_registers, k.mma_overlap) == (4, 2, 0, 0)


def test_inline_retry_block_is_off_the_success_path():
    """NVIDIA's pattern: the wait, MMAs on old data scheduled before the branch that skips
    the inline retry on success, the retry block (its own small loop), then the rest."""
    body = [
        "LDSM.16.M88.4 R40, [R2]",                       # 0 loop head
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ], R9",  # 1
        f"{OMMA} R20, R40, R44, R20, R32, R33, URZ",     # 2 old data
        "ISETP.NE.AND P1, PT, R4, 0x3, PT",              # writes P1, not P0
        "@P0 BRA @10",                                   # 4 success: skip 5..9
        "SHF.L.U32 R9, R9, 0x1f, RZ",                    # 5 retry block
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ], R9",
        "@!P0 NANOSLEEP.SYNCS 0x989680",
        "@!P0 SYNCS.PHASECHK.TRANS64 P0, [R8+URZ], R9",
        "@!P0 BRA @6",                                   # 9
        "LDSM.16.M88.4 R8, [R5]",                        # 10 the next stage
        f"{OMMA} R24, R8, R44, R24, R32, R33, URZ",
        "BRA.U UP0, @0",                                 # 12
    ]
    k = find_kloop(sass(body))
    assert (k.head, k.tail) == (0x0, 0xc0)
    assert (k.instructions, k.mma, k.waits, k.mma_overlap) == (8, 2, 1, 1)
    body[3] = "ISETP.NE.AND P0, PT, R4, 0x3, PT"  # P0 rewritten: the branch is not the wait's
    k = find_kloop(sass(body))
    assert k.instructions == 13 and k.waits == 2


def test_consecutive_waits_count_as_one():
    body = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R12",
            "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R3+URZ+0x40], R12",   # scale-factor barrier
            "LDSM.16.M88.4 R8, [R2]", f"{OMMA} R20, R8, R12, R20, R30, R31, URZ",
            "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ+0x8], R12",    # a second stage
            f"{OMMA} R24, R8, R12, R24, R30, R31, URZ",                # loaded before it
            "BRA @0"]
    k = find_kloop(sass(body))
    assert k.waits == 2 and k.overlap_per_wait == (0, 1) and k.mma_overlap == 0


def test_nvdisasm_labels_give_the_same_loop():
    text = """\
        .text.kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R3+URZ], R12 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_4:
        /*0030*/                   LDSM.16.M88.4 R8, [R2] ;
        /*0040*/    OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X R20, R8, R12, R20, R30, R31, URZ ;
        /*0050*/                   BRA.U UP0, `(.L_x_3) ;
        /*0060*/                   EXIT ;
.L_x_9:
        /*0070*/                   SYNCS.PHASECHK.TRANS64 P0, [R3+URZ], R12 ;
        /*0080*/              @!P0 BRA `(.L_x_9) ;
        /*0090*/                   BRA `(.L_x_4) ;
"""
    assert list(parse_sass(text)) == ["kernel"]
    k = find_kloop(text)
    assert (k.head, k.tail, k.instructions, k.mma, k.ldsm, k.waits) == (0x10, 0x50, 5, 1, 1, 1)


@pytest.mark.parametrize("opcode, widths", [
    (OMMA, (4, 2, 4)),
    ("HMMA.16816.F32.BF16", (4, 2, 4)),
    ("HMMA.16816.F16", (4, 2, 2)),
    ("HMMA.1688.F32", (2, 1, 4)),
    ("QMMA.16832.F32.E4M3.E4M3", (4, 2, 4)),
])
def test_mma_register_widths(opcode, widths):
    assert mma_widths(opcode) == widths


@pytest.mark.compile
def test_real_cubin_kloop_in_the_compile_report(tmp_path, capsys):
    """sm120_default on sm_120a: the K loop holds the tile's OMMAs for one stage (per warp:
    128 x 128 x 128 / (16 x 8 x 64) / 8 MMA warps = 32), and the CLI shows the measures and
    keeps cubin, PTX and SASS."""
    from cute_fp4 import catalogue
    from cute_fp4.cli import main

    assert main(["compile", "sm120_default", "--target", "sm_120a", "--json",
                 "--dump-dir", str(tmp_path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    s = catalogue.get("sm120_default")
    mma_warps = 8
    per_warp = s.tile.m * s.tile.n * s.tile.k // (16 * 8 * 64) // mma_warps
    k = row["kloop"]
    assert k["mma"] == per_warp == 32
    assert k["instructions"] > k["mma"] and k["ldsm"] > 0 and k["waits"] >= 1
    assert k["non_mma_per_mma"] == pytest.approx((k["instructions"] - 32) / 32, abs=1e-3)
    assert isinstance(k["mma_overlap"], int) and 0 <= k["mma_overlap"] <= 32
    assert 0 <= k["ldsm_dead_registers"] <= k["ldsm_registers"]
    kept = {ext: tmp_path / f"sm120_default.sm_120a.{ext}" for ext in ("cubin", "sass", "ptx")}
    for path in kept.values():
        assert path.stat().st_size > 0, path
    assert find_kloop(kept["sass"].read_text()).as_dict() == k  # the kept SASS was measured
    assert row["dumped"] == [str(p) for p in kept.values()]
