"""The one-way house: which room of the C++ core may include which (docs/DESIGN.md, "Rooms").

Every `#include "room/file.h"` in cpp/ and cuda/ is an arrow from the including file's room to
the included one. Arrows run down only: bindings > engine > {model, sampling} > backend > common,
with cpu/ and cuda/ implementing the backend seam below the model. Two rooms have a narrower rule:
the kernel files of cpu/ and cuda/ see plain data (common/) and their own room, never the
Backend class, and only the registry (backend/registry.cpp) may name the backends it creates.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# room -> rooms its files may include (its own room is always allowed)
ALLOWED = {
    "common": set(),
    "backend": {"common"},
    "cpu": {"common", "backend"},
    "cuda": {"common", "backend"},
    "model": {"common", "backend"},
    "sampling": {"common", "backend"},
    "engine": {"common", "backend", "model", "sampling"},
    "bindings": {"common", "backend", "model", "sampling", "engine"},
}
# The backend registry is the dispatch point that constructs the backends.
REGISTRY = {"cpp/backend/registry.cpp": {"cpu/cpu_backend.h", "cuda/cuda_backend.h"}}
# Files of cpu/ and cuda/ that are the backend class: cpu_backend*.{h,cpp} (the class and its rooms
# by op) and cuda_backend*.{h,cu} (the class and its NCCL communicator). The rest are kernels: no
# backend/ includes, no backend class header.
BACKEND_CLASS_FILE = re.compile(r"^(cpp/cpu/cpu_backend[a-z_]*|cuda/cuda_backend[a-z_]*)\.(h|cpp|cu)$")
BACKEND_CLASS_HEADERS = {
    "backend/backend.h",
    "backend/buffer.h",
    "cpu/cpu_backend.h",
    "cpu/cpu_backend_impl.h",
    "cuda/cuda_backend.h",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/([^"]+)"', re.M)
SOURCES = ("*.h", "*.cpp", "*.cu", "*.cuh")


def room_of(rel: str) -> str:
    parts = rel.split("/")
    return parts[0] if parts[0] == "cuda" else parts[1]


def source_files():
    for base in (ROOT / "cpp", ROOT / "cuda"):
        for pattern in SOURCES:
            yield from sorted(base.rglob(pattern))


def violations(rel: str, text: str) -> list:
    """Every include of `text` (the file at repo path `rel`) that breaks a rule, as messages."""
    room = room_of(rel)
    out = []
    for target_room, rest in INCLUDE.findall(text):
        target = f"{target_room}/{rest}"
        if target_room not in ALLOWED:
            continue  # not a room of the core (e.g. a third-party "nlohmann/json.hpp")
        if target in REGISTRY.get(rel, ()):
            continue
        is_class_file = BACKEND_CLASS_FILE.match(rel) is not None
        if room in ("cpu", "cuda") and not is_class_file and target in BACKEND_CLASS_HEADERS:
            out.append(f"{rel}: kernel file includes the backend class header {target}")
            continue
        if target_room != room and target_room not in ALLOWED[room]:
            out.append(f"{rel}: {room}/ may not include {target_room}/ ({target})")
    return out


def test_every_room_of_the_core_has_a_rule():
    rooms = {room_of(str(p.relative_to(ROOT))) for p in source_files()}
    assert rooms <= set(ALLOWED), f"rooms without a layering rule: {sorted(rooms - set(ALLOWED))}"
    assert len(rooms) >= 7  # the walk really found the tree


def test_includes_run_one_way():
    found = []
    checked = 0
    for path in source_files():
        rel = str(path.relative_to(ROOT))
        found += violations(rel, path.read_text(encoding="utf-8", errors="replace"))
        checked += 1
    assert checked > 50
    assert not found, "layering violations:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "rel, include, broken",
    [
        ("cpp/model/transformer.cpp", "engine/engine.h", True),  # model -> engine
        ("cpp/model/transformer.cpp", "cpu/kernels.h", True),  # model -> cpu
        ("cpp/sampling/sampler.cpp", "cpu/vt_avx2.h", True),  # sampling -> cpu
        ("cpp/cpu/kernels_impl.h", "backend/backend.h", True),  # kernels -> backend class
        ("cpp/cpu/attention_amx.cpp", "cpu/cpu_backend.h", True),
        ("cpp/bindings/module.cpp", "cpu/cpu_backend.h", True),  # bindings -> cpu
        ("cpp/common/types.cpp", "backend/backend.h", True),  # up from the ground floor
        ("cpp/backend/registry.cpp", "cpu/cpu_backend.h", False),  # the registry's own exception
        ("cpp/cpu/cpu_backend.cpp", "backend/backend.h", False),
        ("cpp/cpu/cpu_backend_linear.cpp", "cpu/cpu_backend_impl.h", False),
        ("cpp/cpu/qkernels_pack.cpp", "cpu/cpu_backend_impl.h", True),
        ("cpp/cpu/kernels.h", "common/op_types.h", False),
        ("cpp/engine/engine.cpp", "sampling/sampler.h", False),
        ("cpp/model/weights.cpp", "nlohmann/json.hpp", False),
    ],
)
def test_the_checker_sees_each_kind_of_arrow(rel, include, broken):
    got = violations(rel, f'#include "{include}"\n')
    assert bool(got) == broken, got
