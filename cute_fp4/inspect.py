"""Read a cubin: registers, local memory (spills), the tensor-core instructions, the K loop.

Uses ``cuobjdump`` from the ``nvidia-cuda-cuobjdump`` wheel (the ``inspect`` extra) or the
PATH. Spills are counted as local-memory stores/loads in the SASS (``STL``/``LDL``), which
is what ptxas' "spill stores" remark counts, plus any LOCAL bytes in the resource report.

:func:`find_kloop` is a pure function of SASS text (``cuobjdump -sass`` or ``nvdisasm``
output): it finds the mainloop and measures it (instructions per MMA, how many MMAs can
overlap a stage's wait, ldmatrix registers never read). The rules are stated there.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

# opcode prefixes of tensor-core MMAs: OMMA (SM120 block-scaled mma.sync), HMMA (BF16/FP16
# mma.sync, e.g. the emulated SM120 build on sm_90a), HGMMA (SM90 WGMMA), QMMA/IMMA
TENSOR_CORE_MMA = ("OMMA", "HMMA", "HGMMA", "QMMA", "IMMA")
# MMAs that read A/B from shared memory through descriptors: no register dependencies to
# follow, so "overlap with the wait" is not measured for them
_SMEM_SOURCED_MMA = ("HGMMA", "UTC")


@functools.cache
def find_tool(name: str) -> str | None:
    """Path of a CUDA binary tool: the pip wheel's copy first, then the PATH."""
    for base in sys.path:
        p = Path(base) / "nvidia" / "cu13" / "bin" / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)


@dataclasses.dataclass(frozen=True)
class CubinReport:
    registers: int
    spill_stores: int
    spill_loads: int
    local_bytes: int
    static_smem: int
    mma_instructions: tuple[str, ...]  # distinct tensor-core opcodes found
    mma_count: int  # how many tensor-core instructions in total
    kloop: KLoop | None = None  # the mainloop's measures (None: no loop holds an MMA)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads + self.local_bytes


_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]+)")


def _run(tool: str, *args: str) -> str:
    exe = find_tool(tool)
    if exe is None:
        raise FileNotFoundError(f"{tool} not found: pip install 'cute-fp4[inspect]' "
                                "(nvidia-cuda-cuobjdump) or put the CUDA toolkit on PATH")
    return subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout


def _run_on(path: str | Path, tool: str, *args: str) -> str:
    """``tool *args path``, its output kept by the file's content when the build cache is
    on (``cute_fp4.cache.tool_output``: the tests disassemble each cubin once)."""
    from cute_fp4.cache import tool_output

    return tool_output(tool, args, path, lambda: _run(tool, *args, str(path)))


def cubin_sass(cubin: str | Path) -> str:
    """``cuobjdump -sass`` of ``cubin``."""
    return _run_on(cubin, "cuobjdump", "-sass")


def inspect_cubin(cubin: str | Path, mma_prefixes: tuple[str, ...],
                  sass: str | None = None) -> CubinReport:
    """Resource usage of the heaviest kernel in ``cubin``, its tensor-core opcodes and its
    K loop (``sass``: the cubin's SASS when the caller already has it)."""
    res = _run_on(cubin, "cuobjdump", "-res-usage")
    return report_from_text(res, cubin_sass(cubin) if sass is None else sass, mma_prefixes)


def report_from_text(res: str, sass: str, mma_prefixes: tuple[str, ...]) -> CubinReport:
    """:func:`inspect_cubin` on the text of ``cuobjdump -res-usage`` and ``-sass``."""
    regs = stack = shared = local = 0
    for m in _RES.finditer(res):
        r, s, sh, lo = map(int, m.groups())
        regs, stack, shared, local = max(regs, r), max(stack, s), max(shared, sh), max(local, lo)
    ops = collections.Counter(m.group(1) for m in _OPCODE.finditer(sass))
    mma = {op: n for op, n in ops.items() if op.startswith(mma_prefixes)}
    stl = sum(n for op, n in ops.items() if op.startswith("STL"))
    ldl = sum(n for op, n in ops.items() if op.startswith("LDL"))
    return CubinReport(regs, stl, ldl, local, shared, tuple(sorted(mma)), sum(mma.values()),
                       find_kloop(sass))


# ----------------------------------------------------------------------------- SASS text

class Instr(NamedTuple):
    """One SASS instruction: address, guard predicate ("" or e.g. "@!P0"), opcode (with
    its modifiers, e.g. ``LDSM.16.M88.4``) and operands as written."""

    addr: int
    pred: str
    opcode: str
    operands: tuple[str, ...]


_FUNC = re.compile(r"^\s*(?:Function\s*:\s*(\S+)|\.text\.(\S+?):)")
_LABEL = re.compile(r"^\s*(\.L\w+):")
_LINE = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?"
                   r"([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_REGTOK = re.compile(r"\bR(\d+)((?:\.\w+)*)")


def _split_operands(text: str) -> tuple[str, ...]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return tuple(out)


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """Instructions per function, in address order. Branch targets written as labels
    (nvdisasm's ``.L_x_3``) are replaced by the label's address (hex), as cuobjdump
    writes them."""
    funcs: dict[str, list[Instr]] = {}
    labels: dict[str, int] = {}
    pending: list[str] = []
    cur = funcs.setdefault("", [])
    for line in text.splitlines():
        if (m := _FUNC.match(line)) is not None:
            cur = funcs.setdefault(m.group(1) or m.group(2), [])
            continue
        if (m := _LABEL.match(line)) is not None:
            pending.append(m.group(1))
            continue
        if (m := _LINE.match(line)) is None:
            continue
        addr = int(m.group(1), 16)
        for lab in pending:
            labels[lab] = addr
        pending.clear()
        cur.append(Instr(addr, m.group(2) or "", m.group(3), _split_operands(m.group(4))))
    if labels:
        for name, ins in funcs.items():
            funcs[name] = [i._replace(operands=tuple(_resolve_label(o, labels)
                                                     for o in i.operands)) for i in ins]
    return {k: v for k, v in funcs.items() if v}


def _resolve_label(op: str, labels: dict[str, int]) -> str:
    m = re.fullmatch(r"`?\(?(\.L\w+)\)?", op.strip())
    return hex(labels[m.group(1)]) if m and m.group(1) in labels else op


def branch_target(ins: Instr) -> int | None:
    """The target address of a branch (``BRA``), None for anything else."""
    if not ins.opcode.startswith("BRA") or not ins.operands:
        return None
    m = re.fullmatch(r"0x([0-9a-fA-F]+)", ins.operands[-1].strip())
    return int(m.group(1), 16) if m else None


# ----------------------------------------------------------------------------- registers

_NO_DEST = ("ST", "RED", "BRA", "BAR", "EXIT", "RET", "CALL", "JMP", "NOP", "WARPSYNC",
            "DEPBAR", "MEMBAR", "BSSY", "BSYNC", "ERRBAR", "CCTL", "UTMA", "UBLKCP", "LDGSTS",
            "FENCE", "YIELD", "NANOSLEEP", "SYNCS.ARRIVE", "ARRIVES", "BPT", "KILL",
            "WARPGROUP")
_MMA_SHAPES = {"16864": (16, 8, 64), "16832": (16, 8, 32), "16816": (16, 8, 16),
               "1688": (16, 8, 8), "1684": (16, 8, 4), "884": (8, 8, 4)}
_TYPE_BITS = {"E2M1": 4, "E2M3": 8, "E3M2": 8, "E4M3": 8, "E5M2": 8, "S8": 8, "U8": 8,
              "S4": 4, "U4": 4, "BF16": 16, "F16": 16, "TF32": 32, "F32": 32, "S32": 32}


def _regs(operand: str, width: int = 1) -> set[int]:
    """Register numbers an operand names: ``R8`` -> {8}, with ``width`` consecutive ones
    for a vector operand; a ``.64`` suffix (64-bit address) means two."""
    out: set[int] = set()
    for m in _REGTOK.finditer(operand):
        base, w = int(m.group(1)), width
        if ".64" in m.group(2):
            w = max(w, 2)
        out.update(range(base, base + w))
    return out


def _vector_width(opcode: str) -> int:
    """Registers a load/store moves per thread: ``.128`` 4, ``.64`` 2, LDSM ``.4``/``.2``."""
    parts = opcode.split(".")
    if opcode.startswith("LDSM") or opcode.startswith("STSM"):
        return {"4": 4, "2": 2}.get(parts[-1], 1)
    return 4 if "128" in parts else 2 if "64" in parts else 1


def mma_widths(opcode: str) -> tuple[int, int, int]:
    """Registers per thread of A, B and C/D of a warp-level MMA opcode, from its shape and
    types (``OMMA.SF.16864.F32.E2M1...``: m16n8k64, 4-bit A/B, FP32 C: 4, 2, 4)."""
    parts = opcode.split(".")
    shape = next((p for p in parts if p in _MMA_SHAPES), None)
    if shape is None:
        return 4, 2, 4
    m, n, k = _MMA_SHAPES[shape]
    types = [p for p in parts[parts.index(shape) + 1:] if p in _TYPE_BITS]
    acc = _TYPE_BITS[types[0]] if types else 16
    ab = _TYPE_BITS[types[1]] if len(types) > 1 else 16
    return (max(1, m * k * ab // 1024), max(1, n * k * ab // 1024), max(1, m * n * acc // 1024))


def is_mma(ins: Instr, prefixes: tuple[str, ...] = TENSOR_CORE_MMA) -> bool:
    return ins.opcode.startswith(prefixes)


def is_smem_load(ins: Instr) -> bool:
    """ldmatrix (LDSM) or a shared-memory load (LDS); not LDSM's store twin STSM."""
    return ins.opcode.startswith(("LDSM", "LDS"))


def is_wait(ins: Instr) -> bool:
    """An mbarrier wait (try_wait/test_wait): ``SYNCS.PHASECHK...``."""
    return ins.opcode.startswith("SYNCS.PHASECHK")


def dests(ins: Instr) -> set[int]:
    """General registers an instruction writes (its first operand, for opcodes that have a
    destination; loads and MMAs write several)."""
    if ins.opcode.startswith(_NO_DEST) or not ins.operands:
        return set()
    if is_mma(ins) and not ins.opcode.startswith(_SMEM_SOURCED_MMA):
        width = mma_widths(ins.opcode)[2]
    elif ins.opcode.startswith("LD"):
        width = _vector_width(ins.opcode)
    else:
        width = 2 if ".WIDE" in ins.opcode else 1
    return _regs(ins.operands[0], width)


def sources(ins: Instr, accumulator: bool = True) -> set[int]:
    """General registers an instruction reads. For a warp-level MMA (D, A, B, C, extras):
    A, B and C with their widths, and the extras (scale factors); ``accumulator=False``
    leaves C out."""
    ops = ins.operands if ins.opcode.startswith(_NO_DEST) else ins.operands[1:]
    if is_mma(ins) and not ins.opcode.startswith(_SMEM_SOURCED_MMA) and len(ops) >= 3:
        wa, wb, wc = mma_widths(ins.opcode)
        out = _regs(ops[0], wa) | _regs(ops[1], wb)
        if accumulator:
            out |= _regs(ops[2], wc)
        for o in ops[3:]:
            out |= _regs(o)
        return out
    out: set[int] = set()
    for i, o in enumerate(ops):
        data = ins.opcode.startswith("ST") and not o.startswith("[") and i > 0
        out |= _regs(o, _vector_width(ins.opcode) if data else 1)
    return out


# ----------------------------------------------------------------------------- K loop

@dataclasses.dataclass(frozen=True)
class KLoop:
    """Measures of a kernel's K loop (see :func:`find_kloop` for the rules)."""

    function: str
    head: int  # address of the loop's first instruction (the backward branch's target)
    tail: int  # address of the backward branch
    instructions: int  # static instructions in [head, tail], the branch included
    mma: int
    ldsm: int
    mov: int
    waits: int  # stage waits in the loop (mbarrier try_wait groups)
    mma_overlap: int | None  # fewest MMAs after a wait that use no data loaded after it
    overlap_per_wait: tuple[int, ...]
    ldsm_registers: int  # destination registers of the loop's ldmatrix instructions
    ldsm_dead_registers: int  # ... of them overwritten or never read within the loop

    @property
    def non_mma_per_mma(self) -> float:
        return (self.instructions - self.mma) / self.mma

    def as_dict(self) -> dict:
        """JSON-ready, as the compile report shows it."""
        return {"instructions": self.instructions, "mma": self.mma, "ldsm": self.ldsm,
                "mov": self.mov, "non_mma_per_mma": round(self.non_mma_per_mma, 3),
                "waits": self.waits, "mma_overlap": self.mma_overlap,
                "overlap_per_wait": list(self.overlap_per_wait),
                "ldsm_registers": self.ldsm_registers,
                "ldsm_dead_registers": self.ldsm_dead_registers}


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """Loops as (first index, last index): every backward branch and its target, unless
    an unconditional EXIT lies between them (then the branch is the return jump of
    out-of-line code, e.g. a wait's retry loop placed after the kernel's end, back into
    the middle of the loop it came from)."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    exits = [i for i, ins in enumerate(instrs)
             if ins.opcode in ("EXIT", "RET") or ins.opcode.startswith("RET.")
             if not ins.pred]
    out = []
    for i, ins in enumerate(instrs):
        t = branch_target(ins)
        if t is None or t > ins.addr or t not in index:
            continue
        if not any(index[t] <= e <= i for e in exits):
            out.append((index[t], i))
    return out


def find_kloop(sass: str, mma_prefixes: tuple[str, ...] = TENSOR_CORE_MMA) -> KLoop | None:
    """The K loop of the kernel in ``sass``, measured; None when no loop holds an MMA.

    Rules (all static, over the SASS text):

    * Loop: a backward branch and its target with no unconditional EXIT between them; its
      body is every instruction from the target to the branch, both included, in address
      order, on the path where every barrier wait succeeds at once: out-of-line retry
      code (ptxas puts a wait's retry loop after the kernel's EXIT) is outside the range,
      and an inline retry block that a ``@Px BRA`` right after the wait ``... Px``
      jumps over on success is left out (:func:`success_path`).
    * K loop: a loop whose body holds an MMA (``mma_prefixes``) and contains no smaller
      such loop (the innermost); of several (e.g. several kernels), the one with the most
      MMAs, the first by address on ties.
    * ``instructions``, ``mma``, ``ldsm`` (``LDSM*``), ``mov`` (``MOV*``): counts in the
      body; ``non_mma_per_mma`` = (instructions - mma) / mma.
    * Waits: ``SYNCS.PHASECHK*`` (mbarrier try_wait/test_wait); consecutive ones with no
      MMA and no shared-memory load between them count as one, placed at the last.
    * ``mma_overlap``: for each wait, walk the body from the wait onward, wrapping around
      the back edge, up to the next wait (or back to itself). A register is *fresh* when
      a shared-memory load (``LDSM*``/``LDS*``) issued in that walk wrote it, or when an
      instruction that read a fresh register wrote it (``MOV`` chains); a write from
      non-fresh sources makes it stale again (unless predicated). An MMA *overlaps* the
      wait when none of its A, B or extra (scale-factor) registers is fresh: it can issue
      while the stage just waited for is still being read into registers. The
      accumulator is not followed (MMA-to-MMA chaining is not a load). ``mma_overlap`` is
      the fewest over the loop's waits, ``overlap_per_wait`` each one; None when the loop
      has no wait or its MMAs read A/B from shared memory by descriptor (``HGMMA``).
    * ``ldsm_dead_registers``: destination registers of the body's ``LDSM`` that are
      overwritten, or not read, before the loop comes back to that LDSM (one turn of the
      loop; a register read only after the loop exits counts as dead).
    """
    best: KLoop | None = None
    for name, instrs in parse_sass(sass).items():
        for first, last in _innermost_mma_loops(instrs, mma_prefixes):
            k = _measure(name, instrs[first:last + 1], mma_prefixes)
            if best is None or k.mma > best.mma:
                best = k
    return best


def _innermost_mma_loops(instrs: list[Instr], prefixes: tuple[str, ...]):
    mma_at = [i for i, ins in enumerate(instrs) if is_mma(ins, prefixes)]
    with_mma = sorted({(a, b) for a, b in loops(instrs)
                       if any(a <= i <= b for i in mma_at)}, key=lambda r: r[1] - r[0])
    inner = [r for r in with_mma
             if not any(o != r and r[0] <= o[0] and o[1] <= r[1] for o in with_mma)]
    return sorted(inner)


def success_path(body: list[Instr]) -> list[Instr]:
    """``body`` without the inline retry blocks of its barrier waits: a wait
    ``SYNCS.PHASECHK... Px`` followed (before anything writes Px again) by a forward
    ``@Px BRA``, taken when the wait succeeded, jumps over the retry code; what it jumps
    over is left out (ptxas may schedule MMAs between the wait and that branch)."""
    skipped: set[int] = set()
    for i, ins in enumerate(body):
        if not is_wait(ins) or not ins.operands or ins.addr in skipped:
            continue
        p = ins.operands[0]
        for b in body[i + 1:]:
            t = branch_target(b)
            if t is not None and b.pred == f"@{p}":
                if t > b.addr:
                    skipped.update(x.addr for x in body if b.addr < x.addr < t)
                break
            if p in _pred_dests(b):
                break
    return [ins for ins in body if ins.addr not in skipped]


def _pred_dests(ins: Instr) -> set[str]:
    """Predicate registers an instruction writes (its leading predicate operands)."""
    if ins.opcode.startswith(_NO_DEST):
        return set()
    out = set()
    for o in ins.operands[:2]:
        if not re.fullmatch(r"U?P(?:T|\d+)", o):
            break
        out.add(o)
    return out


def _measure(name: str, loop: list[Instr], prefixes: tuple[str, ...]) -> KLoop:
    body = success_path(loop)
    mma = [i for i, ins in enumerate(body) if is_mma(ins, prefixes)]
    waits = _wait_points(body, prefixes)
    smem_sourced = any(body[i].opcode.startswith(_SMEM_SOURCED_MMA) for i in mma)
    per_wait = () if smem_sourced else tuple(
        _overlap(body, w, waits, prefixes) for w in waits)
    ldsm_regs, dead = _ldsm_dead(body)
    return KLoop(name, loop[0].addr, loop[-1].addr, len(body), len(mma),
                 sum(ins.opcode.startswith("LDSM") for ins in body),
                 sum(ins.opcode.startswith("MOV") for ins in body), len(waits),
                 min(per_wait) if per_wait else None, per_wait, ldsm_regs, dead)


def _wait_points(body: list[Instr], prefixes: tuple[str, ...]) -> list[int]:
    points: list[int] = []
    separated = True  # an MMA or a shared-memory load since the last wait
    for i, ins in enumerate(body):
        if is_wait(ins):
            if points and not separated:
                points[-1] = i
            else:
                points.append(i)
            separated = False
        elif is_mma(ins, prefixes) or is_smem_load(ins):
            separated = True
    return points


def _overlap(body: list[Instr], w: int, waits: list[int], prefixes: tuple[str, ...]) -> int:
    fresh: set[int] = set()
    count = 0
    n = len(body)
    for step in range(1, n):
        ins = body[(w + step) % n]
        if (w + step) % n in waits:
            break
        if is_mma(ins, prefixes):
            if not sources(ins, accumulator=False) & fresh:
                count += 1
            fresh -= dests(ins)
            continue
        out = dests(ins)
        if is_smem_load(ins) or sources(ins) & fresh:
            fresh |= out
        elif not ins.pred:
            fresh -= out
    return count


def _ldsm_dead(body: list[Instr]) -> tuple[int, int]:
    total = dead = 0
    n = len(body)
    for j, ins in enumerate(body):
        if not ins.opcode.startswith("LDSM"):
            continue
        pending = dests(ins)
        total += len(pending)
        for step in range(1, n + 1):
            other = body[(j + step) % n]
            pending -= sources(other)
            if not pending:
                break
            if not other.pred:
                killed = pending & dests(other)
                dead += len(killed)
                pending -= killed
        dead += len(pending)
    return total, dead
