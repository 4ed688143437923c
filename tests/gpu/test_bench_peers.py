"""The bench providers on an SM90 GPU: each output checked is the one the CUDA-graph
replays wrote; torch BF16, cute_fp4 (W4A16, W4A4) and QuACK (when installed) pass the
exact reference's rule on the same weight; FP8 runs (its check may say 'inexact')."""

from __future__ import annotations

import pytest
import torch

from cute_fp4.bench import (
    QUACK_W4A16,
    TORCH_BF16,
    TORCH_FP8,
    Timer,
    bench_operands,
    cute_fp4_provider,
    measure,
    provider_status,
)

pytestmark = pytest.mark.gpu("sm90")


def test_timed_returns_what_the_replays_wrote():
    x = torch.zeros((), device="cuda")

    def bump():
        return x.add_(1)

    us, got = Timer(reps=5, flush=False).timed(bump)
    # 3 warm-up calls, 1 before capture (side stream), none while capturing, 5 replays
    assert us > 0 and float(got) == 9.0 and got.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("provider", [TORCH_BF16, cute_fp4_provider("auto", "bf16"),
                                      cute_fp4_provider("auto", "nvfp4")],
                         ids=["torch_bf16", "cute_fp4_w4a16", "cute_fp4_w4a4"])
def test_exact_providers_pass_the_rule(provider):
    row = measure(provider, bench_operands(16, 520, 1024), Timer(reps=3))
    assert row["status"] == "ok" and row["check"] == "ok", row
    assert row["us"] > 0 and row["nonfinite"] == 0


def test_fp8_runs():
    row = measure(TORCH_FP8, bench_operands(16, 512, 1024), Timer(reps=3))
    assert row["status"] == "ok", row
    assert row["check"] in ("ok", "inexact") and row["rel_err"] < 0.1, row


def test_quack_on_the_same_weight():
    why = provider_status()["quack_w4a16"]
    if why:
        pytest.skip(why)
    row = measure(QUACK_W4A16, bench_operands(16, 520, 1024), Timer(reps=3))
    assert row["status"] == "ok" and row["check"] == "ok", row
    assert row["n_padded"] == 640  # N = 520 padded to a multiple of 128 by the repack
