"""The CPU ops' build folder is named by their source and flags: two checkouts of different
sources keep a folder each instead of rebuilding over each other at every start, and two
checkouts of one source compile the folder's own copy of it, so they share one build."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from prefixgate.kernels import cpu_ext


def test_name_is_stable_for_one_source_and_flags(tmp_path):
    src = tmp_path / "cpu_ops.cpp"
    src.write_text("int f() { return 1; }\n")
    name = cpu_ext.extension_name(["-O3"], ["-fopenmp"], src)
    assert re.fullmatch(r"prefixgate_cpu_ops_[0-9a-f]{12}", name)
    assert cpu_ext.extension_name(["-O3"], ["-fopenmp"], src) == name
    # a copy of the same source elsewhere (another checkout) shares the build
    other = tmp_path / "other" / "cpu_ops.cpp"
    other.parent.mkdir()
    other.write_bytes(src.read_bytes())
    assert cpu_ext.extension_name(["-O3"], ["-fopenmp"], other) == name


def test_name_changes_with_the_source_and_the_flags(tmp_path):
    src = tmp_path / "cpu_ops.cpp"
    src.write_text("int f() { return 1; }\n")
    name = cpu_ext.extension_name(["-O3"], ["-fopenmp"], src)
    assert cpu_ext.extension_name(["-O2"], ["-fopenmp"], src) != name
    assert cpu_ext.extension_name(["-O3"], [], src) != name
    assert cpu_ext.extension_name(["-O3", "-fopenmp"], [], src) != name  # not a plain join
    src.write_text("int f() { return 2; }\n")
    assert cpu_ext.extension_name(["-O3"], ["-fopenmp"], src) != name


def test_the_default_name_is_this_checkouts_source_and_the_same_in_another_process():
    assert cpu_ext.EXTENSION_NAME == cpu_ext.extension_name(cpu_ext.CFLAGS, cpu_ext.LDFLAGS)
    assert cpu_ext.EXTENSION_NAME != "prefixgate_cpu_ops"  # the one folder every checkout shared
    serial = [f for f in cpu_ext.CFLAGS if f != "-fopenmp"]
    assert cpu_ext.extension_name(serial, []) != cpu_ext.EXTENSION_NAME
    code = "from prefixgate.kernels import cpu_ext; print(cpu_ext.EXTENSION_NAME)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == cpu_ext.EXTENSION_NAME


def test_build_loads_under_the_hashed_name_from_the_folders_copy(monkeypatch, tmp_path):
    """``_build`` asks torch for the folder and the library of this source's name, and
    compiles the folder's own copy of the source, not this checkout's path."""
    import torch.utils.cpp_extension as ext

    seen: dict[str, object] = {}

    def build_directory(name, verbose):
        seen["dir"] = name
        return str(tmp_path / name)

    monkeypatch.setattr(ext, "_get_build_directory", build_directory)
    monkeypatch.setattr(cpu_ext, "clear_stale_lock", lambda d: False)

    class Stop(Exception):
        pass

    def fake_load(name, sources, **kwargs):
        seen["load"] = name
        seen["sources"] = sources
        raise Stop

    monkeypatch.setattr(ext, "load", fake_load)
    with pytest.raises(Stop):
        cpu_ext._build(["-O3"], [])
    name = cpu_ext.extension_name(["-O3"], [])
    copy = tmp_path / name / "cpu_ops.cpp"
    assert seen == {"dir": name, "load": name, "sources": [str(copy)]}
    assert copy.read_bytes() == cpu_ext.SOURCE.read_bytes()


def test_two_checkouts_of_one_source_compile_the_same_path(tmp_path):
    """The fault: the folder is shared by name, but ninja's command named each checkout's own
    source path, so two checkouts of one source rebuilt over each other at every start. Both
    now compile the folder's copy, written once and never touched again (a newer file would
    make ninja rebuild)."""
    build_dir = tmp_path / "prefixgate_cpu_ops_x"
    a = tmp_path / "a" / "cpu_ops.cpp"
    b = tmp_path / "b" / "cpu_ops.cpp"
    for src in (a, b):
        src.parent.mkdir()
        src.write_text("int f() { return 1; }\n")
    first = cpu_ext.source_in(build_dir, a)
    stamp = first.stat().st_mtime_ns
    os.utime(first, ns=(stamp - 10**9, stamp - 10**9))  # older, as after a build
    stamp = first.stat().st_mtime_ns
    assert cpu_ext.source_in(build_dir, b) == first == build_dir / "cpu_ops.cpp"
    assert first.stat().st_mtime_ns == stamp  # equal bytes: not rewritten
    assert sorted(p.name for p in build_dir.iterdir()) == ["cpu_ops.cpp"]  # no temporary left
    # a stale or damaged copy is replaced with the source's bytes
    first.write_text("garbage")
    assert cpu_ext.source_in(build_dir, b).read_text() == "int f() { return 1; }\n"
