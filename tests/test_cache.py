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
def fresh_warnings(monkeypatch):
    cache._SAID.clear()
    monkeypatch.setattr(cache, "BUILD_STATS", type(cache.BUILD_STATS)())  # the session's own
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


# ----------------------------------------------------------------------------- build cache

class Builds:
    """A stand-in DSL build: writes a cubin and a PTX file into the directory it is given."""

    def __init__(self, tag: bytes = b"v1"):
        self.tag, self.built = tag, 0

    def __call__(self, d: Path):
        self.built += 1
        (d / "k.sm_120a.cubin").write_bytes(b"CUBIN" + self.tag)
        (d / "k.sm_120a.ptx").write_text("ptx " + self.tag.decode())
        return "compiled", {"smem_bytes": 1024}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_build_cache_builds_once_and_copies_the_products(tmp_path):
    b = Builds()
    res, facts, how = cache.BuildCache(tmp_path / "c", "fp").fetch("k", tmp_path / "d1", b)
    assert (res, facts, how, b.built) == ("compiled", {"smem_bytes": 1024}, "built", 1)
    res, facts, how = cache.BuildCache(tmp_path / "c", "fp").fetch("k", tmp_path / "d2", b)
    assert (res, facts, how, b.built) == (None, {"smem_bytes": 1024}, "loaded", 1)
    assert _files(tmp_path / "d1") == _files(tmp_path / "d2") == {
        "k.sm_120a.cubin": b"CUBINv1", "k.sm_120a.ptx": b"ptx v1"}
    # another fingerprint (a kernel module edited) is another folder: built again
    _, _, how = cache.BuildCache(tmp_path / "c", "fp2").fetch("k", tmp_path / "d3",
                                                              Builds(b"v2"))
    assert how == "built" and _files(tmp_path / "d3")["k.sm_120a.cubin"] == b"CUBINv2"


def test_build_cache_rebuilds_a_damaged_entry(tmp_path):
    b = Builds()
    bc = cache.BuildCache(tmp_path, "fp")
    bc.fetch("k", tmp_path / "d1", b)
    (bc.root / "k" / bc.object_name).write_bytes(b"PK garbage")
    with pytest.warns(CacheWarning, match="checksum mismatch"):
        _, _, how = bc.fetch("k", tmp_path / "d2", b)
    assert how == "built" and b.built == 2 and _files(tmp_path / "d2")["k.sm_120a.ptx"]


def test_build_cache_keeps_the_latest_fingerprints(monkeypatch, tmp_path):
    import time

    monkeypatch.setattr(cache, "KEEP_FINGERPRINTS", 4)
    base, now = tmp_path / "c", time.time()
    for i in range(6):
        cache.BuildCache(base, f"fp{i}").fetch("k", tmp_path / "out", Builds())
        os.utime(base / f"fp{i}", (now - 60 * (10 - i),) * 2)  # fp5 the most recent
    os.utime(base / "fp4", (now - 8 * 86400,) * 2)  # unused for 8 days: gone, though recent
    cache.BuildCache(base, "now").fetch("k", tmp_path / "out", Builds())
    assert sorted(p.name for p in base.iterdir()) == ["fp2", "fp3", "fp5", "now"]


def test_build_cache_env(monkeypatch, tmp_path):
    for off in ("", "0", "off"):
        monkeypatch.setenv(cache.BUILD_CACHE_ENV, off)
        assert cache.build_cache() is None
    monkeypatch.setenv(cache.BUILD_CACHE_ENV, str(tmp_path))
    bc = cache.build_cache()
    assert bc.base == tmp_path and bc.root == tmp_path / cache.kernel_fingerprint()[:16]


def test_kernel_sources_follow_the_kernels_imports():
    root = Path(cache.__file__).parent
    names = {p.relative_to(root).as_posix() for p in cache.kernel_sources()}
    assert {p.relative_to(root).as_posix() for p in (root / "kernels").glob("*.py")} <= names
    assert {"schedule.py", "plan.py", "targets.py", "nvfp4.py", "kernels/__init__.py"} <= names
    # no code generation there (the facade, the host and API layers above the kernels)
    assert not {"__init__.py", "compile.py", "cache.py", "api.py", "cli.py"} & names
    assert len(cache.kernel_fingerprint()) == 64
    # per kernel module: its own imports only, so editing one kernel keeps the others' builds
    def files(module):
        return {p.relative_to(root).as_posix() for p in cache.kernel_sources(module)}

    quant, sm120 = files("cute_fp4.kernels.quantize"), files("cute_fp4.kernels.sm120")
    assert "kernels/quantize.py" in quant and "kernels/sm120.py" not in quant
    assert {"kernels/sm120.py", "kernels/scheduler.py", "plan.py"} <= sm120
    assert "kernels/quantize.py" not in sm120
    assert (cache.kernel_fingerprint("cute_fp4.kernels.quantize")
            != cache.kernel_fingerprint("cute_fp4.kernels.sm120"))
    rel = Path("kernels/sm120.py")
    import ast

    tree = ast.parse("from .roles import x\nfrom ..plan import plan\nimport cute_fp4.nvfp4\n"
                     "from cute_fp4 import packed\nimport torch\n")
    got = [n for node in ast.walk(tree) for n in cache._imported(node, rel)]
    assert got == ["cute_fp4.kernels.roles", "cute_fp4.kernels.roles.x", "cute_fp4.plan",
                   "cute_fp4.plan.plan", "cute_fp4.nvfp4", "cute_fp4", "cute_fp4.packed"]


def test_tool_output_runs_once_per_content(monkeypatch, tmp_path):
    runs = []

    def run():
        runs.append(1)
        return f"sass {len(runs)}"

    f = tmp_path / "a.cubin"
    f.write_bytes(b"one")
    monkeypatch.setenv(cache.BUILD_CACHE_ENV, "0")
    assert cache.tool_output("cuobjdump", ("-sass",), f, run) == "sass 1"  # no cache: runs
    monkeypatch.setenv(cache.BUILD_CACHE_ENV, str(tmp_path / "c"))
    assert cache.tool_output("cuobjdump", ("-sass",), f, run) == "sass 2"
    assert cache.tool_output("cuobjdump", ("-sass",), f, run) == "sass 2"  # kept
    assert cache.tool_output("cuobjdump", ("-res-usage",), f, run) == "sass 3"  # other args
    f.write_bytes(b"two")
    assert cache.tool_output("cuobjdump", ("-sass",), f, run) == "sass 4"  # other content
    for memo in (tmp_path / "c").rglob("*.txt.gz"):
        memo.write_bytes(b"damaged")
    assert cache.tool_output("cuobjdump", ("-sass",), f, run) == "sass 5"


def test_cross_build_compiles_once_with_the_build_cache(monkeypatch, tmp_path):
    """A hit copies the products and restores what tracing set on the kernel object."""
    from cute_fp4.compile import cross_build

    class Kernel:
        def __init__(self):
            self.smem_bytes, self.tile = None, (128, 128)

    seen = []

    def compiler(kernel):
        def compile_fn(options):
            seen.append(options)
            kernel.smem_bytes, kernel.layout = 4096, object()  # what tracing sets
            d = options.split("--dump-dir ")[1] if "--dump-dir" in options else None
            if d:
                Path(d).mkdir(parents=True, exist_ok=True)
                (Path(d) / "k.cubin").write_bytes(b"CUBIN")
            return "compiled"
        return compile_fn

    def build(target, dump_dir, *key):
        k = Kernel()
        return cross_build(k, compiler(k), target, dump_dir, *key)[0], k

    monkeypatch.setenv(cache.BUILD_CACHE_ENV, "0")
    assert build("sm_120a", None, "s")[0] == "compiled"
    assert build("sm_120a", tmp_path / "a", "s")[0] == "compiled"
    assert seen == ["--gpu-arch sm_120a",
                    f"--gpu-arch sm_120a --keep-cubin --keep-ptx --dump-dir {tmp_path / 'a'}"]
    monkeypatch.setenv(cache.BUILD_CACHE_ENV, str(tmp_path / "c"))
    assert build("sm_120a", tmp_path / "b", "s")[0] == "compiled"
    compiled, k = build("sm_120a", tmp_path / "d", "s")
    assert compiled is None and k.smem_bytes == 4096 and not hasattr(k, "layout")
    assert (tmp_path / "d" / "k.cubin").read_bytes() == b"CUBIN"
    assert build("sm_90a", tmp_path / "e", "s")[0] == "compiled"  # another target
    assert build("sm_120a", tmp_path / "f", "t")[0] == "compiled"  # another schedule
    assert len(seen) == 5


def test_both_caches_are_keyed_by_the_dsl_release(monkeypatch, tmp_path):
    """The supported DSL releases (4.8.0, 4.8.1) never share an entry: the disk cache's
    source fingerprint and the build cache's folder (kernel fingerprint, through the
    toolchain) both change with the installed nvidia-cutlass-dsl."""
    from importlib import metadata

    class Dist:
        def __init__(self, name, version):
            self.metadata, self.version = {"Name": name}, version

    real_version, real_toolchain = metadata.version, cache.toolchain.__wrapped__
    got = {}
    for dsl in ("4.8.0", "4.8.1"):
        dists = [Dist("nvidia-cutlass-dsl", dsl), Dist("nvidia-cutlass-dsl-libs-base", dsl),
                 Dist("torch", "2.13.0")]
        monkeypatch.setattr(metadata, "version", lambda name, v=dsl: (
            v if name.startswith("nvidia-cutlass-dsl") else real_version(name)))
        monkeypatch.setattr(metadata, "distributions", lambda d=dists: iter(d))
        chain = real_toolchain()  # the cached functions keep the real values
        assert f"nvidia-cutlass-dsl={dsl}" in chain and "torch" not in chain
        monkeypatch.setattr(cache, "toolchain", lambda c=chain: c)
        fp = cache.kernel_fingerprint.__wrapped__("cute_fp4.kernels.sm120")
        got[dsl] = (cache.source_fingerprint.__wrapped__(), fp,
                    cache.BuildCache(tmp_path, fingerprint=fp).root)
    (src0, fp0, root0), (src1, fp1, root1) = got["4.8.0"], got["4.8.1"]
    assert src0 != src1 and fp0 != fp1 and root0 != root1
    assert root0.parent == root1.parent == tmp_path  # side by side in one build cache
