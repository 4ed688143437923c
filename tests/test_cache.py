"""The disk cache on the CPU, with a stand-in for compiled kernels: hits, atomic entries,
truncated/corrupted/stale entries, concurrent builders, an unwritable directory."""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from pathlib import Path

import pytest

from cute_fp4 import cache
from cute_fp4.cache import OBJECT, CacheWarning, DiskCache


class Calls:
    def __init__(self):
        self.built = 0

    def build(self):
        self.built += 1
        return b"OBJECT" * 100

    @staticmethod
    def export(art, d: Path):
        (d / OBJECT).write_bytes(art)

    @staticmethod
    def load(path: Path):
        data = path.read_bytes()
        if not data.startswith(b"OBJECT"):
            raise RuntimeError("bad object")
        return data


@pytest.fixture(autouse=True)
def fresh_warnings():
    cache._SAID.clear()
    yield


def get(dc, calls, key="k1"):
    return dc.get_or_build(key, calls.build, calls.export, calls.load)


def test_build_then_load(tmp_path):
    calls = Calls()
    dc = DiskCache(tmp_path, "fp")
    assert get(dc, calls)[1] == "built"
    art, how = get(DiskCache(tmp_path, "fp"), calls)
    assert how == "loaded" and art == b"OBJECT" * 100 and calls.built == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".k1.")]  # no temp left


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "meta", "missing"])
def test_damaged_entries_are_rebuilt_and_said_once(tmp_path, damage):
    calls = Calls()
    dc = DiskCache(tmp_path, "fp")
    get(dc, calls)
    obj, meta = tmp_path / "k1" / OBJECT, tmp_path / "k1" / "meta.json"
    if damage == "truncate":
        obj.write_bytes(obj.read_bytes()[:10])
    elif damage == "corrupt":
        obj.write_bytes(b"X" + obj.read_bytes()[1:])
    elif damage == "meta":
        meta.write_text("{not json")
    else:
        obj.unlink()
    with pytest.warns(CacheWarning, match="discarded entry k1"):
        assert get(dc, calls)[1] == "built"
    assert calls.built == 2 and get(dc, calls)[1] == "loaded"
    (tmp_path / "k1" / OBJECT).write_bytes(b"junk")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no second warning
        assert get(dc, calls)[1] == "built"


def test_stale_fingerprint_rebuilds(tmp_path):
    calls = Calls()
    get(DiskCache(tmp_path, "old"), calls)
    with pytest.warns(CacheWarning, match="stale"):
        assert get(DiskCache(tmp_path, "new"), calls)[1] == "built"


def test_unwritable_directory_runs_uncached(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    calls = Calls()
    with pytest.warns(CacheWarning, match="not usable.*running uncached"):
        art, how = get(DiskCache(blocker / "cache", "fp"), calls)
    assert how == "built-uncached" and art.startswith(b"OBJECT")


def _worker(root, q):
    import time

    class Slow(Calls):
        def build(self):
            time.sleep(0.5)
            return super().build()

    c = Slow()
    _, how = DiskCache(Path(root), "fp").get_or_build("same", c.build, c.export, c.load)
    q.put(how)


def test_two_processes_compile_once(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert sorted(q.get(timeout=5) for _ in procs) == ["built", "loaded"]


def test_fingerprint_and_env(monkeypatch, tmp_path):
    assert len(cache.source_fingerprint()) == 64
    monkeypatch.setenv("CUTE_FP4_CACHE_DIR", str(tmp_path))
    assert cache.cache_dir() == tmp_path
    monkeypatch.setenv("CUTE_FP4_CACHE", "0")
    assert not cache.enabled()
    assert cache.entry_key("a", "b") != cache.entry_key("a", "c")
    assert os.path.basename(str(cache.cache_dir())) == tmp_path.name


def test_failing_export_still_returns_the_kernel(tmp_path):
    calls = Calls()

    def export(art, d):
        raise NotImplementedError("cannot export")

    with pytest.warns(CacheWarning, match="could not store entry k1.*NotImplementedError"):
        art, how = DiskCache(tmp_path, "fp").get_or_build("k1", calls.build, export, calls.load)
    assert how == "built" and art.startswith(b"OBJECT")
    assert not (tmp_path / "k1").exists()
