"""The W4A4 forward's binding on the CPU (``NVFP4Linear._forward_w4a4``): from the second
call at an M, the quantizer (to BF16 values on the packed W4A16 route; with a dynamic
scale, quantizer then decoder) and the GEMM launch through ``quant.BoundActivation`` and
``bindings.BoundLaunch`` on the addresses the full path would use, with the device and every
launch stubbed (the GPU test ``tests/gpu/test_nn.py`` checks the results against the
reference)."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_launch_path import Recorder, stub_layer_path  # noqa: F401 (a fixture)

import cute_fp4 as cf
from cute_fp4 import quant, run

host = importlib.import_module("cute_fp4.compile")  # the module (cute_fp4.compile: a function)
N, K = 256, 512


class _FakeKernel:
    """A compiled quantize / dequantize kernel: a recording TVM-FFI entry."""

    def __init__(self, rec, stream, scale="static"):
        self._ffi, self.max_ctas = rec, 9
        self._stream_handle = lambda index: stream[0]
        self.spec = type("Spec", (), {"scale": scale})


@pytest.fixture
def stub_w4a4(stub_layer_path, monkeypatch):  # noqa: F811
    """stub_layer_path plus the activation kernels: the full path quantizes (to values)
    on the CPU (``cute_fp4.quantize``, ``block_values``); the bound path's quantizer
    launches are recorded, with the output each asked for (a dynamic scale: its variant;
    the decoder's launches in ``qrec.decoded``). Returns (gemm recorder, quantize recorder,
    [outputs asked of _kernel_for], built GEMMs, stream)."""

    host.clear_cache()  # kernels memoised by other tests hold other recorders
    rec, built, stream = stub_layer_path
    qrec, outputs = Recorder(), []
    qrec.decoded = Recorder()

    def kernel_for(x, scale, output="codes"):
        outputs.append(output if scale == "static" else scale)
        return _FakeKernel(qrec, stream, scale)

    monkeypatch.setattr(quant, "_kernel_for", kernel_for)
    monkeypatch.setattr(quant, "_dequant_kernel", lambda: _FakeKernel(qrec.decoded, stream))
    # the full path's activation steps (run.gemm_call), on the CPU
    monkeypatch.setattr(run, "quantize_activation", lambda x, gs: cf.quantize(x, gs))
    monkeypatch.setattr(run, "quantize_values", lambda x, gs: cf.quantize(x, gs)
                        .block_values(torch.bfloat16))
    monkeypatch.setattr(run, "w4a16_operands", lambda a, ws, alpha: (  # dynamic layers
        a.block_values(torch.bfloat16), a.global_scale * ws))
    yield rec, qrec, outputs, built, stream
    host.clear_cache()


def _layer(layout: str, input_scale=0.01):
    from cute_fp4.nn import NVFP4Linear

    return NVFP4Linear(cf.quantize(torch.randn(N, K)), mode="w4a4", schedule="auto",
                       layout=layout, input_scale=input_scale)


@pytest.mark.parametrize("layout", ["packed", "plain"])
@pytest.mark.parametrize("shape", [(3, K), (2, 1, K)])
def test_second_w4a4_call_launches_through_its_binding(stub_w4a4, layout, shape):
    """Packed: quantize to BF16 values into the scratch, the W4A16 GEMM on them (A's scales:
    the bound slot). Plain: quantize into the scratch's codes and scales, the W4A4 GEMM on
    them. Everything else as the full path passed it."""
    rec, qrec, outputs, built, stream = stub_w4a4
    layer = _layer(layout)
    xs = [torch.randn(*shape).to(torch.bfloat16) for _ in range(3)]
    ys = [layer(x) for x in xs]
    m = xs[0].numel() // K
    assert list(layer.layer.launches.bound) == [(m, torch.bfloat16, "w4a4")]
    assert len(rec.calls) == 3 and len(qrec.calls) == 2, "one full call, two bound"
    assert outputs == ["values" if layout == "packed" else "codes"]  # bound once
    first = rec.calls[0]
    gs = layer.input_scale.data_ptr()
    for i, (x, y) in enumerate(zip(xs[1:], ys[1:])):
        assert y.shape == (*shape[:-1], N) and y.dtype == torch.bfloat16
        q = qrec.calls[i]
        out, scales = q[1], q[2]
        assert q == (x.data_ptr(), out, scales, gs, gs, m, K, 9, stream[0])
        g = rec.calls[1 + i]
        assert g[0] == out and g[4] == y.data_ptr()
        assert g[5:] == first[5:] and g[2:4] == first[2:4]
        if layout == "packed":  # values: the scale slot is not read (any aligned address)
            assert scales == out and g[1] == first[1]  # W4A16: pSFA repeats pSFB
        else:
            assert (scales - out) % 256 == 0 and scales - out >= m * K // 2
            assert g[1] == scales


def test_w4a4_binding_follows_the_scales(stub_w4a4):
    """The input scale changed in place keeps the binding (the kernels read it); a
    replaced scale buffer or weight takes the full path and binds again."""
    rec, qrec, _, _, _ = stub_w4a4
    layer = _layer("packed")
    x = torch.randn(2, K).to(torch.bfloat16)
    layer(x)
    b0 = layer.layer.launches.bound[(2, torch.bfloat16, "w4a4")]
    layer.set_input_scale(0.02)  # in place
    layer(x)
    assert layer.layer.launches.bound[(2, torch.bfloat16, "w4a4")] is b0 and len(qrec.calls) == 1
    layer.input_scale = layer.input_scale.clone()
    layer.layer._refresh_alpha()
    layer(x)  # full path, bound again on the new buffer
    b1 = layer.layer.launches.bound[(2, torch.bfloat16, "w4a4")]
    assert b1 is not b0 and len(qrec.calls) == 1
    layer(x)
    assert qrec.calls[-1][3] == layer.input_scale.data_ptr()
    layer.weight_packed = layer.weight_packed.clone()
    n = len(rec.calls)
    layer(x)  # a new weight view: the binding is not used (nothing launched by it)
    assert len(qrec.calls) == 2 and rec.calls[-1][2] == layer.weight_packed.data_ptr()
    assert len(rec.calls) == n + 1
    layer(x)  # bound again, on the new weight
    assert len(qrec.calls) == 3 and rec.calls[-1][2] == layer.weight_packed.data_ptr()
    # the GEMM's time is up:
    layer.layer.launches.bound[(2, torch.bfloat16, "w4a4")][1]._expires = 0.0
    layer(x)  # asked first, so the bound quantizer does not run; the full path runs it all
    assert len(qrec.calls) == 3 and len(rec.calls) == n + 3


def _dynamic_calls(stub, layout: str, m: int):
    """Three forwards of a dynamic-scale layer: (gemm recorder, quantize recorder, layer,
    [(input, output) of the two bound calls], two quantize kernels?), after checking what
    every dynamic binding shares: one full call, then the quantizer of the right variant
    on the input, into the scratch (codes, then scales at least M K / 2 bytes on, the
    global scale, amax partials for two kernels)."""
    rec, qrec, outputs, _, stream = stub
    layer = _layer(layout, input_scale=None)
    xs = [torch.randn(m, K).to(torch.bfloat16) for _ in range(3)]
    ys = [layer(x) for x in xs]
    two_pass = m * K > quant.FUSED_MAX_ELEMENTS
    assert outputs == ["dynamic" if two_pass else "dynamic_fused"]
    assert len(rec.calls) == 3 and len(qrec.calls) == 2
    for i, x in enumerate(xs[1:]):
        codes, scales, gs, part = qrec.calls[i][1:5]
        assert qrec.calls[i] == (x.data_ptr(), codes, scales, gs, part, m, K, 9, stream[0])
        assert (part != gs) == two_pass and scales - codes >= m * K // 2
    return rec, qrec, layer, list(zip(xs[1:], ys[1:])), two_pass


@pytest.mark.parametrize("m", [2, 4096])
def test_dynamic_scale_on_the_codes_route_binds_quantizer_and_alpha(stub_w4a4, m):
    """A dynamic input scale on the plain weight (the W4A4 kernel): the bound call
    quantizes into the scratch (codes, scales, the global scale, partials for a large M),
    torch multiplies the weight's scale by it into the scratch's alpha slot, and the GEMM
    reads the codes, their scales and that alpha."""
    rec, qrec, layer, calls, two_pass = _dynamic_calls(stub_w4a4, "plain", m)
    assert qrec.decoded.calls == []
    first = rec.calls[0]
    for i, (_, y) in enumerate(calls):
        codes, scales, gs, part = qrec.calls[i][1:5]
        g = rec.calls[1 + i]
        alpha = g[5]
        assert g[:2] == (codes, scales) and g[4] == y.data_ptr() and g[6:8] == (alpha,) * 2
        assert alpha > gs > scales and (alpha - codes) % 256 == 0 and alpha != first[5]
        assert g[2:4] == first[2:4] and g[8:] == first[8:]


@pytest.mark.parametrize("m", [2, 4096])
def test_dynamic_scale_binds_quantizer_decoder_and_alpha(stub_w4a4, m):
    """A dynamic input scale on the packed route: the bound call quantizes into the scratch
    (codes, scales, the global scale; amax partials for a large M, two kernels), decodes
    there to values and alpha (the weight's global scale read from its buffer), and the
    GEMM reads the values and alpha from the scratch (every alpha slot of an unsplit
    kernel); nothing else changes from the full path's launch."""
    rec, qrec, layer, calls, two_pass = _dynamic_calls(stub_w4a4, "packed", m)
    assert len(qrec.decoded.calls) == 2
    first, ws, stream = rec.calls[0], layer.weight_scale_2.data_ptr(), stub_w4a4[4]
    for i, (_, y) in enumerate(calls):
        codes, scales, gs, part = qrec.calls[i][1:5]
        values, alpha = qrec.decoded.calls[i][2], qrec.decoded.calls[i][5]
        assert qrec.decoded.calls[i] == (codes, scales, values, gs, ws, alpha, m, K, 1,
                                         stream[0])
        assert len({codes, scales, gs, part, values, alpha} - {gs}) == 4 + two_pass
        assert all(p % 256 == 0 for p in (scales - codes, gs - codes, values - codes))
        g = rec.calls[1 + i]
        assert g[0] == values and g[4] == y.data_ptr() and g[5:8] == (alpha,) * 3
        assert g[1:4] == first[1:4] and g[8:] == first[8:]
