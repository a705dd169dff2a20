# LibTorch for the library side, and one precompiled header that every LibTorch target reuses.
find_package(Torch REQUIRED)
find_package(Threads REQUIRED)

# Debian's libtorch-dev (1.13) lacks torch/csrc/distributed/autograd/context/context.h, which
# c10d's reducer.hpp includes. Official LibTorch and pip wheels ship it; only when it is missing do
# we add a shim directory that declares the two names reducer.hpp uses.
set(CTORCH_NEED_AUTOGRAD_CONTEXT_SHIM OFF)
foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
  if(EXISTS "${dir}/torch/csrc/distributed/autograd/context/context.h")
    set(_ctorch_has_context ON)
  endif()
endforeach()
if(NOT _ctorch_has_context)
  set(CTORCH_NEED_AUTOGRAD_CONTEXT_SHIM ON)
  message(STATUS "ctorch: LibTorch lacks distributed/autograd/context/context.h; using the shim")
endif()

# Interface target carrying LibTorch and the shim include directory.
add_library(ctorch_torch_deps INTERFACE)
# Installed, it names no path of this machine's LibTorch: the package config adds the libraries
# of the Torch that find_dependency(Torch) finds on the user's machine (relocatable package).
target_link_libraries(ctorch_torch_deps INTERFACE "$<BUILD_INTERFACE:${TORCH_LIBRARIES}>" Threads::Threads)
# The C++ standard follows LibTorch: 2.x headers (2.14 refuses anything older) get C++20, 1.13 keeps
# C++17 (its headers predate C++20). Carried by every LibTorch target and by the installed package.
if(Torch_VERSION VERSION_GREATER_EQUAL 2.0)
  set(CTORCH_TORCH_CXX_STANDARD 20)
else()
  set(CTORCH_TORCH_CXX_STANDARD 17)
endif()
target_compile_features(ctorch_torch_deps INTERFACE cxx_std_${CTORCH_TORCH_CXX_STANDARD})
message(STATUS "ctorch: LibTorch ${Torch_VERSION}, C++${CTORCH_TORCH_CXX_STANDARD}")

# The release of a distribution's LibTorch, which its headers may not say (Debian's 1.13.1 calls
# itself 1.13.0 in torch/version.h, TorchConfigVersion.cmake and the library's file name): the
# version of the package that owns the library found, when dpkg knows it ("1.13.1+dfsg-4" from
# libtorch1.13). Empty for pytorch.org's zip or a pip wheel, whose headers are right.
set(CTORCH_TORCH_PACKAGE "")
find_program(CTORCH_DPKG_QUERY dpkg-query)
if(CTORCH_DPKG_QUERY AND TORCH_LIBRARY)
  get_filename_component(_ctorch_torch_lib "${TORCH_LIBRARY}" REALPATH)
  execute_process(COMMAND ${CTORCH_DPKG_QUERY} -S "${_ctorch_torch_lib}"
                  OUTPUT_VARIABLE _ctorch_owner ERROR_QUIET RESULT_VARIABLE _ctorch_rc TIMEOUT 20)
  if(_ctorch_rc EQUAL 0 AND _ctorch_owner MATCHES "^([^:, ]+(:[a-z0-9]+)?): ")
    set(_ctorch_pkg "${CMAKE_MATCH_1}")
    execute_process(COMMAND ${CTORCH_DPKG_QUERY} -W -f=\${Version} "${_ctorch_pkg}"
                    OUTPUT_VARIABLE _ctorch_pkg_version ERROR_QUIET RESULT_VARIABLE _ctorch_rc TIMEOUT 20)
    if(_ctorch_rc EQUAL 0 AND _ctorch_pkg_version MATCHES "^[0-9][0-9A-Za-z.+~:-]*$")
      string(REGEX REPLACE ":.*" "" _ctorch_pkg_name "${_ctorch_pkg}")
      set(CTORCH_TORCH_PACKAGE "${_ctorch_pkg_name} ${_ctorch_pkg_version}")
      message(STATUS "ctorch: LibTorch from the package ${CTORCH_TORCH_PACKAGE}")
    endif()
  endif()
endif()
if(CTORCH_NEED_AUTOGRAD_CONTEXT_SHIM)
  target_include_directories(ctorch_torch_deps INTERFACE
    $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/trainer/shim>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/ctorch/shim>)
endif()

include(CtorchNccl)
ctorch_find_nccl_headers()
if(CTORCH_NCCL_INCLUDE_DIR)
  target_include_directories(ctorch_torch_deps INTERFACE $<BUILD_INTERFACE:${CTORCH_NCCL_INCLUDE_DIR}>)
endif()
# The C++ ABI of LibTorch's std::string and lists: its TORCH_CXX_FLAGS carry it to the LibTorch
# targets only, so a LibTorch built with the old ABI (pip wheels before 2.7) needs it everywhere:
# pass -DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=0 (scripts/gpu/run.sh does, from torch itself).
if(TORCH_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0" AND NOT CMAKE_CXX_FLAGS MATCHES "_GLIBCXX_USE_CXX11_ABI=0")
  message(WARNING "ctorch: this LibTorch uses the old C++ ABI (_GLIBCXX_USE_CXX11_ABI=0): configure with "
                  "-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=0 so that every target agrees")
endif()

# The precompiled header: <torch/torch.h> plus the c10d headers the library uses. Targets call
# ctorch_use_torch_pch(<target>) to reuse it instead of parsing LibTorch again (~10-20 s per TU).
option(CTORCH_USE_PCH "Use a precompiled header for LibTorch" ON)
add_library(ctorch_torch_pch STATIC ${CMAKE_SOURCE_DIR}/cmake/pch_anchor.cpp)
target_link_libraries(ctorch_torch_pch PUBLIC ctorch_torch_deps)
if(CTORCH_USE_PCH)
  target_precompile_headers(ctorch_torch_pch PRIVATE ${CMAKE_SOURCE_DIR}/cmake/torch_pch.hpp)
endif()

function(ctorch_use_torch_pch target)
  target_link_libraries(${target} PRIVATE ctorch_torch_deps)
  if(CTORCH_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM ctorch_torch_pch)
  endif()
endfunction()
