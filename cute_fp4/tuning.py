"""What ``schedule="auto"`` picks: the tuning store (which schedule won for a GPU, an A
format and a shape bucket), else the heuristic (:func:`heuristic`: a catalogue schedule by
family and shape, split-K and the decode tiles derived from the shape and the SM count).
Both are pure choices; :func:`pick` makes them for a schedule name, and the launch path
(``cute_fp4.run.resolve_schedule``) asks it.

``cute_fp4.tune.tune`` writes the store, ``schedule="auto"`` reads it (before the
heuristic).

* File: ``$CUTE_FP4_TUNING`` or ``~/.cache/cute_fp4/tuning.json``; JSON, written
  atomically (temporary file + rename); a missing or corrupt file reads as empty.
* Key: ``"<GPU name>|<A format>|<M bucket>x<N>x<K>"``. M is bucketed by powers of two: a
  tuning at M serves every M' in the bucket ``(B/2, B]`` with ``B`` the smallest power of
  two >= M. A tuned M = 16 serves M = 9..16, M = 1 serves only 1, M = 1000 (bucket 1024)
  serves 513..1024. N and K match exactly.
* Entry: the schedule's catalogue name, its ``schedule.key()`` (every code-generating
  field, with the output dtype set to BF16 as it was tuned) and the package source
  fingerprint (``cute_fp4.cache.source_fingerprint``, the one the compile cache uses).
  An entry whose fingerprint differs from the running package's (the sources, the DSL or
  Python changed since the tuning) or whose catalogue schedule no longer has that key is
  stale: it is ignored (the heuristic decides) and that is said once per process.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from cute_fp4.errors import InputError, InputTypeError
from cute_fp4.formats import Operand
from cute_fp4.schedule import Mainloop, OutDtype, Problem, Schedule


class TuningWarning(UserWarning):
    """The tuning store has stale entries that are being ignored (said once)."""


_SAID: set[str] = set()
_STORE: dict = {}  # path -> (mtime_ns, parsed store): gemm("auto") must not parse per call
_FOUND: dict = {}  # path -> (mtime_ns, {(key, fingerprint): Schedule | None}): answers


def _say_once(kind: str, message: str) -> None:
    if kind not in _SAID:
        _SAID.add(kind)
        warnings.warn(f"cute_fp4 tuning: {message}", TuningWarning, stacklevel=3)


def store_path() -> Path:
    env = os.environ.get("CUTE_FP4_TUNING")
    return Path(env) if env else Path.home() / ".cache" / "cute_fp4" / "tuning.json"


def m_bucket(m: int) -> int:
    """The power-of-two bucket of M: the smallest power of two >= M (9..16 -> 16)."""
    if m < 1:
        raise ValueError(f"M must be >= 1, got {m}")
    return 1 << (m - 1).bit_length()


def bucket_range(m: int) -> tuple[int, int]:
    """The M values a tuning at ``m`` serves: ``(B/2 + 1, B)`` with B = m_bucket(m)."""
    b = m_bucket(m)
    return b // 2 + 1, b


def store_key(device_name: str, m: int, n: int, k: int, a_format: str) -> str:
    return f"{device_name}|{a_format}|{m_bucket(m)}x{n}x{k}"


def schedule_key(s: Schedule) -> str:
    """``s.key()`` with the output dtype at BF16 (tuning times BF16 outputs; ``gemm``
    changes the output dtype of what it finds to the one asked for)."""
    return (s if s.epilogue.out_dtype is OutDtype.BF16 else s.replace(out_dtype="bf16")).key()


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def load_store() -> dict:
    """The tuning store, parsed again only when the file changed (it is read on every
    ``schedule="auto"`` call). Returns a copy; a missing or corrupt file reads as empty."""
    path = store_path()
    mtime = _mtime(path)
    if mtime is None:
        return {}
    hit = _STORE.get(path)
    if hit is None or hit[0] != mtime:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        hit = _STORE[path] = (mtime, data if isinstance(data, dict) else {})
    return dict(hit[1])


def save_entry(device_name: str, m: int, n: int, k: int, a_format: str, schedule: Schedule,
               **extra) -> str:
    """Store ``schedule`` as the winner for the bucket of ``m``; returns the store key.
    ``extra`` (e.g. the tuned M and its time) is kept in the entry for people to read."""
    from cute_fp4.cache import source_fingerprint

    if not schedule.name:
        raise ValueError("only named (catalogue) schedules can be stored")
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_store()
    key = store_key(device_name, m, n, k, a_format)
    data[key] = {"schedule": schedule.name, "key": schedule_key(schedule),
                 "fingerprint": source_fingerprint(), **extra}
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic
    return key


def lookup(device, m: int, n: int, k: int, a_format: str) -> Schedule | None:
    """The tuned schedule for this device (its ``name``) and the bucket of ``m``, if one
    was stored by this package version and its catalogue schedule is unchanged."""
    from cute_fp4.cache import source_fingerprint

    path, key = store_path(), store_key(device.name, m, n, k, a_format)
    mtime = _mtime(path)
    seen = _FOUND.get(path)
    if seen is None or seen[0] != mtime:  # the file changed: forget the old answers
        seen = _FOUND[path] = (mtime, {})
    memo = (key, source_fingerprint())
    if memo not in seen[1]:
        seen[1][memo] = _find(load_store().get(key), key)
    return seen[1][memo]


def _find(entry, key: str) -> Schedule | None:
    from cute_fp4 import catalogue
    from cute_fp4.cache import source_fingerprint

    if not isinstance(entry, dict) or "schedule" not in entry:
        return None  # absent, or written by an older version (a bare name)
    if entry.get("fingerprint") != source_fingerprint():
        _say_once("stale", f"ignoring entries of {store_path()} tuned with other package "
                  f"sources, DSL or Python (first: {key}); run 'cute-fp4 tune' again")
        return None
    try:
        s = catalogue.get(entry["schedule"])
    except InputError:
        s = None
    if s is None or schedule_key(s) != entry.get("key"):
        _say_once("changed", f"ignoring {key}: catalogue schedule {entry['schedule']!r} is "
                  "gone or changed since it was tuned")
        return None
    return s


def pick(name: str, m: int, n: int, k: int, a_format: str,
         b_format: str = Operand.NVFP4) -> Schedule:
    """What a schedule name picks for a call of (M, N, K, a_format) on a weight of block
    format ``b_format``: a catalogue name's schedule, or for "auto" on the present GPU the
    tuned one (:func:`lookup`; the store holds NVFP4 weights' and W4A4 ones keyed by A's
    format), else the :func:`heuristic`'s. The launch path
    (``cute_fp4.run.resolve_schedule``) asks it once per memoised resolution and fits the
    output dtype."""
    from cute_fp4 import catalogue
    from cute_fp4.targets import gemm_device

    if name != "auto":
        return catalogue.get(name)
    dev = gemm_device()
    b_format = Operand.of(b_format)
    if a_format not in auto_row(dev.target.family, b_format).plain_formats:
        raise InputError(f"a {b_format} weight with {a_format} activations on "
                         f"{dev.target.name} runs a kernel that reads the fragment-order "
                         "packed weight: pass cute_fp4.packed.repack(w) once (the layers "
                         "hold it so), or quantize the activations (W4A4, where the GPU "
                         "has FP4 MMA)")
    tuned = None
    if b_format is Operand.NVFP4 or a_format == b_format:
        tuned = lookup(dev, m, n, k, a_format)
    return tuned or heuristic(dev.target.family, m, n, k, b_format=b_format)


# ----------------------------------------------------------------------------- heuristic

SWAPAB_MAX_M = 32  # sm90: up to this M the swap-AB decode schedule is picked


def heuristic(family: str, m: int, n: int, k: int, packed: bool = False,
              a_format: str = Operand.BF16, target: str | None = None,
              b_format: str = Operand.NVFP4) -> Schedule:
    """The catalogue schedule a shape gets when nothing was tuned for it: the row of
    :data:`AUTO` of the GPU family and the weight's block format ``b_format`` (``packed``:
    the weight is in fragment order, which the ``rs_packed`` and ``stream`` mainloops read;
    the schedule depends on the activation format, ``a_format``; ``target``: the GPU's
    target name, default the family's first)."""
    row = auto_row(family, b_format)
    if packed:
        return row.packed(m, n, k, a_format, target or _family_target(family))
    return row.dense(m, n, k)


def _sm90_dense(m: int, n: int, k: int) -> Schedule:
    """sm_90a, plain weight: the swap-AB decode tile up to :data:`SWAPAB_MAX_M`, then the
    64-row decode tile, 128 x 128 and 128 x 256 tiles as M grows."""
    from cute_fp4 import catalogue

    if m <= SWAPAB_MAX_M:
        # swap-AB decode: activation tile (WGMMA's N) = the smallest of 8/16/32 >= M
        tm = 8 if m <= 8 else 16 if m <= 16 else 32
        s = catalogue.get("sm90_decode_swapab")
        if s.tile.m != tm:
            s = s.replace(tile=(tm, s.tile.n, s.tile.k))
        # one CTA per 64 weight rows; split-K (reduced in the kernel) where that leaves SMs
        # idle: measured on H200 (perf/results/2026-12-01-h200-decode.md), M = 1: N x K =
        # 1024 x 4096 17.0 -> 10.2 us (split 4), 4096 x 4096 16.3 -> 13.5 (2)
        split = decode_split(-(-n // s.tile.n), -(-k // s.tile.k), s.arch.sm_count)[1]
        return s.replace(split_k=split) if split > 1 else s
    # measured on H200, N = K = 8192 (perf/results/2026-11-30-h200.md): at M = 256
    # 128x128x64 takes 96 us vs 138 us for 128x256x64 (twice the tiles); from M = 1024 the
    # 128x256x64 default is fastest
    return catalogue.get("sm90_decode" if m <= 64 else "sm90_128x128x64" if m <= 512
                         else "sm90_default")


def _sm120_dense(m: int, n: int, k: int, default: str = "sm120_default") -> Schedule:
    """SM12x, plain weight (W4A4, the block-scaled MMA): split-K decode tiles for small M
    and long K, else the default tile (``default``: the format's)."""
    from cute_fp4 import catalogue

    return catalogue.get("sm120_decode_splitk4" if m <= 64 and k >= 2048 else default)


def _sm120_mxfp4_dense(m: int, n: int, k: int) -> Schedule:
    """SM12x W4A4 on MXFP4 (``kind::mxf4``): :func:`_sm120_dense` with ``sm120_mxfp4``
    (the NVFP4 default tile, named for the format; its split-K decode tile is K 128
    already, whole MXFP4 scale atoms)."""
    return _sm120_dense(m, n, k, "sm120_mxfp4")


def _sm120_packed(m: int, n: int, k: int, a_format: str, target: str) -> Schedule:
    """SM12x, packed weight: the stream kernel, its only W4A16 kernel, at every M
    (activation tiles of 8 rows up to M = 8, else of 16, as many as M needs)."""
    if not Operand.of(a_format).sixteen_bit:
        raise InputError("on sm_120a/sm_121a a packed weight takes 16-bit activations "
                         "(the stream kernel); W4A4 runs on the plain weight: use "
                         "weight.unpack()")
    return stream_decode_schedule(target, min(m, 16), n, k)


DECODE_SPLITS = (1, 2, 3, 4, 6, 8, 16)
DECODE_MIN_K_TILES = 4  # K tiles per split at least
# what a work unit costs besides its K tiles, in K tiles: its partials (a 16-column tile
# even at M = 1), arrival and epilogue. Fitted to H200 runs of one 256 x 128 tile at
# N x K = 28672 x 4096, M = 1, split 1/2/4/8: 40.4/44.1/50.2/61.5 us -> 2.8-3.8
DECODE_UNIT_COST = 3


def decode_split(tiles: int, k_tiles: int, sms: int) -> tuple[int, int, int]:
    """(cost, split, waves) of the best split-K for a weight-streaming decode GEMM of
    ``tiles`` output tiles x ``k_tiles`` K tiles on ``sms`` SMs: cost = what the busiest
    CTA does (waves x (K tiles per split + ``DECODE_UNIT_COST``)), fewest waves on a tie.
    Each split keeps ``DECODE_MIN_K_TILES``; the split-K reduction is the kernel's own."""
    best = None
    for sk in DECODE_SPLITS:
        if sk > 1 and k_tiles // sk < DECODE_MIN_K_TILES:
            break
        waves = -(-tiles * sk // sms)
        cand = (waves * (-(-k_tiles // sk) + DECODE_UNIT_COST), waves, sk)
        if best is None or cand[:2] < best[:2]:
            best = cand
    return best[0], best[2], best[1]


def packed_decode_schedule(n: int, k: int) -> Schedule:
    """W4A16 at M <= 16 on the packed weight: 256 weight rows over four warpgroups or 128
    over two, and the split, by :func:`decode_split` with a tile's cost weighted by its
    rows (equal cost: fewer waves, then the taller tile, which has the more warps).
    Measured on H200 at M = 1 (perf/results/2026-12-01-h200-decode.md): 28672 x 4096 d4
    40.4 us vs d2 45.2 (2 waves); 1024 x 4096 d2 split 8 10.5 us vs d4 split 8 12.6."""
    from cute_fp4 import catalogue

    best = None
    for s in (catalogue.get("sm90_rs_packed_decode"), catalogue.get("sm90_rs_packed_decode_128")):
        cost, split, waves = decode_split(-(-n // s.tile.n), -(-k // s.tile.k),
                                          s.arch.sm_count)
        cand = (cost * s.tile.n, waves, -s.tile.n, split, s)
        if best is None or cand[:3] < best[:3]:
            best = cand
    split, s = best[3], best[4]
    return s.replace(split_k=split) if split > 1 else s


STREAM_MIN_UNITS = 16  # 64-element K units per split at least
STREAM_CTAS_PER_SM = 2  # the grid split-K grows to, at most
STREAM_MAX_M = 8  # sm_90a: the stream kernel up to this M; rs_packed's decode tile above
STREAM_SINGLE_UNIT_CTAS = 3  # grids over this many CTAs per SM batch one K unit per warp
# H200, 2026-12-03 (perf/results/2026-12-03-h200-stream-probe.md): 28672 x 4096 (448 CTAs,
# 3 resident per SM) 28.5 us with one unit per batch against 36.6 with two; every grid of
# <= 2 CTAs per SM was 4-15% slower with one
# H200, 2026-12-03 (perf/results/2026-12-03-h200-decode.md): the best split of each shape
# at M = 1 gave ~2 CTAs per SM with >= 16 K units each (8192^2: 2; 28672 x 4096: 1;
# 4096 x 14336 and 4096^2: 4); at M = 16 the rs_packed decode tile was faster on every
# shape but 1024 x 4096


def stream_decode_schedule(target: str, m: int, n: int, k: int) -> Schedule:
    """The weight-streaming decode kernel (``mainloop=stream``): an 8- or 16-row activation
    tile, split-K doubled (16 at most) while the grid stays within
    :data:`STREAM_CTAS_PER_SM` CTAs per SM (the splits' partial sums cost traffic, a second
    wave a tail) and each split keeps :data:`STREAM_MIN_UNITS` K units, and the default
    batch of a warp's ring, or one K unit per batch when the grid exceeds
    :data:`STREAM_SINGLE_UNIT_CTAS` CTAs per SM."""
    from cute_fp4.planning.common import MAX_SPLIT_K
    from cute_fp4.planning.stream import stream_schedule

    tm = 8 if m <= 8 else 16
    s = stream_schedule(target, tm, name="stream_decode")
    tiles = -(-n // 64) * -(-m // tm)
    units = k // 64
    wave = STREAM_CTAS_PER_SM * s.arch.sm_count
    split = 1
    while (tiles * split * 2 <= wave and split * 2 <= MAX_SPLIT_K
           and units // (split * 2) >= STREAM_MIN_UNITS):
        split *= 2
    if tiles * split > STREAM_SINGLE_UNIT_CTAS * s.arch.sm_count:
        s = s.replace(stages=1)
    return s.replace(split_k=split, name="stream_decode") if split > 1 else s


def _family_target(family: str) -> str:
    from cute_fp4.targets import TARGETS

    return next(t.name for t in TARGETS.values() if t.family == family)


def _packed_heuristic(m: int, n: int, k: int, a_format: str = Operand.BF16,
                      target: str = "sm_90a", large: str = "sm90_rs_packed") -> Schedule:
    """rs_packed tiles by M: ``large`` (256 activation rows x 128 weight rows) at large M;
    at M <= 16 with 16-bit activations :func:`stream_decode_schedule` (W4A4 needs 64-row
    activation tiles);
    at small M a grid of ~one CTA per SM made up by split-K while each split keeps >= 16
    K tiles."""
    from cute_fp4 import catalogue

    sixteen_bit = Operand.of(a_format).sixteen_bit
    if m > 128:
        s = catalogue.get(large)
    elif m <= STREAM_MAX_M and sixteen_bit:
        return stream_decode_schedule(target, m, n, k)
    elif m <= 16 and sixteen_bit:
        return packed_decode_schedule(n, k)
    else:
        s = catalogue.get("sm90_rs_packed_m64")
        if m > 64:
            s = s.replace(tile=(128, s.tile.n, s.tile.k))
    ctas = -(-n // s.tile.n) * -(-m // s.tile.m)
    k_tiles = -(-k // s.tile.k)
    split = 1
    while ctas * split * 2 <= s.arch.sm_count and k_tiles // (split * 2) >= 16:
        split *= 2
    return s.replace(split_k=split) if split > 1 else s


# "auto" with nvfp4_out: the schedule auto picks when plan() takes the op on it, else this
# one of the family (normal-orientation tiles, no split-K, at most 2 MMA warps along N on
# SM12x: the kernels whose NVFP4 output the H200 validated,
# perf/results/2026-12-03-h200-final.md), by (family, grouped)
NVFP4_OUT_SCHEDULES = {("sm90", False): "sm90_default", ("sm120", False): "sm120_default",
                       ("sm120", True): "sm120_grouped"}


def with_ops(s: Schedule, ops: tuple[str, ...], m: int, n: int, k: int, a_format: str,
             groups: int = 0, b_format: str = Operand.NVFP4) -> Schedule:
    """What "auto" runs for a call with fused epilogue ``ops``: ``s`` (its pick without
    them) given the ops, or, where plan() refuses ``nvfp4_out`` there (the D^T kernels of
    decode, split-K, SM12x's decode tiles), :data:`NVFP4_OUT_SCHEDULES`'s schedule with the
    same output dtype. InputError for a packed weight, whose kernels all store D^T tiles."""
    from cute_fp4 import catalogue
    from cute_fp4.plan import plan
    from cute_fp4.schedule import Problem

    fused = s.replace(ops=ops) if s.epilogue.ops != ops else s
    if "nvfp4_out" not in ops or plan(fused, Problem(m, n, k, a_format, groups,
                                                     b_format)).ok:
        return fused
    if s.mainloop.reads_packed:
        raise InputError("nvfp4_out on a packed weight: its kernels (rs_packed, stream) store "
                         "D^T tiles, whose 16-column output blocks lie in other warps; hold "
                         "the weight in the plain layout (NVFP4Linear(layout='plain'), or "
                         "w.unpack())")
    name = NVFP4_OUT_SCHEDULES[(s.arch.family, s.scheduler.grouped)]
    return catalogue.get(name).replace(target=s.target, out_dtype=s.epilogue.out_dtype,
                                       ops=ops)


# ----------------------------------------------------------------------------- resolution
# What a call runs: a Schedule, a catalogue name, or "auto" turned into the schedule of the
# call's shape (the tuning store, else the heuristics above), with its output dtype. The
# launch path (cute_fp4.run) asks these once per memoised resolution (compile.kernel_for).

AUTO_RECHECK_S = 1.0  # how often "auto" is resolved again (a tuning stored meanwhile)


def resolution_deadline(schedule) -> float:
    """Until when (``time.monotonic()``) what ``schedule`` resolved to holds:
    :data:`AUTO_RECHECK_S` from now for "auto" (a tuning stored meanwhile is picked up),
    forever for a catalogue name or a Schedule. ``compile.kernel_for``'s memo and the launch
    bindings (``cute_fp4.bindings``) expire then."""
    if isinstance(schedule, str) and schedule == "auto":
        return time.monotonic() + AUTO_RECHECK_S
    return math.inf


def resolve_schedule(schedule, m: int, n: int, k: int, a_format: str,
                     out_dtype, b_format: str = Operand.NVFP4) -> Schedule:
    """A Schedule from a Schedule, a catalogue name, or "auto" (tuned, else heuristic:
    ``tuning.pick``), with ``out_dtype``."""
    if isinstance(schedule, str):
        schedule = pick(schedule, m, n, k, a_format, b_format)
    if not isinstance(schedule, Schedule):
        raise InputTypeError(f"schedule must be a Schedule, a catalogue name or 'auto', "
                             f"got {type(schedule).__name__}")
    return with_out_dtype(schedule, out_dtype)


def with_out_dtype(s: Schedule, out_dtype) -> Schedule:
    want = OutDtype.of(out_dtype)
    return s if s.epilogue.out_dtype is want else s.replace(out_dtype=want)


def resolve_packed(schedule, m: int, n: int, k: int, a_format: str,
                   out_dtype, b_format: str = Operand.NVFP4) -> Schedule:
    """resolve_schedule for a packed weight: "auto" is the packed heuristic (the tuning
    store holds plain-weight schedules), anything else must be ``mainloop=rs_packed``."""
    from cute_fp4.targets import gemm_device

    if schedule == "auto":
        t = gemm_device().target
        s = heuristic(t.family, m, n, k, packed=True, a_format=a_format, target=t.name,
                      b_format=b_format)
        return with_out_dtype(s, out_dtype)
    s = resolve_schedule(schedule, m, n, k, a_format, out_dtype, b_format)
    if not s.mainloop.reads_packed:
        raise InputError(f"schedule {s.name or s.label()} reads the plain weight layout, but "
                         "b is a packed weight: use a mainloop=rs_packed or stream "
                         "schedule, 'auto', or b.unpack()")
    return s


# grouped (MoE) calls

class GroupedAuto(NamedTuple):
    """What a grouped call's "auto" runs on one GPU family (a field of :class:`Auto`):
    ``default``, unless the experts average at most ``decode[1]`` rows (``decode[0]``) or at
    least ``large[1]`` (``large[0]``); 16-bit activations on a packed stack averaging at most
    ``stream[1]`` rows take the grouped weight-streaming kernel ``stream[0]`` while its CTAs
    (routed experts, at most min(E, total_M), x N / 64) number at most ``stream_max_units``
    with K up to ``stream_max_k``, or at least ``stream_long_k_units`` past it (there the
    schedule ``stream_long_k`` where one is named: a deeper ring for a long K); a stream of
    at most ``stream_few_units`` CTAs (up to ``stream_max_k``) takes ``stream_few`` where
    one is named (more warps per CTA for a grid of few CTAs)."""

    default: str
    decode: tuple[str, int]
    large: tuple[str, int] | None = None
    stream: tuple[str, float] | None = None
    stream_max_units: float = float("inf")
    stream_max_k: float = float("inf")
    stream_long_k_units: float = 0
    stream_long_k: str | None = None
    stream_few_units: float = 0
    stream_few: str | None = None


# sm_90a. Decode: measured on the H200 (perf/tools/grouped_tiles.py, 2026-12-01): at 1-4 rows
# per expert the 16-row four-warpgroup tile runs 1.6-1.8x the 128-row one, at 256 rows 0.3x;
# it takes 16-bit activations only (W4A4 needs 64-row activation tiles there). Large:
# 256-row tiles, 0.93-0.97x torch grouped_mm at 256 rows per expert against 0.86-0.90x for
# 192 rows. Stream: no split of K and not persistent, so past two waves of three CTAs per
# SM (or a long K) the persistent rs_packed decode tile balances better. H200, 2026-12-03
# (perf/results/2026-12-03-h200-grouped-decode.md), stream / rs_packed decode time: 0.71x and
# 0.79x at 192 and 256 CTAs (Qwen3-30B-A3B 1 token), 0.85x at 768 (4 tokens gate_up), 1.20x
# at 1024 (4 tokens down), 1.17x and 1.26x at 2064 and 2752 (16 tokens); 1.17x at 512 CTAs
# with K = 7168 (DeepSeek-V3 1 token gate_up: a second, partial wave of long CTAs),
# 0.92-0.96x with K = 7168 and 1920+ CTAs (4-128 tokens). Those streams had a ring of two K
# units per batch; H100, 2026-12-06 (perf/results/2026-12-06-h100-nvfp4-stream-stages.md):
# with K up to 4096 one unit per batch takes 0.83x the time of two (Qwen3-30B-A3B gate_up, 4
# tokens, 768 CTAs; 1.0x at 1 token), with K = 7168 1.08x (DeepSeek-V3 gate_up, 4 tokens),
# so a long K keeps two (sm90_stream_grouped_decode_long_k)
_SM90_GROUPED = GroupedAuto("sm90_grouped", ("sm90_grouped_decode", 16),
                            ("sm90_grouped_large", 192), ("sm90_stream_grouped_decode", 4),
                            stream_max_units=800, stream_max_k=4096,
                            stream_long_k_units=1600,
                            stream_long_k="sm90_stream_grouped_decode_long_k")
# SM12x: the grouped stream kernel is its only W4A16 grouped kernel, so every size takes it
_SM120_GROUPED = GroupedAuto("sm120_grouped", ("sm120_grouped_decode", 32),
                             stream=("sm120_stream_grouped_decode", float("inf")))


def grouped_auto_name(family: str, dims=None) -> str:
    """The catalogue schedule "auto" means for ``dims`` on a GPU of ``family``: the
    grouped stream kernel for 16-bit activations on a packed stack when the experts average
    few rows (by CTAs and K: :func:`_stream_fits`); the decode one when they average few
    rows, the large one when they average many, else the default (the family's
    :class:`GroupedAuto`); of those,
    the first that ``plan()`` accepts for the activation format (sm_90a's decode and
    192-row tiles take 16-bit activations only: W4A4 needs 128-row activation tiles)."""
    g = auto_row(family, getattr(dims, "b_format", Operand.NVFP4)).grouped
    if dims is None:
        return g.default
    from cute_fp4 import catalogue
    from cute_fp4.plan import plan

    per_expert = dims.total_m / max(dims.experts, 1)
    if _stream_fits(g, dims):
        if _long_k(g, dims):
            return g.stream_long_k
        return g.stream_few if _few_ctas(g, dims) else g.stream[0]
    decode, few = g.decode
    large, many = g.large or (None, float("inf"))
    first = [decode] if per_expert <= few else [large] if per_expert >= many else []
    for name in (*first, g.default, large, decode):
        if name is not None and plan(catalogue.get(name), Problem(
                a_format=dims.a_format, b_format=dims.b_format)).ok:
            return name
    return g.default


def _long_k(g: GroupedAuto, dims) -> bool:
    """Whether a streamed grouped call of ``dims`` takes ``g.stream_long_k`` (host
    arithmetic only: every grouped call's memo key asks it, :func:`grouped_regime`)."""
    return g.stream_long_k is not None and dims.k > g.stream_max_k


def _few_ctas(g: GroupedAuto, dims) -> bool:
    """Whether a streamed grouped call of ``dims`` (K up to ``g.stream_max_k``) takes
    ``g.stream_few``: at most ``g.stream_few_units`` CTAs (host arithmetic only, as
    :func:`_long_k`)."""
    return (g.stream_few is not None and dims.k <= g.stream_max_k
            and _stream_units(dims) <= g.stream_few_units)


def _stream_units(dims) -> int:
    """The grouped stream kernel's CTAs at most: routed experts (at most min(E, total_M))
    times N / 64 weight blocks."""
    return min(dims.experts, dims.total_m) * -(-dims.n // 64)


def resolve_grouped(schedule, out_dtype="bf16", dims=None) -> Schedule:
    """A grouped Schedule from a Schedule, a catalogue name, or "auto" (for the present
    GPU's family and ``dims``: :func:`grouped_auto_name`), with ``out_dtype``'s
    epilogue."""
    from cute_fp4 import catalogue

    if isinstance(schedule, str):
        if schedule == "auto":
            from cute_fp4.targets import gemm_device

            schedule = grouped_auto_name(str(gemm_device().target.family), dims)
        schedule = catalogue.get(schedule)
    if not isinstance(schedule, Schedule):
        raise InputTypeError(f"schedule must be a Schedule, a catalogue name or 'auto', "
                             f"got {type(schedule).__name__}")
    if not schedule.scheduler.grouped:
        raise InputError(f"schedule {schedule.name or schedule.label()} is not a grouped "
                         "schedule (Scheduler.grouped is False): grouped_gemm runs "
                         f"{' / '.join(r.grouped.default for r in AUTO.values())} or a "
                         "schedule made with replace(grouped=True)")
    return with_out_dtype(schedule, out_dtype)


def check_grouped_schedule(s: Schedule, dims) -> None:
    """The operands' layout and A format against what the schedule's kernel reads."""
    name = s.name or s.label()
    reads_packed = s.mainloop.reads_packed
    stream = s.mainloop is Mainloop.STREAM
    sixteen_bit = Operand.of(dims.a_format).sixteen_bit
    if reads_packed and not dims.packed:
        raise InputError(f"schedule {name} reads the fragment-order packed weight "
                         f"(mainloop={s.mainloop.value}) but b is a plain "
                         f"{_class_name(dims.b_format)}: repack it once with "
                         "cute_fp4.packed.repack(b)")
    if dims.packed and not reads_packed:
        raise InputError(f"schedule {name} reads the plain weight layout but b is a "
                         f"{_class_name(dims.b_format, packed=True)}: use an rs_packed or "
                         "stream grouped schedule, 'auto', or b.unpack()")
    if stream and not sixteen_bit:
        raise InputError(f"schedule {name} (mainloop=stream) takes 16-bit activations "
                         f"(W4A16); {dims.a_format} activations on a packed stack: "
                         "schedule='auto' runs NVFP4 ones on their exact BF16 block values")
    if s.arch.family == "sm120" and not stream and sixteen_bit:
        raise InputError(f"schedule {name} ({s.target}) takes {str(dims.b_format).upper()} "
                         f"activations (W4A4), a is {dims.a_format} (W4A16): quantize them first "
                         "(cute_fp4.quant.quantize_activation, cute_fp4.quantize)")


def _class_name(fmt, packed: bool = False) -> str:
    """The tensor class of a weight format, for messages (``NVFP4Tensor``,
    ``PackedMXFP4Weight``)."""
    name = str(Operand.of(fmt)).upper()
    return f"Packed{name}Weight" if packed else f"{name}Tensor"


def _stream_fits(g: GroupedAuto, dims) -> bool:
    """Whether "auto" runs the grouped stream kernel of ``g``: 16-bit activations on a packed
    stack, few rows per expert, and few CTAs with K at most ``g.stream_max_k``, or many with
    a longer K."""
    if g.stream is None or not dims.packed or not Operand.of(dims.a_format).sixteen_bit:
        return False
    if dims.total_m > g.stream[1] * max(dims.experts, 1):
        return False
    units = _stream_units(dims)
    if dims.k > g.stream_max_k:
        return units >= g.stream_long_k_units
    return units <= g.stream_max_units


def grouped_regime(schedule, dims) -> tuple | None:
    """What "auto" depends on besides the device: (decode-sized?, large?, streamed?,
    streamed with the long-K schedule?, streamed with the few-CTA schedule?) per GPU family
    and weight format, and the A format; None for a named schedule."""
    if schedule != "auto" or dims is None:
        return None
    experts = max(dims.experts, 1)
    rows = [r.grouped for r in AUTO.values()]  # every family's and format's
    few = tuple(dims.total_m <= g.decode[1] * experts for g in rows)
    many = tuple(g.large is not None and dims.total_m >= g.large[1] * experts for g in rows)
    stream = tuple(_stream_fits(g, dims) for g in rows)
    long_k = tuple(fits and _long_k(g, dims) for fits, g in zip(stream, rows))
    few_ctas = tuple(fits and _few_ctas(g, dims) for fits, g in zip(stream, rows))
    return few, many, stream, long_k, few_ctas, dims.a_format


# ----------------------------------------------------------------------------- the table

class Auto(NamedTuple):
    """What "auto" runs on one GPU family for one weight format: one row of :data:`AUTO`."""

    dense: Callable[[int, int, int], Schedule]  # (M, N, K) on a plain weight
    packed: Callable[[int, int, int, str, str], Schedule]  # (M, N, K, A format, target)
    plain_formats: tuple[str, ...]  # the A formats its plain-weight kernels take
    grouped: GroupedAuto  # grouped (MoE) calls


def _no_plain_mxfp4(m: int, n: int, k: int) -> Schedule:
    raise InputError("sm_90a runs MXFP4 weights in the packed layout only (rs_packed and "
                     "stream decode UE8M0 scales; the shared-memory conversion does not): "
                     "pass cute_fp4.packed.repack(w)")


def _sm90_mxfp4_packed(m: int, n: int, k: int, a_format: str = Operand.BF16,
                       target: str = "sm_90a") -> Schedule:
    """sm_90a, packed MXFP4 weight: :func:`_packed_heuristic` with ``sm90_mxfp4_rs_packed``
    (tile K 128, whole MXFP4 scale atoms) at large M; its stream, decode and m64 tiles
    take MXFP4 as they are (K 128 or the stream kernel)."""
    return _packed_heuristic(m, n, k, a_format, target, large="sm90_mxfp4_rs_packed")


# gpt-oss's MXFP4 experts: the MXFP4 schedules (tile K 128) where NVFP4's tile K is 64, and
# the stream kernel's own limits. H200, 2026-12-06 (perf/results/2026-12-06-h200-gpt-oss.md,
# perf/tools/gpt_oss_sweep.py: both GEMMs of a gpt-oss layer, H = I = 2880, top-4): the stream
# kernel against the rs_packed decode tile 0.98x at 1 token (360 and 180 CTAs), 0.87-0.92x at
# 4 (~1,300), 0.95x at 16 (~2,500-4,500 CTAs; the bound of 128 experts: 5,760); a four-unit
# ring 0.89-0.90x the then two-unit default's time at 1 token, 1.06-1.14x at 4 and 16. H100,
# same run (perf/results/2026-12-06-h100-stream-stages.md): the one-unit ring the stream
# kernel now has 0.76x the two-unit ring's time at 1 token, 0.86-0.99x at 4, 0.90-0.93x at
# 16, and 0.92x eight warps per CTA with one unit (sm90_mxfp4_stream_grouped_decode_w8) at
# 1 token for both GEMMs back to back. Inside the experts layer, where the gate_up GEMM follows
# the gather (H100, perf/results/2026-12-06-h100-gpt-oss-pairs.md, moe_layer_pairs.py): the
# eight-warp kernel for the down GEMM alone at 1 token (180 CTAs) 0.96x the layer's time,
# for the gate_up GEMM too (360 CTAs) 1.05x, at 4 tokens (~630-720 CTAs) 1.00-1.05x; so it
# takes grids of at most 200 CTAs (1.5 per SM); not timed on the H200 yet
_SM90_MXFP4_GROUPED = _SM90_GROUPED._replace(
    default="sm90_mxfp4_grouped", large=None, stream=("sm90_mxfp4_stream_grouped_decode", 4),
    stream_max_units=6000, stream_long_k=None, stream_few_units=200,
    stream_few="sm90_mxfp4_stream_grouped_decode_w8")
_SM120_MXFP4_GROUPED = _SM120_GROUPED._replace(default="sm120_mxfp4_grouped")


def auto_key(family: str, fmt: str = Operand.NVFP4) -> str:
    """The :data:`AUTO` key of a GPU family and weight block format: the family for NVFP4
    (the default format), ``"<family>/<format>"`` for another."""
    fmt = Operand.of(fmt)
    return str(family) if fmt is Operand.NVFP4 else f"{family}/{fmt}"


# (GPU family[/weight format]) -> what "auto" runs there (auto_key). A new GPU family is a row
# per format (and its kernel families' rows in cute_fp4.families); a new kernel family on a
# known GPU changes its functions; a new block format is a row per family.
AUTO: dict[str, Auto] = {
    "sm90": Auto(_sm90_dense, _packed_heuristic, (Operand.NVFP4, Operand.BF16, Operand.FP16),
                 _SM90_GROUPED),
    "sm120": Auto(_sm120_dense, _sm120_packed, (Operand.NVFP4,), _SM120_GROUPED),
    "sm90/mxfp4": Auto(_no_plain_mxfp4, _sm90_mxfp4_packed, (), _SM90_MXFP4_GROUPED),
    "sm120/mxfp4": Auto(_sm120_mxfp4_dense, _sm120_packed, (Operand.MXFP4,),
                        _SM120_MXFP4_GROUPED),
}


def auto_row(family: str, fmt: str = Operand.NVFP4) -> Auto:
    """The :data:`AUTO` row of a GPU family and weight block format; InputError for one
    without kernels."""
    row = AUTO.get(auto_key(family, fmt))
    if row is None:
        raise InputError(f"no kernels for GPU family {family} with {fmt} weights; rows: "
                         f"{', '.join(AUTO)}")
    return row
