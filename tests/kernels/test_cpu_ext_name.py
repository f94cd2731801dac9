"""The CPU ops' build folder is named by their source and flags: two checkouts of different
sources keep a folder each instead of rebuilding over each other at every start."""

from __future__ import annotations

import re
import subprocess
import sys

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


def test_build_loads_under_the_hashed_name(monkeypatch):
    """``_build`` asks torch for the folder and the library of this source's name."""
    import torch.utils.cpp_extension as ext

    seen: dict[str, str] = {}
    monkeypatch.setattr(
        ext, "_get_build_directory", lambda name, verbose: seen.setdefault("dir", name)
    )
    monkeypatch.setattr(cpu_ext, "clear_stale_lock", lambda d: False)

    class Stop(Exception):
        pass

    def fake_load(name, **kwargs):
        seen["load"] = name
        raise Stop

    monkeypatch.setattr(ext, "load", fake_load)
    try:
        cpu_ext._build(["-O3"], [])
    except Stop:
        pass
    assert seen == {"dir": cpu_ext.extension_name(["-O3"], []), "load": seen["dir"]}
