#!/usr/bin/env bash
# Run on a development machine before a GPU session: copies the two C++ build dependencies the
# GPU image lacks (nlohmann_json headers, GoogleTest) into .gpu_deps/ (git-ignored), so the
# session can carry it (run(..., carry=[".gpu_deps"])) and bench/gpu_check.sh finds it. ~2.5 MB.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.gpu_deps"
ARCH_LIB=/usr/lib/x86_64-linux-gnu
rm -rf "$DEST"
mkdir -p "$DEST/include" "$DEST/share/cmake" "$DEST/lib/x86_64-linux-gnu/cmake"
cp -r /usr/include/nlohmann "$DEST/include/"
cp -r /usr/share/cmake/nlohmann_json "$DEST/share/cmake/"
cp -r /usr/include/gtest "$DEST/include/"
cp -r "$ARCH_LIB/cmake/GTest" "$DEST/lib/x86_64-linux-gnu/cmake/"
cp "$ARCH_LIB"/libgtest.a "$ARCH_LIB"/libgtest_main.a "$DEST/lib/x86_64-linux-gnu/"
EXCLUDE="$(git -C "$ROOT" rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.gpu_deps/' "$EXCLUDE" 2>/dev/null || echo '/.gpu_deps/' >> "$EXCLUDE"
du -sh "$DEST"
