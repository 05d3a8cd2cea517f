# CUDA detection for FANTAI_CUDA=AUTO|ON|OFF. Included from the top directory because the CUDA
# language must be enabled in the directory that owns libengine (its sources include cuda/*.cu).
# Sets FANTAI_WITH_CUDA.
set(FANTAI_WITH_CUDA OFF)
string(TOUPPER "${FANTAI_CUDA}" _fantai_cuda)
if(NOT _fantai_cuda MATCHES "^(AUTO|ON|OFF|TRUE|FALSE|YES|NO|1|0)$")
  message(FATAL_ERROR "FANTAI_CUDA must be AUTO, ON or OFF (got '${FANTAI_CUDA}')")
endif()
if(_fantai_cuda MATCHES "^(AUTO|ON|TRUE|YES|1)$")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # SASS for Ampere (sm_80) and Hopper (sm_90a), PTX for sm_80 so newer GPUs JIT once; no JIT
    # at start-up on the two named architectures.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90a-real;80-virtual")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(FANTAI_WITH_CUDA ON)
    message(STATUS "fantai: CUDA backend ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(_fantai_cuda MATCHES "^(ON|TRUE|YES|1)$")
    message(FATAL_ERROR "FANTAI_CUDA=ON but no CUDA compiler was found (set CUDACXX or put nvcc on PATH)")
  else()
    message(STATUS "fantai: CUDA backend OFF (no nvcc found; FANTAI_CUDA=AUTO)")
  endif()
else()
  message(STATUS "fantai: CUDA backend OFF (FANTAI_CUDA=${FANTAI_CUDA})")
endif()
