"""cute_fp4.emulation on the CPU, an H200 described to it: inside ``emulate()`` the GEMM
side (device, capability, layouts, gate/up groups, "auto" resolution, mode="auto", compile)
sees the SM120 target and everything is back outside; refusals. The emulated models run in
tests/gpu/test_hf.py (its ``-emulated_sm120`` cases)."""

from __future__ import annotations

import importlib

import pytest
import torch

from cute_fp4 import catalogue, emulation, targets, tuning
from cute_fp4.errors import DeviceError, InputError
from cute_fp4.fused import device_group
from cute_fp4.hf.quantizer import resolve_mode
from cute_fp4.layers.common import resolve_layout
from cute_fp4.nvfp4 import quantize

CUDA = torch.device("cuda", 0)
compile = importlib.import_module("cute_fp4.compile")  # noqa: A001 (the package exports
# a function of that name)


@pytest.fixture
def h200(monkeypatch):
    """The process sees one H200 (no CUDA is touched)."""
    dev = targets.Device(0, "NVIDIA H200", (9, 0), 132, targets.get_target("sm_90a"), 4800.0)
    monkeypatch.setattr(targets, "detect_device", lambda index=None: dev)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return dev


def test_inside_the_gemm_side_sees_sm120_and_outside_sm90(h200):
    w = quantize(torch.randn(64, 128))
    assert targets.capability_major(CUDA) == 9 and device_group(CUDA, "plain") == 8
    with emulation.emulate() as t:
        assert t.name == "sm_120a" and targets.emulated_target() is t
        dev = targets.gemm_device()
        assert dev.target is t and dev.cc == (12, 0) and "emulating sm_120a" in dev.name
        assert dev.sm_count == 132  # the present GPU's
        assert targets.require_device() is h200  # auxiliary kernels: the real GPU
        assert targets.capability_major(CUDA) == 12
        assert targets.capability_major(torch.device("cpu")) == 0
        assert device_group(CUDA, "plain") == 32 and device_group(CUDA, "packed") == 8
        assert resolve_mode("auto", CUDA, has_input_scales=True) == "w4a4"
        assert resolve_mode("auto", CUDA, has_input_scales=False) == "w4a16"
        auto = tuning.pick("auto", 16, 4096, 4096, "nvfp4")
        assert auto.arch.family == "sm120"
        assert tuning.resolve_grouped("auto", torch.bfloat16).arch.family == "sm120"
    assert targets.emulated_target() is None and targets.gemm_device() is h200
    assert targets.capability_major(CUDA) == 9
    assert resolve_mode("auto", CUDA, has_input_scales=True) == "w4a16"
    assert tuning.pick("auto", 16, 4096, 4096, "nvfp4").arch.family == "sm90"
    del w


def test_layouts_follow_the_emulated_target(h200, monkeypatch):
    w = quantize(torch.randn(64, 128))
    monkeypatch.setattr(type(w), "device", property(lambda self: CUDA))
    k = w.shape[1]
    assert resolve_layout("auto", "w4a4", k, CUDA) == "packed"  # SM90: W4A4 via W4A16
    with emulation.emulate():
        assert resolve_layout("auto", "w4a4", k, CUDA) == "plain"  # SM12x: block-scaled MMA
        assert resolve_layout("auto", "w4a16", k, CUDA) == "packed"  # SM12x: the stream kernel


def test_compile_builds_sm120_kernels_emulated_and_stream_for_the_present_gpu(h200,
                                                                              monkeypatch):
    built = []
    monkeypatch.setattr(compile, "compile_emulated",
                        lambda s, sig=None: built.append(("emulated", s.name)) or "emu")
    monkeypatch.setattr(compile, "_build",
                        lambda s, sig, *a: built.append(("built", s.name, s.target)) or "own")
    sm120 = next(s for s in catalogue.all_schedules("sm120", grouped=False)
                 if s.mainloop.value != "stream")
    stream = catalogue.get("sm120_stream_decode")
    with emulation.emulate():
        assert compile.compile(sm120) == "emu"
        assert compile.compile(stream) == "own"
    assert built == [("emulated", sm120.name), ("built", stream.name, "sm_90a")]
    with pytest.raises(DeviceError, match="needs a sm120 GPU"):  # outside: the real GPU
        compile.compile(sm120)


def test_the_caches_are_cleared_on_entry_and_exit(h200, monkeypatch):
    calls = []
    monkeypatch.setattr(compile, "clear_cache", lambda: calls.append("compile"))
    with emulation.emulate():  # the memo of every call's kernel is compile's
        assert calls == ["compile"]
    assert calls == ["compile"] * 2


def test_refusals(h200, monkeypatch):
    with pytest.raises(InputError, match="stands in for an SM120 target, got sm_90a"):
        with emulation.emulate("sm_90a"):
            pass
    rtx = targets.Device(0, "RTX 5090", (12, 0), 170, targets.get_target("sm_120a"), 1790.0)
    monkeypatch.setattr(targets, "detect_device", lambda index=None: rtx)
    with pytest.raises(DeviceError, match="needs a sm90 GPU"):
        with emulation.emulate():
            pass
    monkeypatch.setattr(targets, "detect_device", lambda index=None: None)
    with pytest.raises(DeviceError, match="no CUDA GPU"):
        with emulation.emulate():
            pass
    assert targets.emulated_target() is None
