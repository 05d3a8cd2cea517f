# NCCL carries tensor parallelism between GPU ranks; optional like MPI: built only with the CUDA
# backend and when nccl.h is found (cmake/FantaiWheelLib.cmake: FANTAI_NCCL_ROOT, then the build
# Python's nvidia-nccl-cu13 wheel, nvidia/nccl/{include,lib}, then the system paths), otherwise
# FANTAI_NCCL_REASON says why (and a CUDA device with tensor_parallel_size > 1 repeats it).
# Compiled against the header, never linked: cuda_backend_nccl.cu opens libnccl.so.2 when the
# first communicator is made (FANTAI_NCCL_LIBRARY at run time, else the folder found here, else
# the loader's path), so a process that never joins GPUs does not carry it (~70 MiB of RSS).
# Sets FANTAI_WITH_NCCL, FANTAI_NCCL_REASON, FANTAI_NCCL_INCLUDE_DIR, FANTAI_NCCL_LIBRARY_DIR.
option(FANTAI_NCCL "Build the NCCL communicator (GPU tensor parallelism) when nccl.h is found" ON)
set(FANTAI_NCCL_ROOT "$ENV{FANTAI_NCCL_ROOT}" CACHE PATH "Where NCCL's include/ and lib/ are")
set(FANTAI_WITH_NCCL OFF)
set(FANTAI_NCCL_REASON "")
if(NOT FANTAI_WITH_CUDA)
  set(FANTAI_NCCL_REASON "this build has no CUDA backend")
elseif(NOT FANTAI_NCCL)
  set(FANTAI_NCCL_REASON "this build was configured with FANTAI_NCCL=OFF")
else()
  fantai_find_wheel_lib(FANTAI_NCCL HEADER nccl.h NAMES nccl libnccl.so.2 MODULES nvidia.nccl)
  if(NOT FANTAI_NCCL_INCLUDE_DIR)
    # The remedy travels with the reason: the registry and tp_launch print it as is. No semicolon
    # in it: the list separator would split the compile definition that carries it.
    string(CONCAT FANTAI_NCCL_REASON
           "CMake found no NCCL at build time (looked in: ${FANTAI_NCCL_LOOKED} and the system paths): "
           "pip install nvidia-nccl-cu13 into the Python that builds fantai, or set FANTAI_NCCL_ROOT, "
           "then rebuild")
  else()
    file(STRINGS "${FANTAI_NCCL_INCLUDE_DIR}/nccl.h" _fantai_nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
    string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3"
           FANTAI_NCCL_VERSION "${_fantai_nccl_ver}")
    # Non-blocking communicators (ncclConfig_t.blocking) and ncclCommGetAsyncError polling.
    if(FANTAI_NCCL_VERSION VERSION_LESS 2.18)
      set(FANTAI_NCCL_REASON "NCCL ${FANTAI_NCCL_VERSION} at ${FANTAI_NCCL_INCLUDE_DIR} is older than 2.18")
    else()
      set(FANTAI_WITH_NCCL ON)
    endif()
  endif()
endif()

# Only these two files see the result, so turning NCCL on or off recompiles two files, not the
# engine: the communicator itself (the one file that includes nccl.h) and the registry that
# wires it up and reports the reason.
if(FANTAI_WITH_NCCL)
  set_source_files_properties(cuda/cuda_backend_nccl.cu PROPERTIES
    INCLUDE_DIRECTORIES "${FANTAI_NCCL_INCLUDE_DIR}"
    COMPILE_DEFINITIONS "FANTAI_WITH_NCCL;FANTAI_NCCL_LIBDIR=\"${FANTAI_NCCL_LIBRARY_DIR}\"")
  set_source_files_properties(cpp/backend/registry.cpp PROPERTIES COMPILE_DEFINITIONS "FANTAI_WITH_NCCL")
  if(FANTAI_NCCL_LIBRARY_DIR)
    set(_fantai_nccl_from "${FANTAI_NCCL_LIBRARY_DIR}, then the loader's path")
  else()
    set(_fantai_nccl_from "the loader's path: no libnccl.so.2 found at build time")
  endif()
  message(STATUS "fantai: NCCL ${FANTAI_NCCL_VERSION} is built in, loaded when a communicator is made "
                 "(headers: ${FANTAI_NCCL_INCLUDE_DIR}; library from FANTAI_NCCL_LIBRARY, else ${_fantai_nccl_from})")
else()
  set_source_files_properties(cpp/backend/registry.cpp PROPERTIES
    COMPILE_DEFINITIONS "FANTAI_NCCL_MISSING_REASON=\"${FANTAI_NCCL_REASON}\"")
  if(FANTAI_WITH_CUDA)
    message(STATUS "fantai: GPU tensor parallelism (NCCL) is not built: ${FANTAI_NCCL_REASON}")
  endif()
endif()
