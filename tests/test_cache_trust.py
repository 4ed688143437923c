"""The disk cache trusts no one (issue 42): it loads native code, so a cache directory, an
entry or an entry's file that is not the current user's, or that its group or others can
write, is refused with one warning and every kernel is then compiled in memory only; what
the cache makes itself only its owner can write. On the CPU: chmod, and the owner faked
(``os.getuid``, a stat result)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from test_cache import Calls, get  # the stand-in for compiled kernels

from cute_fp4 import cache
from cute_fp4.cache import META, OBJECT, BuildCache, CacheWarning, DiskCache

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="no POSIX owners")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    cache._SAID.clear()
    monkeypatch.setattr(cache, "BUILD_STATS", type(cache.BUILD_STATS)())  # the session's own
    yield
    cache._SAID.clear()


def _refused_twice(dc, calls, match: str, key: str = "k1") -> None:
    """Two calls: each compiles in memory, the first one warns (naming ``match``), the
    second is silent."""
    with pytest.warns(CacheWarning, match=match):
        assert get(dc, calls, key)[1] == "built-uncached"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get(dc, calls, key)[1] == "built-uncached"


@pytest.mark.parametrize("mode, who", [(0o770, "its group"), (0o707, "others"),
                                       (0o777, "its group and others")])
def test_a_directory_others_can_write_is_refused(tmp_path, mode, who):
    root = tmp_path / "cache"
    get(DiskCache(root, "fp"), Calls())  # a good entry, stored before the chmod
    root.chmod(mode)
    calls = Calls()
    _refused_twice(DiskCache(root, "fp"), calls, f"refusing {root}: it is writable by {who} "
                   rf"\(mode {mode:o}\).*compiling in memory only")
    assert calls.built == 2  # the entry there was not loaded
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        assert get(DiskCache(root, "fp"), calls, "k2")[1] == "built-uncached"
    assert not (root / "k2").exists() and not (root / "k2.lock").exists()  # nothing stored


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    get(DiskCache(root, "fp"), Calls())
    me = os.getuid()
    monkeypatch.setattr(cache.os, "getuid", lambda: me + 1)
    calls = Calls()
    _refused_twice(DiskCache(root, "fp"), calls, rf"owned by uid {me}, not by the current "
                   rf"user \(uid {me + 1}\)")
    assert calls.built == 2


@pytest.mark.parametrize("what", ["entry", OBJECT, META])
def test_an_entry_others_can_write_is_refused_and_left(tmp_path, what):
    """An entry (its folder, its object or the meta.json holding the object's SHA-256)
    that others can write: neither loaded nor replaced."""
    calls = Calls()
    get(DiskCache(tmp_path, "fp"), calls)
    target = tmp_path / "k1" if what == "entry" else tmp_path / "k1" / what
    target.chmod(target.stat().st_mode | 0o022)
    before = {p.name: p.read_bytes() for p in (tmp_path / "k1").iterdir()}
    _refused_twice(DiskCache(tmp_path, "fp"), calls, f"refusing {target}: it is writable")
    assert calls.built == 3
    assert {p.name: p.read_bytes() for p in (tmp_path / "k1").iterdir()} == before
    assert get(DiskCache(tmp_path, "fp"), calls, "k2")[1] == "built"  # other keys are fine


def test_an_entry_file_of_another_user_is_refused(tmp_path, monkeypatch):
    """meta.json owned by someone else (the stat result faked)."""
    calls = Calls()
    get(DiskCache(tmp_path, "fp"), calls)
    real = os.stat

    def stat(path, *args, **kwargs):
        st = real(path, *args, **kwargs)
        if Path(path).name != META:
            return st
        fields = list(st[:10])
        fields[4] = os.getuid() + 7  # st_uid
        return os.stat_result(fields)

    monkeypatch.setattr(cache.os, "stat", stat)
    _refused_twice(DiskCache(tmp_path, "fp"), calls, f"refusing {tmp_path / 'k1' / META}: "
                   f"it is owned by uid {os.getuid() + 7}")


def test_what_the_cache_makes_only_its_owner_writes(tmp_path):
    """Under a umask that lets everyone write, the cache's directory and its entries
    still come out writable by the owner only, and load again."""
    root = tmp_path / "a" / "cache"
    old = os.umask(0)
    try:
        calls = Calls()
        assert get(DiskCache(root, "fp"), calls)[1] == "built"
    finally:
        os.umask(old)
    for p in [root, root / "k1", *(root / "k1").iterdir()]:
        assert cache.untrusted(p) is None, p
    assert root.stat().st_mode & 0o777 == 0o700
    assert get(DiskCache(root, "fp"), calls)[1] == "loaded" and calls.built == 1


def test_the_build_cache_refuses_too(tmp_path):
    """The build cache (cubins and PTX of cross-compiles) keeps the same rule: its
    fingerprint folder writable by others -> built, the products still delivered."""
    bc = BuildCache(tmp_path, "f" * 64)

    def build(d: Path):
        (d / "k.cubin").write_bytes(b"cubin")
        return "result", {"fact": 1}

    assert bc.fetch("k", tmp_path / "out1", build)[2] == "built"
    bc.root.chmod(0o777)
    with pytest.warns(CacheWarning, match="refusing"):
        result, facts, how = bc.fetch("k", tmp_path / "out2", build)
    assert (result, facts, how) == ("result", {"fact": 1}, "built-uncached")
    assert (tmp_path / "out2" / "k.cubin").read_bytes() == b"cubin"
