"""How fast the activation quantizer's memory traffic can go on this GPU, arithmetic aside.

    python perf/tools/quantize_ceiling.py OUT.json [--shapes MxK,...]

For each shape, three rows under ``perf/quantize_bench.py``'s ``graphN`` timing (10 calls in
one CUDA graph over rotating buffers of more than 100 MiB):

* ``quantize``: the default kernel (``quant.default_spec``), checked bit for bit against
  ``cute_fp4.quantize`` first;
* ``no-arith``: the same kernel, grid, loads and stores with each block's arithmetic
  replaced by a few XORs of its words (the output is garbage and not checked): the
  ceiling of this access pattern if the E2M1 arithmetic cost nothing;
* ``copy_same_bytes``: ``torch`` ``copy_`` of a uint8 tensor of half the quantizer's bytes
  (read + write = the quantizer's ``2 M K + M K / 2 + scale bytes``), and ``copy_`` of the
  input itself (twice the bytes).

The kernel cache is off in this process: the no-arith kernel has the default's label.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ["CUTE_FP4_CACHE"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # perf/

import torch  # noqa: E402

from cute_fp4 import quant  # noqa: E402
from cute_fp4.kernels import quantize as qk  # noqa: E402
from cute_fp4.targets import detect_device  # noqa: E402

SHAPES = [(4096, 4096), (8192, 4096), (16384, 4096)]
# the arithmetic of one block replaced: every input word is read, the three outputs written
_NO_ARITH = "\n".join(["xor.b32 {$w0}, {$r0}, {$r1};", "xor.b32 {$w0}, {$w0}, {$r2};",
                       "xor.b32 {$w0}, {$w0}, {$r3};", "xor.b32 {$w1}, {$r4}, {$r5};",
                       "xor.b32 {$w1}, {$w1}, {$r6};", "xor.b32 {$w1}, {$w1}, {$r7};",
                       "mov.b32 {$w2}, {$r0};"])


class _NoArith(qk.QuantizeKernel):
    def __init__(self, spec):
        super().__init__(spec)
        self._fast = self._general = _NO_ARITH


def _copy_us(nbytes: int, bench) -> float:
    count = max(2, min(bench.GRAPH_N, -(-bench.ROTATE_BYTES // nbytes)))
    xs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
          for _ in range(count)]
    ys = [torch.empty_like(x) for x in xs]
    return bench._graph_n([lambda i=i: ys[i % count].copy_(xs[i % count])
                           for i in range(bench.GRAPH_N)])


def main(argv=None) -> int:
    import quantize_bench as bench

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shapes", default=None, metavar="MxK,...")
    args = p.parse_args(argv)
    dev = detect_device()
    if dev is None or dev.target is None:
        print("needs a supported CUDA GPU", file=sys.stderr)
        return 2
    shapes = SHAPES if not args.shapes else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    spec = quant.default_spec(dev.target.name, "bf16")
    rows = []
    for m, k in shapes:
        b = bench.nbytes(m, k)
        count = max(2, min(bench.GRAPH_N, -(-bench.ROTATE_BYTES // b)))
        buf = bench.Buffers(m, k, torch.bfloat16, count)
        real = quant.compile_quantize(spec)
        noar = quant.CompiledQuantize(spec, *quant.cached_spec_build(_NoArith(spec), "x")[:1],
                                      _NoArith(spec), 0.0, "built-uncached",
                                      torch.cuda.get_device_properties(0).multi_processor_count)
        row = {"m": m, "k": k, "bytes": b, "spec": spec.label(),
               "bit_identical": bench._check(real, buf, False, False)}
        for name, kern in (("quantize", real), ("no_arith", noar)):
            row[f"{name}_us"] = bench._graph_n(
                [bench._launcher(kern, buf, i % count, False, False)
                 for i in range(bench.GRAPH_N)])
        row["copy_same_bytes_us"] = _copy_us(b // 2, bench)
        row["copy_input_us"] = _copy_us(2 * m * k, bench)
        for key in ("quantize_us", "no_arith_us", "copy_same_bytes_us"):
            row[key.replace("_us", "_pct")] = 100 * b / row[key] / 1e3 / dev.mem_bw_gbs
        row["copy_input_pct"] = 100 * 4 * m * k / row["copy_input_us"] / 1e3 / dev.mem_bw_gbs
        rows.append(row)
        print(" ".join(f"{key}={val:.1f}" if isinstance(val, float) else f"{key}={val}"
                       for key, val in row.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": dev.name, "rows": rows}, indent=1))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
