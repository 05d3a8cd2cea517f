# cuBLASLt for linear() at prefill-sized row counts (cuda/cublas_gemm.cu); optional like NCCL:
# built only with the CUDA backend and when cublasLt.h is found (cmake/FantaiWheelLib.cmake:
# FANTAI_CUBLAS_ROOT, then wherever the build's Python imports the nvidia-cublas wheel from,
# nvidia/cu13 for CUDA 13 and nvidia/cublas before, then the toolkit), otherwise
# FANTAI_CUBLAS_REASON says why and linear() keeps the owned kernels. Compiled against the
# header, never linked: libcublasLt is opened at the first prefill-sized GEMM
# (FANTAI_CUBLASLT_LIBRARY at run time, else the folder found here, else the loader's path), so a
# process without a CUDA backend does not carry it (~100 MiB of RSS); where it does not open,
# linear() keeps the owned kernels with one warning.
option(FANTAI_CUBLAS "Use cuBLASLt for prefill GEMMs when cublasLt.h is found" ON)
set(FANTAI_CUBLAS_ROOT "$ENV{FANTAI_CUBLAS_ROOT}" CACHE PATH "Where cuBLAS's include/ and lib/ are")
set(FANTAI_WITH_CUBLAS OFF)
set(FANTAI_CUBLAS_REASON "")
if(NOT FANTAI_WITH_CUDA)
  set(FANTAI_CUBLAS_REASON "this build has no CUDA backend")
elseif(NOT FANTAI_CUBLAS)
  set(FANTAI_CUBLAS_REASON "this build was configured with FANTAI_CUBLAS=OFF")
else()
  fantai_find_wheel_lib(FANTAI_CUBLAS HEADER cublasLt.h NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
                        MODULES nvidia.cu13 nvidia.cublas
                        HINTS "${CUDAToolkit_LIBRARY_ROOT}" "${CUDAToolkit_TARGET_DIR}" ${CUDAToolkit_INCLUDE_DIRS}
                              ${CUDAToolkit_LIBRARY_DIR})
  if(NOT FANTAI_CUBLAS_INCLUDE_DIR)
    string(CONCAT FANTAI_CUBLAS_REASON
           "CMake found no cublasLt.h (looked in: ${FANTAI_CUBLAS_LOOKED} and the toolkit): "
           "pip install nvidia-cublas, or set FANTAI_CUBLAS_ROOT, then rebuild")
  else()
    set(FANTAI_WITH_CUBLAS ON)
  endif()
endif()

if(FANTAI_WITH_CUBLAS)
  # Only this file sees cuBLAS: the rest of the CUDA backend compiles the same without it.
  set_source_files_properties(cuda/cublas_gemm.cu PROPERTIES
    INCLUDE_DIRECTORIES "${FANTAI_CUBLAS_INCLUDE_DIR}"
    COMPILE_DEFINITIONS "FANTAI_WITH_CUBLAS;FANTAI_CUBLAS_LIBDIR=\"${FANTAI_CUBLAS_LIBRARY_DIR}\"")
  if(FANTAI_CUBLAS_LIBRARY_DIR)
    set(_fantai_cublas_from "${FANTAI_CUBLAS_LIBRARY_DIR}, then the loader's path")
  else()
    set(_fantai_cublas_from "the loader's path: no libcublasLt found at build time")
  endif()
  message(STATUS "fantai: cuBLASLt is built in, loaded at the first prefill GEMM "
                 "(headers: ${FANTAI_CUBLAS_INCLUDE_DIR}; library from FANTAI_CUBLASLT_LIBRARY, else "
                 "${_fantai_cublas_from}; FANTAI_CUDA_GEMM=own: not used)")
elseif(FANTAI_WITH_CUDA)
  set_source_files_properties(cuda/cublas_gemm.cu PROPERTIES
    COMPILE_DEFINITIONS "FANTAI_CUBLAS_MISSING_REASON=\"${FANTAI_CUBLAS_REASON}\"")
  message(STATUS "fantai: cuBLASLt is not used: ${FANTAI_CUBLAS_REASON}")
endif()
