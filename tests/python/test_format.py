"""Formatting: every tracked C, C++ and CUDA file is as clang-format (the repo's .clang-format, the
version requirements-dev.txt pins) would write it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")


def clang_format() -> str | None:
    # The venv's pinned binary first: `.venv/bin/python -m pytest` does not put .venv/bin on PATH,
    # and another version on PATH may format differently.
    beside = Path(sys.executable).parent / "clang-format"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("clang-format")


def tracked_sources() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sorted(p for p in out.decode().split("\0") if p.endswith(SUFFIXES))


def test_sources_are_clang_formatted() -> None:
    binary = clang_format()
    if binary is None:
        pytest.skip("clang-format is not installed (pip install -r requirements-dev.txt)")
    files = tracked_sources()
    assert files, "git ls-files found no C/C++/CUDA sources"
    assert (ROOT / ".clang-format").is_file()
    res = subprocess.run([binary, "--dry-run", "-Werror", "--style=file", *files], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    if res.returncode == 0:
        return
    # "path:line:col: error: code should be clang-formatted" per changed spot; one line per file.
    spots: dict[str, int] = {}
    for m in re.finditer(r"^(\S+?):\d+:\d+: error:", res.stderr, re.MULTILINE):
        spots[m.group(1)] = spots.get(m.group(1), 0) + 1
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
    listing = "\n".join(f"  {n:5d}  {path}" for path, n in sorted(spots.items(), key=lambda x: -x[1]))
    pytest.fail(f"{len(spots)} files differ from `{binary} -i --style=file` ({version}); spots per "
                f"file:\n{listing or res.stderr[-3000:]}\nfix with: clang-format -i <files>",
                pytrace=False)
