# NCCL carries tensor parallelism between GPU ranks; optional like MPI: built only with the CUDA
# backend and when NCCL's header and library are found, otherwise FANTAI_NCCL_REASON says why
# (and a CUDA device with tensor_parallel_size > 1 repeats it). Looked up in FANTAI_NCCL_ROOT
# (cache or environment) first, then in the build Python's site-packages, where the
# nvidia-nccl-cu13 wheel puts nvidia/nccl/{include,lib}, then the system paths.
# Sets FANTAI_WITH_NCCL, FANTAI_NCCL_REASON, FANTAI_NCCL_INCLUDE_DIR, FANTAI_NCCL_LIBRARY.
option(FANTAI_NCCL "Build the NCCL communicator (GPU tensor parallelism) when NCCL is found" ON)
set(FANTAI_NCCL_ROOT "$ENV{FANTAI_NCCL_ROOT}" CACHE PATH "Where NCCL's include/ and lib/ are")
set(FANTAI_WITH_NCCL OFF)
set(FANTAI_NCCL_REASON "")
if(NOT FANTAI_WITH_CUDA)
  set(FANTAI_NCCL_REASON "this build has no CUDA backend")
elseif(NOT FANTAI_NCCL)
  set(FANTAI_NCCL_REASON "this build was configured with FANTAI_NCCL=OFF")
else()
  set(_fantai_nccl_hints "")
  if(FANTAI_NCCL_ROOT)
    list(APPEND _fantai_nccl_hints "${FANTAI_NCCL_ROOT}")
  endif()
  # The interpreter the build serves (scikit-build-core passes it; a plain CMake run may name
  # it with -DPython_EXECUTABLE), so the wheel found is the one installed beside fantai.
  set(_fantai_py "${Python_EXECUTABLE}")
  if(NOT _fantai_py)
    find_package(Python COMPONENTS Interpreter QUIET)
    set(_fantai_py "${Python_EXECUTABLE}")
  endif()
  if(_fantai_py)
    execute_process(
      COMMAND "${_fantai_py}" -c
              "import importlib.util as u, sysconfig\ntry:\n  s = list(u.find_spec('nvidia.nccl').submodule_search_locations)\nexcept Exception:\n  s = []\ns += [sysconfig.get_paths()[k] + '/nvidia/nccl' for k in ('purelib', 'platlib')]\nprint(';'.join(dict.fromkeys(s)))"
      OUTPUT_VARIABLE _fantai_site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    # Wherever the interpreter imports nvidia.nccl from (a venv with system site packages may
    # take torch's copy from outside it), then its own site-packages.
    list(APPEND _fantai_nccl_hints ${_fantai_site})
  endif()
  find_path(FANTAI_NCCL_INCLUDE_DIR nccl.h HINTS ${_fantai_nccl_hints} PATH_SUFFIXES include)
  # The wheel ships only the soname (libnccl.so.2), no libnccl.so development link.
  find_library(FANTAI_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_fantai_nccl_hints}
               PATH_SUFFIXES lib lib64)
  if(NOT FANTAI_NCCL_INCLUDE_DIR OR NOT FANTAI_NCCL_LIBRARY)
    # A list's semicolons would split the compile definition that carries the reason.
    string(REPLACE ";" ", " _fantai_looked "${_fantai_nccl_hints}")
    set(FANTAI_NCCL_REASON "CMake found no NCCL at build time (looked in: ${_fantai_looked} and the system paths)")
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
  get_filename_component(_fantai_nccl_libdir "${FANTAI_NCCL_LIBRARY}" DIRECTORY)
  target_link_libraries(engine PRIVATE "${FANTAI_NCCL_LIBRARY}")
  set_source_files_properties(cuda/cuda_backend_nccl.cu PROPERTIES
    INCLUDE_DIRECTORIES "${FANTAI_NCCL_INCLUDE_DIR}" COMPILE_DEFINITIONS "FANTAI_WITH_NCCL")
  set_source_files_properties(cpp/backend/registry.cpp PROPERTIES COMPILE_DEFINITIONS "FANTAI_WITH_NCCL")
  # The wheel's lib folder is on no loader path: libengine (in the build tree and installed)
  # finds libnccl.so.2 where it was linked from.
  set_property(TARGET engine APPEND PROPERTY BUILD_RPATH "${_fantai_nccl_libdir}")
  set_property(TARGET engine APPEND PROPERTY INSTALL_RPATH "${_fantai_nccl_libdir}")
  message(STATUS "fantai: NCCL ${FANTAI_NCCL_VERSION} found (${FANTAI_NCCL_LIBRARY}): GPU tensor parallelism is built")
else()
  set_source_files_properties(cpp/backend/registry.cpp PROPERTIES
    COMPILE_DEFINITIONS "FANTAI_NCCL_MISSING_REASON=\"${FANTAI_NCCL_REASON}\"")
  if(FANTAI_WITH_CUDA)
    message(STATUS "fantai: GPU tensor parallelism (NCCL) is not built: ${FANTAI_NCCL_REASON} "
                   "(pip install nvidia-nccl-cu13, or set FANTAI_NCCL_ROOT)")
  endif()
endif()
