"""Kernel cache: content keys, hits without compiling, corrupt entries rebuilt, atomic writes."""

from __future__ import annotations

import os

import pytest

from mmad.backends.cache import KernelCache, default_cache_dir

KEY = dict(backend="vulkan", device="lavapipe", compiler="glslang 13", options=["-O"], source="void main(){}")


class FakeCompiler:
    def __init__(self):
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return os.urandom(64) + b"spirv"


def test_miss_then_hit_without_compiling(tmp_path):
    cache, compiler = KernelCache(tmp_path), FakeCompiler()
    first = cache.get_or_build(compiler, **KEY)
    second = KernelCache(tmp_path).get_or_build(compiler, **KEY)  # a new process would see the same
    assert first == second and compiler.calls == 1
    assert cache.stats.misses == 1


@pytest.mark.parametrize("part,value", [("backend", "cuda"), ("device", "sm_90a"), ("compiler", "glslang 14"),
                                        ("options", ["-O0"]), ("source", "void main(){ }")])
def test_every_key_part_changes_the_key(tmp_path, part, value):
    cache, compiler = KernelCache(tmp_path), FakeCompiler()
    cache.get_or_build(compiler, **KEY)
    cache.get_or_build(compiler, **{**KEY, part: value})
    assert compiler.calls == 2


def test_layout_version_is_part_of_the_key():
    assert KernelCache.key(**KEY)[0] != KernelCache.key(**KEY, layout_version=999)[0]


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_corrupt_entries_are_rebuilt(tmp_path, damage):
    cache, compiler = KernelCache(tmp_path), FakeCompiler()
    good = cache.get_or_build(compiler, **KEY)
    (entry,) = list(tmp_path.glob("*/*.bin"))
    raw = entry.read_bytes()
    entry.write_bytes({"truncate": raw[:-3], "flip": raw[:-1] + bytes([raw[-1] ^ 1]),
                       "header": b"{not json\n" + raw.split(b"\n", 1)[1], "empty": b""}[damage])
    rebuilt = cache.get_or_build(compiler, **KEY)
    assert compiler.calls == 2 and cache.stats.rebuilt_corrupt == 1
    assert rebuilt != good  # the fake compiler's output is random: it really ran again
    assert KernelCache(tmp_path).get_or_build(compiler, **KEY) == rebuilt and compiler.calls == 2


def test_writes_leave_no_temp_files_and_failed_builds_store_nothing(tmp_path):
    cache = KernelCache(tmp_path)
    cache.get_or_build(FakeCompiler(), **KEY)

    def broken() -> bytes:
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError):
        cache.get_or_build(broken, **{**KEY, "source": "other"})
    names = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert len(names) == 1 and not any(n.startswith(".tmp-") for n in names)


def test_directory_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MMAD_CACHE_DIR", str(tmp_path / "k"))
    assert default_cache_dir() == tmp_path / "k"
    KernelCache().get_or_build(FakeCompiler(), **KEY)
    assert len(list((tmp_path / "k").glob("*/*.bin"))) == 1
    assert KernelCache().clear() == 1


def test_concurrent_builds_of_one_entry_compile_once(tmp_path):
    """Threads asking for the same entry at once (variants sharing a module, compiled side by
    side): one compiles, the others wait and read its entry; other entries compile meanwhile."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started, release = threading.Event(), threading.Event()
    calls = []

    def slow_compiler() -> bytes:
        calls.append(threading.current_thread().name)
        started.set()
        release.wait(10)
        return b"cubin"

    with ThreadPoolExecutor(4) as pool:
        same = [pool.submit(KernelCache(tmp_path).get_or_build, slow_compiler, **KEY) for _ in range(3)]
        started.wait(10)
        other = KernelCache(tmp_path).get_or_build(FakeCompiler(), **{**KEY, "source": "other"})  # not held up
        release.set()
        assert [f.result(10) for f in same] == [b"cubin"] * 3
    assert len(calls) == 1 and other.endswith(b"spirv")


def test_a_failed_build_lets_a_waiting_thread_build_it_itself(tmp_path):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started, release = threading.Event(), threading.Event()

    def failing() -> bytes:
        started.set()
        release.wait(10)
        raise RuntimeError("compiler crashed")

    compiler = FakeCompiler()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(KernelCache(tmp_path).get_or_build, failing, **KEY)
        started.wait(10)
        second = pool.submit(KernelCache(tmp_path).get_or_build, compiler, **KEY)
        release.set()
        with pytest.raises(RuntimeError, match="compiler crashed"):
            first.result(10)
        assert second.result(10).endswith(b"spirv") and compiler.calls == 1


def test_build_all_runs_the_builds_side_by_side():
    import threading

    from mmad.backends.cache import build_all

    barrier = threading.Barrier(2, timeout=10)  # only passes when two builds run at once (COMPILE_THREADS >= 2)

    def build(i):
        barrier.wait()
        return i * i

    assert build_all({name: (lambda i=i: build(i)) for i, name in enumerate("ab")}) == {"a": 0, "b": 1}
    with pytest.raises(ZeroDivisionError):
        build_all({"ok": lambda: 1, "bad": lambda: 1 / 0})


def test_build_all_nested_in_a_compile_thread_runs_in_turn():
    """A build that itself builds several things (a backend compiling a model's kernels, inside the
    dispatcher's side-by-side compile) runs them on its own thread: never waiting on the pool."""
    import threading

    from mmad.backends.cache import COMPILE_THREADS, build_all

    def outer(i):
        inner = build_all({"a": lambda: threading.current_thread().name, "b": lambda: threading.current_thread().name})
        return i, inner["a"] == inner["b"] == threading.current_thread().name

    # more outer builds than compiler threads, each with inner ones: all end
    results = build_all({str(i): (lambda i=i: outer(i)) for i in range(2 * COMPILE_THREADS)})
    assert sorted(r[0] for r in results.values()) == list(range(2 * COMPILE_THREADS))
    assert all(r[1] for r in results.values())
