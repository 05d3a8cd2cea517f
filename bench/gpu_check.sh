#!/usr/bin/env bash
# The one script a GPU session runs (see bench/README.md, "CUDA"): builds fantai with the CUDA
# backend with the machine's own Python (torch, transformers, pybind11, scikit-build-core, cmake,
# ninja must already be installed; nothing is downloaded) into a private --target folder, runs the
# CUDA C++ and Python tests, then prints the kernel and end-to-end figures and a summary. Every step
# has its own limit and the whole run a deadline (FANTAI_GPU_CHECK_DEADLINE_S, default 450 s), so
# it always ends with its summary inside a device lease.
#
#   bash bench/gpu_check.sh            # logs and the summary under build/gpu_check/
#   PYTHON=.venv/bin/python FANTAI_GPU_CHECK_BUILD_S=3000 FANTAI_GPU_CHECK_DEADLINE_S=4000 \
#     bash bench/gpu_check.sh          # dry run of the plumbing on a machine without a GPU
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${FANTAI_GPU_CHECK_DIR:-$ROOT/build/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)
DEADLINE_S="${FANTAI_GPU_CHECK_DEADLINE_S:-450}"

note() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }
# step NAME TIMEOUT CMD...: runs one step with a time limit and its own log; never stops the script.
step() {
  local name="$1" limit="$2"
  shift 2
  # What is left before the deadline, less 20 s for the summary, caps every step's own limit.
  local left=$(( DEADLINE_S - ($(date +%s) - START) - 20 ))
  if (( left < 10 )); then
    note "$name: SKIPPED (the run's ${DEADLINE_S}s deadline is near)"
    LAST_RC=124
    return 0
  fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  local verdict="ok"
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    verdict="TIMEOUT after ${limit}s"
  elif [[ $rc -ne 0 ]]; then
    verdict="FAILED (rc $rc)"
  fi
  note "$name: $verdict in $(( $(date +%s) - t0 ))s (log: $OUT/$name.log)"
  tail -n 25 "$OUT/$name.log" | sed "s/^/    /" || true
  LAST_RC=$rc
  return 0
}
LAST_RC=0

note "host: $(hostname), $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
note "nvcc: $(command -v nvcc || echo none) $(nvcc --version 2>/dev/null | tail -1 || true)"
# The toolkit's runtime for the test and bench binaries (libengine itself carries an rpath).
if command -v nvcc > /dev/null; then
  CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}"
  export LD_LIBRARY_PATH="$CUDA_HOME/lib64:$CUDA_HOME/lib:$CUDA_HOME/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# ---- build -------------------------------------------------------------------------------------
# The GPU image has no nlohmann_json or GoogleTest: bench/gpu_deps.sh copies them into .gpu_deps
# on a development machine, and the session carries that folder.
if [[ -d "$ROOT/.gpu_deps" ]]; then
  export CMAKE_PREFIX_PATH="$ROOT/.gpu_deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  note "using C++ dependencies from $ROOT/.gpu_deps"
fi
# The GPU image's python3 is itself a venv (torch and the rest live in it): a venv made from it
# with --system-site-packages would see the base interpreter's packages, not those. So fantai is
# installed with that python3 into a private --target folder put first on PYTHONPATH; the image
# stays as it was (a dry run on a development machine leaves its venv as it was the same way).
PYRUN="$PY"
SITE="$OUT/site"
[[ -n "${FANTAI_GPU_CHECK_SKIP_BUILD:-}" ]] || rm -rf "$SITE"
INSTALL=("$PYRUN" -m pip install --no-build-isolation --no-deps -v --target "$SITE" "$ROOT")
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# SASS for the H200 alone (the default build adds sm_80 and PTX: three times the compile); a dev
# machine's dry run on 2 cores needs more than the GPU machine's 300 s.
ARCHS="${FANTAI_GPU_CHECK_ARCHS:-90a-real}"
BUILD_S="${FANTAI_GPU_CHECK_BUILD_S:-300}"
note "python: $PYRUN ($("$PYRUN" -c 'import sys; print(sys.version.split()[0], sys.prefix)' 2>&1))"
note "building for CUDA architectures $ARCHS"
# Only the targets this run uses: the CPU-only C++ tests compile the CPU kernels a second time.
# FANTAI_GPU_CHECK_SKIP_BUILD=1 reuses what an earlier run left in $OUT (site/, wheel/): a second
# run that changed only Python or the tests' inputs then spends no device time on the compile.
if [[ -n "${FANTAI_GPU_CHECK_SKIP_BUILD:-}" ]]; then
  note "build: skipped (FANTAI_GPU_CHECK_SKIP_BUILD), reusing $OUT"
  # The test binaries' rpath names the build tree where they were linked, which may be elsewhere.
  export LD_LIBRARY_PATH="$SITE/fantai/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  step build "$BUILD_S" "${INSTALL[@]}" \
    -C cmake.define.FANTAI_CUDA=ON -C cmake.define.FANTAI_BUILD_TESTS=ON \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS" \
    -C build.targets="_C;test_cuda_kernels;test_nccl;bench_cuda" -C build-dir="$OUT/wheel"
  # A build that ran out of time would only run out again.
  if [[ $LAST_RC -ne 0 && $LAST_RC -ne 124 && $LAST_RC -ne 137 ]]; then
    note "retrying without the C++ tests (GoogleTest missing? run bench/gpu_deps.sh and carry .gpu_deps)"
    step build_no_tests "$BUILD_S" "${INSTALL[@]}" \
      -C cmake.define.FANTAI_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS" -C build-dir="$OUT/wheel"
  fi
fi
LIBDIR="$("$PYRUN" -c 'import fantai, os; print(os.path.join(os.path.dirname(fantai.__file__), "lib"))' 2>/dev/null || true)"
note "fantai imports from: $("$PYRUN" -c 'import fantai; print(fantai.__file__)' 2>&1 | tail -1)"
# A C++ runtime linked statically (cmake/FantaiLibstdcxx.cmake) crashes once torch is imported.
if [[ -n "$LIBDIR" ]]; then
  note "libengine needs: $(readelf -d "$LIBDIR"/libengine.so.0 2>/dev/null | grep -o 'NEEDED.*' | grep -o '\[.*\]' | tr '\n' ' ')"
fi
if [[ ! -x "$OUT/wheel/bench/bench_cuda" && -n "$LIBDIR" ]]; then  # bench only: host code, seconds
  step build_bench 120 nvcc -std=c++17 -O2 -I"$ROOT/cpp" -I"$ROOT" "$ROOT/bench/bench_cuda.cu" \
    -L"$LIBDIR" -lengine -Xlinker -rpath="$LIBDIR" -o "$OUT/bench_cuda"
fi
if ! "$PYRUN" -c "import fantai._C as c; assert 'cuda' in c.available_backends(), c.available_backends()" \
    > "$OUT/import.log" 2>&1; then
  note "fantai with a usable cuda backend did not import: $(tail -n 3 "$OUT/import.log" | tr '\n' ' ')"
fi

# GPU tensor parallelism needs nccl.h at build time (cmake/FantaiNccl.cmake: FANTAI_NCCL_ROOT, or the
# nvidia-nccl-cu13 wheel where the build's Python imports nvidia.nccl from, e.g. beside torch) and
# libnccl at run time: both libraries are opened on first use, which these lines do, so a build
# that has them but cannot open them says so here.
note "nccl: $("$PYRUN" -c "import fantai._C as c; print(c.nccl_unavailable_reason() or 'built, opens')" 2>&1 | tail -1)"
note "cublas: $(grep -hoE "fantai: cuBLASLt[^(]*" "$OUT/build.log" "$OUT/build_no_tests.log" 2>/dev/null | tail -1)"
note "opened: $("$PYRUN" -c "import fantai._C as c; print({k: v['version'] or v['error'] for k, v in c.cuda_library_versions().items()})" 2>&1 | tail -1)"

# ---- tests -------------------------------------------------------------------------------------
# gtest_each BIN NAME: every test of BIN in its own process, so a kernel that faults (a sticky CUDA
# error ends the context) costs its own test, not every test after it. One log, one line a test.
gtest_each() {
  local bin="$1" name="$2" t failed=0 passed=0 skipped=0 rc
  local log="$OUT/$name.log" one="$OUT/$name.one"
  : > "$log"
  for t in $("$bin" --gtest_list_tests | awk '/^[^ ]/{suite=$1} /^  /{print suite $1}'); do
    rc=0
    timeout --kill-after=5 30 "$bin" --gtest_filter="$t" > "$one" 2>&1 || rc=$?
    cat "$one" >> "$log"
    if [[ $rc -eq 0 ]] && grep -q "^\[  SKIPPED \]" "$one"; then
      skipped=$((skipped + 1)); echo "[gtest_each] SKIPPED $t" >> "$log"
    elif [[ $rc -eq 0 ]]; then
      passed=$((passed + 1)); echo "[gtest_each] PASSED $t" >> "$log"
    else
      failed=$((failed + 1)); echo "[gtest_each] FAILED $t (rc $rc)" >> "$log"
      echo "$t" >> "$OUT/$name.failed"
    fi
  done
  echo "[gtest_each] $name: $passed passed, $failed failed, $skipped skipped" >> "$log"
  [[ $failed -eq 0 ]]
}
export -f gtest_each
export OUT
for t in test_cuda_kernels test_nccl; do
  rm -f "$OUT/$t.failed"
  if [[ -x "$OUT/wheel/tests/cpp/$t" ]]; then
    step "${t}_each" 150 bash -c "gtest_each '$OUT/wheel/tests/cpp/$t' '$t'"
    note "$(grep -h '^\[gtest_each\] [a-z_]*:' "$OUT/$t.log" || true)"
  else
    note "$t: not built"
  fi
done
cd "$ROOT"
# One test that hangs must not take the rest of the run with it.
step test_cuda_py 200 "$PYRUN" -m pytest -q -rs -p no:cacheprovider --timeout 90 tests/python/test_cuda.py
# The one-rank NCCL engine against the plain one (and TP = 2 over NCCL where two GPUs are).
step test_tp_nccl_py 90 "$PYRUN" -m pytest -q -rs -p no:cacheprovider --timeout 60 tests/python/test_tp_nccl.py

# ---- figures -----------------------------------------------------------------------------------
for b in "$OUT/wheel/bench/bench_cuda" "$OUT/bench_cuda"; do
  if [[ -x "$b" ]]; then
    step bench_cuda 90 "$b"
    break
  fi
done
step bench_cuda_e2e 150 "$PYRUN" bench/bench_cuda_e2e.py --requests 512 --prompt-len 128 --output-len 128
# The same with the owned GEMMs for prefill (FANTAI_CUDA_GEMM=own): against the run above it shows
# what cuBLASLt buys where the build has it (test_cuda_kernels checks the two agree).
FANTAI_CUDA_GEMM=own step bench_cuda_e2e_own_gemm 90 "$PYRUN" bench/bench_cuda_e2e.py \
  --requests 512 --prompt-len 128 --output-len 128 --skip-hf

# ---- what failed, under the memory checker ---------------------------------------------------------
# Where compute-sanitizer works (Firecracker machines), the failed kernel tests run again under it:
# an out-of-bounds access is then named with its kernel, not seen as a wrong number or a crash.
if command -v compute-sanitizer > /dev/null && [[ -s "$OUT/test_cuda_kernels.failed" ]]; then
  step sanitize_failed 90 compute-sanitizer --tool memcheck --print-limit 20 \
    "$OUT/wheel/tests/cpp/test_cuda_kernels" --gtest_filter="$(paste -sd: "$OUT/test_cuda_kernels.failed")"
fi

# ---- summary -----------------------------------------------------------------------------------
{
  echo
  echo "==== gpu_check summary ($(( $(date +%s) - START ))s) ===="
  grep -hE "^\[gtest_each\] (FAILED|[a-z_]+:)" "$OUT/test_cuda_kernels.log" "$OUT/test_nccl.log" 2>/dev/null || true
  grep -hE "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped)" "$OUT/test_cuda_py.log" "$OUT/test_tp_nccl_py.log" 2>/dev/null | tail -n 20 || true
  grep -hE "^[a-z0-9_]+: " "$OUT/bench_cuda.log" "$OUT/bench_cuda_e2e.log" 2>/dev/null || true
  echo "-- with FANTAI_CUDA_GEMM=own:"
  grep -hE "^[a-z0-9_]+: " "$OUT/bench_cuda_e2e_own_gemm.log" 2>/dev/null || true
} | tee -a "$SUMMARY"
note "done; summary in $SUMMARY"
