# fantai_find_wheel_lib: the header and library folder of an NVIDIA library shipped as a pip wheel
# (nvidia-nccl-cu13, nvidia-cublas), for code that compiles against the header and opens the
# library at run time (cuda/lazy_library.h): nothing is linked, the folder is baked in as the
# first place to open it from.
#
#   fantai_find_wheel_lib(<PREFIX> HEADER <file.h> NAMES <library names...>
#                         MODULES <python packages...> [HINTS <dirs...>])
#
# Looks in ${<PREFIX>_ROOT} (cache or environment) first, then wherever the build's Python
# imports each of MODULES from (a venv with system site packages may take torch's copy from
# outside it) and that Python's own site-packages, then HINTS, then the system paths. Sets
# <PREFIX>_INCLUDE_DIR (cached), <PREFIX>_LIBRARY (cached; NOTFOUND when only the header is there:
# the library is then looked up on the loader's path at run time), <PREFIX>_LIBRARY_DIR ("" then)
# and <PREFIX>_LOOKED (the places looked in, for messages; no semicolons, so it can go into a
# compile definition).
function(fantai_find_wheel_lib prefix)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "HEADER" "NAMES;MODULES;HINTS")
  set(hints "")
  if(${prefix}_ROOT)
    list(APPEND hints "${${prefix}_ROOT}")
  endif()
  # The interpreter the build serves (scikit-build-core passes it; a plain CMake run may name it
  # with -DPython_EXECUTABLE), so the wheel found is the one installed beside fantai.
  set(py "${Python_EXECUTABLE}")
  if(NOT py)
    find_package(Python COMPONENTS Interpreter QUIET)
    set(py "${Python_EXECUTABLE}")
  endif()
  if(py AND arg_MODULES)
    string(REPLACE ";" "', '" modules "${arg_MODULES}")
    execute_process(
      COMMAND "${py}" -c
              "import importlib.util as u, sysconfig\ns = []\nfor m in ('${modules}',):\n  try:\n    s += list(u.find_spec(m).submodule_search_locations)\n  except Exception:\n    pass\n  s += [sysconfig.get_paths()[k] + '/' + m.replace('.', '/') for k in ('purelib', 'platlib')]\nprint(';'.join(dict.fromkeys(s)))"
      OUTPUT_VARIABLE site OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    list(APPEND hints ${site})
  endif()
  list(APPEND hints ${arg_HINTS})
  find_path(${prefix}_INCLUDE_DIR ${arg_HEADER} HINTS ${hints} PATH_SUFFIXES include)
  # Wheels ship only the soname (libnccl.so.2, libcublasLt.so.13), no development link.
  find_library(${prefix}_LIBRARY NAMES ${arg_NAMES} HINTS ${hints} PATH_SUFFIXES lib lib64)
  set(libdir "")
  if(${prefix}_LIBRARY)
    get_filename_component(libdir "${${prefix}_LIBRARY}" DIRECTORY)
  endif()
  string(REPLACE ";" ", " looked "${hints}")
  set(${prefix}_LIBRARY_DIR "${libdir}" PARENT_SCOPE)
  set(${prefix}_LOOKED "${looked}" PARENT_SCOPE)
endfunction()
