"""Bytecode compiled ahead for installs that ship none (batchgen/bytecode.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchgen import bytecode

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def bare_package(tmp_path):
    """`bare_pkg` (a package with a submodule) and `bare_mod.py`, with no bytecode anywhere."""
    root = tmp_path / "src"
    (root / "bare_pkg").mkdir(parents=True)
    (root / "bare_pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "bare_pkg" / "sub.py").write_text("def f():\n    return 2\n")
    (root / "bare_mod.py").write_text("X = 3\n")
    manifest = tmp_path / "modules.txt"
    manifest.write_text("# a comment\nbare_pkg/__init__.py\nbare_pkg/sub.py\nbare_mod.py\n"
                        "bare_pkg/gone.py\nabsent_pkg/x.py\n")
    return root, manifest


def test_needs_compiling_only_where_python_may_not_write_and_none_ships(monkeypatch,
                                                                       bare_package):
    root, _ = bare_package
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert not bytecode.needs_compiling("bare_pkg")  # Python writes it on first import
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode.needs_compiling("bare_pkg")
    assert not bytecode.needs_compiling("no_such_package_here")
    monkeypatch.setattr(sys, "pycache_prefix", str(root / "cache"))
    assert not bytecode.needs_compiling("bare_pkg")  # a cache is set up already


def test_manifest_entries_resolve_in_order_and_skip_what_is_missing(monkeypatch, bare_package):
    root, manifest = bare_package
    monkeypatch.syspath_prepend(str(root))
    assert bytecode.manifest_sources(manifest) == [
        str(root / "bare_pkg" / "__init__.py"), str(root / "bare_pkg" / "sub.py"),
        str(root / "bare_mod.py")]


def test_shipped_manifest_names_this_installs_start_up_modules():
    sources = bytecode.manifest_sources(bytecode.MANIFEST)
    names = {os.path.relpath(s, REPO) for s in sources}
    assert {"batchgen/bench.py", "batchgen/runner/worker/worker.py"} <= names
    assert any(s.endswith(os.path.join("torch", "__init__.py")) for s in sources)


def test_a_start_without_bytecode_compiles_ahead_into_its_own_cache(tmp_path, bare_package):
    root, manifest = bare_package
    script = textwrap.dedent(f"""
        import json, os, sys
        from pathlib import Path
        from batchgen.bytecode import start_bytecode_compile
        process = start_bytecode_compile(manifest=Path({str(manifest)!r}), workers=2,
                                         probe="bare_pkg")
        assert process is not None
        assert process.wait() == 0
        import importlib.util
        ahead = [os.path.exists(importlib.util.cache_from_source(p)) for p in
                 ({str(root / "bare_pkg" / "sub.py")!r}, {str(root / "bare_mod.py")!r})]
        import bare_pkg.sub
        print(json.dumps([ahead, bare_pkg.sub.__cached__, os.environ["PYTHONPYCACHEPREFIX"]]))
    """)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", BATCHGEN_CACHE=str(tmp_path / "bg"),
               PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ahead, cached, prefix = json.loads(out.stdout)
    cache = str(tmp_path / "bg" / "bytecode")
    assert ahead == [True, True]  # compiled by the pool before anything imported them
    assert prefix == cache and cached.startswith(cache) and os.path.exists(cached)
    assert not list(root.rglob("__pycache__"))  # nothing written beside a source


def test_an_install_with_bytecode_is_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode.start_bytecode_compile() is None
    assert sys.pycache_prefix is None or "batchgen" not in sys.pycache_prefix


def test_fresh_bytecode_is_not_compiled_again(tmp_path, monkeypatch):
    source = tmp_path / "mod.py"
    source.write_text("A = 1\n")
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "cache"))
    cached = bytecode.importlib.util.cache_from_source(str(source))
    assert not bytecode._fresh(str(source), cached)
    bytecode._compile(str(source))
    assert bytecode._fresh(str(source), cached)
    first = os.stat(cached).st_mtime_ns
    bytecode._compile(str(source))
    assert os.stat(cached).st_mtime_ns == first  # left as it was
    source.write_text("A = 22\n")  # new size: the import would recompile it, so must we
    assert not bytecode._fresh(str(source), cached)


def test_one_compiler_per_cache_directory(tmp_path, bare_package, monkeypatch):
    import fcntl

    root, manifest = bare_package
    monkeypatch.syspath_prepend(str(root))
    target = tmp_path / "cache"
    target.mkdir()
    with open(target / "compile.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        bytecode.compile_all(str(target), manifest, 1)  # another start compiles: leave
        assert not list(target.rglob("*.pyc"))
    bytecode.compile_all(str(target), manifest, 1)
    assert len(list(target.rglob("*.pyc"))) == 3


def test_a_worker_under_a_started_cache_adds_to_it(tmp_path, monkeypatch):
    """A worker inherits the cache through PYTHONPYCACHEPREFIX: it starts no second compiler,
    and what it compiles itself it writes there, whatever PYTHONDONTWRITEBYTECODE says."""
    target = tmp_path / "cache"
    monkeypatch.setattr(sys, "pycache_prefix", str(target))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode.start_bytecode_compile(target=target) is None
    assert sys.dont_write_bytecode is False


def test_the_compiler_uses_the_cores_it_may_but_one_and_at_most_sixteen(monkeypatch):
    for cores, workers in ((1, 1), (2, 1), (8, 7), (128, bytecode.MAX_WORKERS)):
        monkeypatch.setattr(bytecode.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert bytecode.default_workers() == workers
