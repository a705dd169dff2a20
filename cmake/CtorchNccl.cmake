# <nccl.h> for CUDA builds of LibTorch with NCCL. Their torch_cuda target defines USE_C10D_NCCL, and
# c10d's ProcessGroupNCCL.hpp (which ctorch's headers include then) includes <nccl.h> -- which pip's
# torch keeps in a wheel of its own (site-packages/nvidia/nccl/include), outside TORCH_INCLUDE_DIRS.
# Looked for in CTORCH_NCCL_INCLUDE_DIR, $NCCL_INCLUDE_DIR, $NCCL_ROOT/include, the nvidia/nccl wheel
# beside torch, the CUDA toolkit and the system; a CUDA LibTorch whose nccl.h is nowhere is a clear
# configure error instead of a compile error in a LibTorch header. Used by the build and by the
# installed package config. Sets CTORCH_NCCL_INCLUDE_DIR (empty when LibTorch has no NCCL).
function(ctorch_find_nccl_headers)
  if(NOT TARGET torch_cuda)
    return()
  endif()
  get_target_property(_defs torch_cuda INTERFACE_COMPILE_DEFINITIONS)
  if(NOT _defs MATCHES "USE_C10D_NCCL")
    return()
  endif()
  set(_hints ${TORCH_INCLUDE_DIRS})
  if(DEFINED TORCH_INSTALL_PREFIX)
    # pip's layout: site-packages/torch beside site-packages/nvidia/nccl
    list(APPEND _hints "${TORCH_INSTALL_PREFIX}/../nvidia/nccl/include")
  endif()
  if(DEFINED CUDAToolkit_INCLUDE_DIRS)
    list(APPEND _hints ${CUDAToolkit_INCLUDE_DIRS})
  endif()
  find_path(CTORCH_NCCL_INCLUDE_DIR nccl.h
    HINTS ENV NCCL_INCLUDE_DIR ${_hints}
    PATHS ENV NCCL_ROOT
    PATH_SUFFIXES include
    DOC "directory of nccl.h (CUDA LibTorch with NCCL)")
  if(NOT CTORCH_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "ctorch: this LibTorch uses NCCL (USE_C10D_NCCL) but nccl.h was not found: "
                        "set -DCTORCH_NCCL_INCLUDE_DIR=<dir of nccl.h> (pip: site-packages/nvidia/nccl/include)")
  endif()
  message(STATUS "ctorch: nccl.h from ${CTORCH_NCCL_INCLUDE_DIR}")
endfunction()
