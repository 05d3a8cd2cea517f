#!/usr/bin/env bash
# The one script a GPU session runs (see bench/README.md, "CUDA"): builds fantai with the CUDA
# backend into a fresh venv (system site packages: torch, transformers, pybind11, scikit-build-core,
# cmake, ninja must already be installed; nothing is downloaded), runs the CUDA C++ and Python
# tests, then prints the kernel and end-to-end figures and a summary. Budget: under 8 minutes.
#
#   bash bench/gpu_check.sh            # logs and the summary under build/gpu_check/
#   FANTAI_GPU_CHECK_VENV=.venv FANTAI_GPU_CHECK_BUILD_S=3000 bash bench/gpu_check.sh   # dry run here
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${FANTAI_GPU_CHECK_DIR:-$ROOT/build/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

note() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$SUMMARY"; }
# step NAME TIMEOUT CMD...: runs one step with a time limit and its own log; never stops the script.
step() {
  local name="$1" limit="$2"
  shift 2
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
VENV="$OUT/venv"
if [[ -n "${FANTAI_GPU_CHECK_VENV:-}" ]]; then  # reuse an existing venv (dry runs on a dev machine)
  VENV="$FANTAI_GPU_CHECK_VENV"
else
  rm -rf "$VENV"
  "$PY" -m venv --system-site-packages "$VENV"
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# SASS for the H200 alone (the default build adds sm_80 and PTX: three times the compile); a dev
# machine's dry run on 2 cores needs more than the GPU machine's 420 s.
ARCHS="${FANTAI_GPU_CHECK_ARCHS:-90a-real}"
BUILD_S="${FANTAI_GPU_CHECK_BUILD_S:-420}"
note "building for CUDA architectures $ARCHS"
step build "$BUILD_S" "$VENV/bin/pip" install --no-build-isolation --no-deps -v "$ROOT" \
  -C cmake.define.FANTAI_CUDA=ON -C cmake.define.FANTAI_BUILD_TESTS=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS" \
  -C build-dir="$OUT/wheel"
if [[ $LAST_RC -ne 0 ]]; then
  note "retrying without the C++ tests (GoogleTest missing? run bench/gpu_deps.sh and carry .gpu_deps)"
  step build_no_tests "$BUILD_S" "$VENV/bin/pip" install --no-build-isolation --no-deps -v "$ROOT" \
    -C cmake.define.FANTAI_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS" -C build-dir="$OUT/wheel"
fi
LIBDIR="$("$VENV/bin/python" -c 'import fantai, os; print(os.path.join(os.path.dirname(fantai.__file__), "lib"))' 2>/dev/null || true)"
if [[ ! -x "$OUT/wheel/bench/bench_cuda" && -n "$LIBDIR" ]]; then  # bench only: host code, seconds
  step build_bench 120 nvcc -std=c++17 -O2 -I"$ROOT/cpp" -I"$ROOT" "$ROOT/bench/bench_cuda.cu" \
    -L"$LIBDIR" -lengine -Xlinker -rpath="$LIBDIR" -o "$OUT/bench_cuda"
fi
if ! "$VENV/bin/python" -c "import fantai._C as c; assert 'cuda' in c.available_backends(), c.available_backends()" \
    > "$OUT/import.log" 2>&1; then
  note "fantai with a usable cuda backend did not import: $(tail -n 3 "$OUT/import.log" | tr '\n' ' ')"
fi

# GPU tensor parallelism needs nccl.h at build time (cmake/FantaiNccl.cmake: FANTAI_NCCL_ROOT, or the
# nvidia-nccl-cu13 wheel where the venv's Python imports nvidia.nccl from, e.g. beside torch) and
# libnccl at run time: both libraries are opened on first use, which these lines do, so a build
# that has them but cannot open them says so here.
note "nccl: $("$VENV/bin/python" -c "import fantai._C as c; print(c.nccl_unavailable_reason() or 'built, opens')" 2>&1 | tail -1)"
note "cublas: $(grep -hoE "fantai: cuBLASLt[^(]*" "$OUT/build.log" "$OUT/build_no_tests.log" 2>/dev/null | tail -1)"
note "opened: $("$VENV/bin/python" -c "import fantai._C as c; print({k: v['version'] or v['error'] for k, v in c.cuda_library_versions().items()})" 2>&1 | tail -1)"

# ---- tests -------------------------------------------------------------------------------------
# The device top-k / top-p sampler against the CPU sampler on the same logits and uniforms, first
# and on its own so its verdict stands out (test_cuda_kernels below runs it again among the rest).
if [[ -x "$OUT/wheel/tests/cpp/test_cuda_kernels" ]]; then
  step test_device_sampler 60 "$OUT/wheel/tests/cpp/test_cuda_kernels" \
    --gtest_filter='CudaBackend.DeviceSampler*:CudaKernels.TopKTopP*'
else
  note "test_device_sampler: test_cuda_kernels not built"
fi
for t in test_cuda_kernels test_nccl; do
  if [[ -x "$OUT/wheel/tests/cpp/$t" ]]; then
    step "$t" 120 "$OUT/wheel/tests/cpp/$t"
  else
    note "$t: not built"
  fi
done
cd "$ROOT"
step test_cuda_py 240 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python/test_cuda.py
# The one-rank NCCL engine against the plain one (and TP = 2 over NCCL where two GPUs are).
step test_tp_nccl_py 180 "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python/test_tp_nccl.py

# ---- figures -----------------------------------------------------------------------------------
for b in "$OUT/wheel/bench/bench_cuda" "$OUT/bench_cuda"; do
  if [[ -x "$b" ]]; then
    step bench_cuda 90 "$b"
    break
  fi
done
step bench_cuda_e2e 240 "$VENV/bin/python" bench/bench_cuda_e2e.py --requests 512 --prompt-len 128 --output-len 128
# The same with the owned GEMMs for prefill (FANTAI_CUDA_GEMM=own): against the run above it shows
# what cuBLASLt buys where the build has it (test_cuda_kernels checks the two agree).
FANTAI_CUDA_GEMM=own step bench_cuda_e2e_own_gemm 180 "$VENV/bin/python" bench/bench_cuda_e2e.py \
  --requests 512 --prompt-len 128 --output-len 128 --skip-hf

# ---- summary -----------------------------------------------------------------------------------
{
  echo
  echo "==== gpu_check summary ($(( $(date +%s) - START ))s) ===="
  grep -hE "^\[ +(PASSED|FAILED|SKIPPED) +\]|^[0-9]+ (passed|failed)|passed|failed" \
    "$OUT/test_device_sampler.log" "$OUT/test_cuda_kernels.log" "$OUT/test_nccl.log" "$OUT/test_cuda_py.log" "$OUT/test_tp_nccl_py.log" 2>/dev/null | grep -vE "^\s*$" | tail -n 20 || true
  grep -hE "^[a-z0-9_]+: " "$OUT/bench_cuda.log" "$OUT/bench_cuda_e2e.log" 2>/dev/null || true
  echo "-- with FANTAI_CUDA_GEMM=own:"
  grep -hE "^[a-z0-9_]+: " "$OUT/bench_cuda_e2e_own_gemm.log" 2>/dev/null || true
} | tee -a "$SUMMARY"
note "done; summary in $SUMMARY"
