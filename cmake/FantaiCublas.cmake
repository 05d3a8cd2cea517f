# cuBLASLt for linear() at prefill-sized row counts (cuda/cublas_gemm.cu); optional like NCCL:
# built only with the CUDA backend and when cublasLt.h and libcublasLt are found, otherwise
# FANTAI_CUBLAS_REASON says why and linear() keeps the owned kernels. Looked up in
# FANTAI_CUBLAS_ROOT (cache or environment), then wherever the build's Python imports the
# nvidia-cublas wheel from (nvidia/cu13 for CUDA 13, nvidia/cublas before), then the toolkit.
option(FANTAI_CUBLAS "Use cuBLASLt for prefill GEMMs when it is found" ON)
set(FANTAI_CUBLAS_ROOT "$ENV{FANTAI_CUBLAS_ROOT}" CACHE PATH "Where cuBLAS's include/ and lib/ are")
set(FANTAI_WITH_CUBLAS OFF)
set(FANTAI_CUBLAS_REASON "")
if(NOT FANTAI_WITH_CUDA)
  set(FANTAI_CUBLAS_REASON "this build has no CUDA backend")
elseif(NOT FANTAI_CUBLAS)
  set(FANTAI_CUBLAS_REASON "this build was configured with FANTAI_CUBLAS=OFF")
else()
  set(_fantai_cublas_hints "")
  if(FANTAI_CUBLAS_ROOT)
    list(APPEND _fantai_cublas_hints "${FANTAI_CUBLAS_ROOT}")
  endif()
  set(_fantai_py "${Python_EXECUTABLE}")
  if(NOT _fantai_py)
    find_package(Python COMPONENTS Interpreter QUIET)
    set(_fantai_py "${Python_EXECUTABLE}")
  endif()
  if(_fantai_py)
    execute_process(
      COMMAND "${_fantai_py}" -c
              "import importlib.util as u\ns = []\nfor m in ('nvidia.cu13', 'nvidia.cublas'):\n  try:\n    s += list(u.find_spec(m).submodule_search_locations)\n  except Exception:\n    pass\nprint(';'.join(s))"
      OUTPUT_VARIABLE _fantai_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    list(APPEND _fantai_cublas_hints ${_fantai_site})
  endif()
  list(APPEND _fantai_cublas_hints "${CUDAToolkit_LIBRARY_ROOT}" "${CUDAToolkit_TARGET_DIR}")
  find_path(FANTAI_CUBLAS_INCLUDE_DIR cublasLt.h HINTS ${_fantai_cublas_hints} ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  # Wheels ship only the soname (libcublasLt.so.13), no development link.
  find_library(FANTAI_CUBLAS_LIBRARY NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
               HINTS ${_fantai_cublas_hints} ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  if(NOT FANTAI_CUBLAS_INCLUDE_DIR OR NOT FANTAI_CUBLAS_LIBRARY)
    string(REPLACE ";" ", " _fantai_looked "${_fantai_cublas_hints}")
    set(FANTAI_CUBLAS_REASON "CMake found no cuBLASLt (looked in: ${_fantai_looked} and the toolkit)")
  else()
    set(FANTAI_WITH_CUBLAS ON)
  endif()
endif()

if(FANTAI_WITH_CUBLAS)
  get_filename_component(_fantai_cublas_libdir "${FANTAI_CUBLAS_LIBRARY}" DIRECTORY)
  target_link_libraries(engine PRIVATE "${FANTAI_CUBLAS_LIBRARY}")
  # Only this file sees cuBLAS: the rest of the CUDA backend compiles the same without it.
  set_source_files_properties(cuda/cublas_gemm.cu PROPERTIES
    INCLUDE_DIRECTORIES "${FANTAI_CUBLAS_INCLUDE_DIR}" COMPILE_DEFINITIONS "FANTAI_WITH_CUBLAS")
  set_property(TARGET engine APPEND PROPERTY BUILD_RPATH "${_fantai_cublas_libdir}")
  set_property(TARGET engine APPEND PROPERTY INSTALL_RPATH "${_fantai_cublas_libdir}")
  message(STATUS "fantai: cuBLASLt found (${FANTAI_CUBLAS_LIBRARY}): prefill GEMMs use it (FANTAI_CUDA_GEMM=own: not)")
elseif(FANTAI_WITH_CUDA)
  message(STATUS "fantai: cuBLASLt is not used: ${FANTAI_CUBLAS_REASON} (pip install nvidia-cublas, or set FANTAI_CUBLAS_ROOT)")
endif()
