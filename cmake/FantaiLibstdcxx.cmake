# A GCC toolchain without the unversioned libstdc++.so (only libstdc++.a and the runtime's
# libstdc++.so.6, as on some slim images: the GPU machines' is one) links the C++ runtime
# statically into libengine, _C and every binary, each exporting a copy of its symbols. Once a
# process also holds the shared runtime of another version (import torch, then fantai), the dynamic
# linker binds some of those symbols to one copy and some to the other, and the first formatted
# log line crashes inside std::locale. So where g++ finds no libstdc++.so, this gives the linker
# one: a link in the build tree to the runtime's libstdc++.so.6, searched first. Everything then
# links the one shared runtime, as on any full toolchain. FANTAI_LIBSTDCXX_LINK=ON forces it (tests).
option(FANTAI_LIBSTDCXX_LINK "Link a libstdc++.so into the build tree even when the compiler has one" OFF)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE _fantai_stdcxx_so OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(FANTAI_LIBSTDCXX_LINK OR NOT IS_ABSOLUTE "${_fantai_stdcxx_so}")
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
                    OUTPUT_VARIABLE _fantai_stdcxx_so6 OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT IS_ABSOLUTE "${_fantai_stdcxx_so6}")
      # (Its own result variable: find_file skips the search for one that already holds a value.)
      find_file(FANTAI_LIBSTDCXX_SO6 libstdc++.so.6 PATHS /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib
                NO_DEFAULT_PATH)
      set(_fantai_stdcxx_so6 "${FANTAI_LIBSTDCXX_SO6}")
    endif()
    if(IS_ABSOLUTE "${_fantai_stdcxx_so6}" AND EXISTS "${_fantai_stdcxx_so6}")
      set(_fantai_stdcxx_dir "${CMAKE_BINARY_DIR}/fantai-libstdcxx")
      file(MAKE_DIRECTORY "${_fantai_stdcxx_dir}")
      file(CREATE_LINK "${_fantai_stdcxx_so6}" "${_fantai_stdcxx_dir}/libstdc++.so" SYMBOLIC)
      add_link_options("-L${_fantai_stdcxx_dir}")
      message(STATUS "fantai: linking the shared C++ runtime ${_fantai_stdcxx_so6} through "
                     "${_fantai_stdcxx_dir} (g++ offers: ${_fantai_stdcxx_so})")
    else()
      # The static runtime then stays private to each binary instead of being half-interposed.
      add_link_options("-Wl,--exclude-libs,libstdc++.a")
      message(WARNING "fantai: ${CMAKE_CXX_COMPILER} has no libstdc++.so and no libstdc++.so.6 was found: "
                      "the C++ runtime is linked statically into each binary, kept private to it")
    endif()
  endif()
endif()
