"""The tuning store on the CPU, with a temporary store path: M buckets, keys on the GPU,
the schedule's key and the source fingerprint, stale entries ignored and said once,
atomic rewrites and reloads, and ``schedule="auto"`` consulting it before the heuristic."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from cute_fp4 import api, catalogue, tune, tuning
from cute_fp4.targets import TARGETS, Device
from cute_fp4.tuning import TuningWarning, bucket_range, lookup, m_bucket, save_entry

H200 = Device(0, "NVIDIA H200", (9, 0), 132, TARGETS["sm_90a"], 4800.0)
N, K = 4096, 8192


@pytest.fixture(autouse=True)
def store(monkeypatch, tmp_path):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("CUTE_FP4_TUNING", str(path))
    tuning._SAID.clear()
    yield path
    tuning._SAID.clear()


def bump_mtime(path, by_ns: int) -> None:
    st = path.stat()  # coarse file-system clocks: make the change visible
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + by_ns))


@pytest.mark.parametrize("m, bucket, serves", [
    (1, 1, (1, 1)), (2, 2, (2, 2)), (3, 4, (3, 4)), (9, 16, (9, 16)), (16, 16, (9, 16)),
    (17, 32, (17, 32)), (1000, 1024, (513, 1024)), (4096, 4096, (2049, 4096)),
])
def test_m_buckets_are_powers_of_two(m, bucket, serves):
    assert m_bucket(m) == bucket and bucket_range(m) == serves


def test_m_bucket_rejects_zero():
    with pytest.raises(ValueError, match="got 0"):
        m_bucket(0)


def test_a_tuned_m_serves_its_bucket_only():
    s = catalogue.get("sm90_decode")
    save_entry(H200.name, 16, N, K, "nvfp4", s)
    found = {m: lookup(H200, m, N, K, "nvfp4") for m in range(1, 40)}
    assert {m for m, v in found.items() if v is not None} == set(range(9, 17))
    assert found[12] == s and found[12].name == "sm90_decode"
    assert lookup(H200, 16, N, K, "bf16") is None  # another A format
    assert lookup(H200, 16, N, K + 32, "nvfp4") is None  # N and K match exactly
    other = Device(0, "NVIDIA H100 80GB HBM3", (9, 0), 132, TARGETS["sm_90a"], 3350.0)
    assert lookup(other, 16, N, K, "nvfp4") is None  # another GPU


def test_entries_carry_the_schedule_key_and_the_source_fingerprint(store):
    from cute_fp4.cache import source_fingerprint

    s = catalogue.get("sm90_default")
    key = save_entry(H200.name, 4096, N, K, "nvfp4", s, tuned_m=4096, us=812.5)
    entry = json.loads(store.read_text())[key]
    assert key == f"NVIDIA H200|nvfp4|4096x{N}x{K}"
    assert entry == {"schedule": "sm90_default", "key": s.key(),
                     "fingerprint": source_fingerprint(), "tuned_m": 4096, "us": 812.5}


def test_stale_fingerprint_is_ignored_and_said_once(monkeypatch, store):
    from cute_fp4 import cache

    save_entry(H200.name, 16, N, K, "nvfp4", catalogue.get("sm90_decode"))
    save_entry(H200.name, 64, N, K, "nvfp4", catalogue.get("sm90_decode"))
    assert lookup(H200, 16, N, K, "nvfp4") is not None
    monkeypatch.setattr(cache, "source_fingerprint", lambda: "sources changed")
    with pytest.warns(TuningWarning, match="tuned with other package sources"):
        assert lookup(H200, 16, N, K, "nvfp4") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the second stale entry is quiet
        assert lookup(H200, 64, N, K, "nvfp4") is None
        assert lookup(H200, 16, N, K, "nvfp4") is None


def test_a_changed_catalogue_schedule_is_ignored(store):
    key = save_entry(H200.name, 16, N, K, "nvfp4", catalogue.get("sm90_decode"))
    data = json.loads(store.read_text())
    data[key]["key"] = catalogue.get("sm90_default").key()  # tuned as something else
    store.write_text(json.dumps(data))
    bump_mtime(store, 1_000_000)
    with pytest.warns(TuningWarning, match="'sm90_decode' is gone or changed"):
        assert lookup(H200, 16, N, K, "nvfp4") is None


def test_output_dtype_does_not_change_the_key():
    """Tuning times BF16 outputs; gemm asks for the schedule with its own output dtype."""
    s = catalogue.get("sm90_nonpersistent_fp32")
    assert s.epilogue.out_dtype.value == "fp32"
    save_entry(H200.name, 128, N, K, "nvfp4", s.replace(out_dtype="bf16", name=s.name))
    assert lookup(H200, 100, N, K, "nvfp4") == s


def test_old_and_corrupt_stores_read_as_nothing(store):
    store.write_text(json.dumps({f"NVIDIA H200|nvfp4|16x{N}x{K}": "sm90_decode"}))  # old form
    assert lookup(H200, 16, N, K, "nvfp4") is None
    store.write_text("{broken")
    bump_mtime(store, 2_000_000)
    assert tuning.load_store() == {} and lookup(H200, 16, N, K, "nvfp4") is None


def test_store_round_trip_and_reload(store):
    assert tuning.load_store() == {}
    k1 = save_entry("gpu", 16, 64, 64, "nvfp4", catalogue.get("sm90_decode"))
    assert list(tuning.load_store()) == [k1] == ["gpu|nvfp4|16x64x64"]
    k2 = save_entry("gpu", 1, 64, 64, "nvfp4", catalogue.get("sm90_decode_swapab"))
    bump_mtime(store, 1_000_000)
    assert sorted(tuning.load_store()) == sorted([k1, k2])  # a changed file is read again
    assert not [p for p in store.parent.iterdir() if p.suffix == ".tmp"]  # atomic rename
    assert tune.load_store is tuning.load_store  # the tuner re-exports the store's readers


def test_auto_consults_the_store_before_the_heuristic(monkeypatch):
    from cute_fp4 import targets

    monkeypatch.setattr(targets, "require_device", lambda family=None: H200)
    assert api.resolve_schedule("auto", 16, N, K, "nvfp4", torch.bfloat16).name == \
        api.heuristic("sm90", 16, N, K).name
    save_entry(H200.name, 16, N, K, "nvfp4", catalogue.get("sm90_128x128x64"))
    got = api.resolve_schedule("auto", 10, N, K, "nvfp4", torch.float16)
    assert got.replace(out_dtype="bf16", name=got.name) == catalogue.get("sm90_128x128x64")
    assert got.epilogue.out_dtype.value == "fp16"
    assert api.resolve_schedule("auto", 17, N, K, "nvfp4", torch.bfloat16).name == \
        api.heuristic("sm90", 17, N, K).name  # outside the bucket


def test_candidates_keep_catalogue_names_for_the_store():
    from cute_fp4.schedule import Problem

    names = [s.name for s in tune.candidates("sm90", Problem(256, N, K))]
    assert "sm90_nonpersistent_fp32" in names and all("+" not in n for n in names)
    assert len(names) == len(set(names))


def test_the_bucket_rule_is_stated_where_users_look():
    for doc in (tune.__doc__, tune.tune.__doc__, tuning.__doc__):
        assert "9..16" in doc
