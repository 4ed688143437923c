"""Programmatic dependent launch in the generated code (``kernels.roles.PDL``; the GPU side
is ``tests/gpu/test_pdl.py``). A kernel launched with PDL may start before the kernel ahead
of it on the stream has finished, so no global-memory access may come before its
``griddepcontrol.wait`` (SASS ``ACQBULK``): checked on the sm_90a and sm_120a cubins of
GEMMs of each family and mainloop, the quantizer and the dequantizer. The two activation
kernels also release their dependents (``PREEXIT``). Only the tensor-map prefetch
(``UTMAPF``, a kernel parameter) may precede the wait."""

from __future__ import annotations

import importlib
import re
import tempfile
from pathlib import Path

import pytest

from cute_fp4 import catalogue, quant
from cute_fp4.inspect import cubin_sass
from cute_fp4.schedule import Problem

host = importlib.import_module("cute_fp4.compile")  # the package's compile() shadows it
pytestmark = pytest.mark.compile

GLOBAL = re.compile(r"^(LDG|STG|ATOMG|RED|LDGSTS|UTMALDG|UTMASTG|UBLKCP|UTMAREDG|LD\.E|ST\.E)")


def _ops(sass: str) -> list[str]:
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass)


def _check(sass: str, releases: bool = False):
    for fn in re.split(r"Function : ", sass)[1:]:
        ops = _ops(fn)
        assert "ACQBULK" in ops, "no griddepcontrol.wait"
        wait = ops.index("ACQBULK")
        early = [op for op in ops[:wait] if GLOBAL.match(op)]
        assert not early, f"global accesses before the wait: {early}"
        if releases:
            assert "PREEXIT" in ops, "no griddepcontrol.launch_dependents"


def _gemm_sass(name: str, a_format: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        host.cross_compile(catalogue.get(name), Problem(a_format=a_format), dump_dir=d)
        return cubin_sass(sorted(Path(d).glob("*.cubin"))[-1])


@pytest.mark.parametrize("name, a_format", [
    ("sm90_default", "nvfp4"), ("sm90_rs_packed_decode_128", "bf16"),
    ("sm90_decode_64x128_splitk2", "bf16"), ("sm120_default", "nvfp4")])
def test_gemms_wait_before_touching_global_memory(name, a_format):
    _check(_gemm_sass(name, a_format))


@pytest.mark.parametrize("target", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("scale", ["static", "dynamic", "static-values"])
def test_quantizer_waits_first_and_releases_its_dependents(target, scale):
    output = "values" if scale.endswith("values") else "codes"
    spec = quant.default_spec(target, "bf16", scale.split("-")[0], output=output)
    with tempfile.TemporaryDirectory() as d:
        quant.cross_compile_quantize(spec, dump_dir=d)
        _check(cubin_sass(sorted(Path(d).glob("*.cubin"))[-1]), releases=True)


def test_dequantizer_waits_first_and_releases_its_dependents():
    from cute_fp4.kernels.dequantize import DequantizeKernel, DequantSpec

    with tempfile.TemporaryDirectory() as d:
        quant.spec_compile(DequantizeKernel(DequantSpec()),
                           f"--gpu-arch sm_90a --keep-cubin --dump-dir {d}")
        _check(cubin_sass(sorted(Path(d).glob("*.cubin"))[-1]), releases=True)


def test_the_check_catches_an_early_access():
    sass = ("\t\tFunction : k\n        /*0000*/   LDG.E R2, desc[UR4][R2.64] ;\n"
            "        /*0010*/   ACQBULK ;\n        /*0020*/   EXIT ;\n")
    with pytest.raises(AssertionError, match="before the wait"):
        _check(sass)
