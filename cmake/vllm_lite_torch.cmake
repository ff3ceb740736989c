# Finds libtorch for vllm_lite: used by this project's CMakeLists.txt and installed beside
# vllm_liteConfig.cmake, so the library and its consumers find torch the same way.
#
#   vllm_lite_find_torch(<with_cuda>)
#
# Torch's CMake package (share/cmake/Torch of the installed torch) looks for the CUDA
# toolkit whenever torch is a CUDA build, and fails without one. The CPU kernels need only
# libtorch_cpu and libc10, so with <with_cuda> false a CUDA toolkit is never needed: a
# placeholder torch::cudart target (the include guard of Caffe2's cuda.cmake) skips the
# CUDA search, and callers link torch_cpu_library, never the `torch` target. A project that
# wants torch's CUDA targets itself calls find_package(Torch) before find_package(vllm_lite).
#
# With <with_cuda> true the toolkit is the one CUDA_HOME names, else the one the nvcc on
# PATH really runs (nvcc may be a wrapper script elsewhere; its dry run prints the real
# location, as setup.py does), and VLLM_LITE_CUDA_HOME is set to it.
include_guard(GLOBAL)

# Sets <out> to the CUDA toolkit's root, or to "" when it has no bin/nvcc.
function(vllm_lite_cuda_home out)
  if(DEFINED ENV{CUDA_HOME} AND NOT "$ENV{CUDA_HOME}" STREQUAL "")
    set(home "$ENV{CUDA_HOME}")
    if(NOT EXISTS "${home}/bin/nvcc")
      set(home "")
    endif()
    set(${out} "${home}" PARENT_SCOPE)
    return()
  endif()
  find_program(VLLM_LITE_NVCC nvcc)
  if(NOT VLLM_LITE_NVCC)
    set(${out} "" PARENT_SCOPE)
    return()
  endif()
  execute_process(
    COMMAND "${VLLM_LITE_NVCC}" --dryrun -x cu -c /dev/null -o /dev/null
    OUTPUT_VARIABLE dry_out ERROR_VARIABLE dry_err TIMEOUT 60)
  if("${dry_out}${dry_err}" MATCHES "_HERE_=([^ \r\n]+)")
    get_filename_component(home "${CMAKE_MATCH_1}/.." REALPATH)
  else()
    get_filename_component(nvcc_real "${VLLM_LITE_NVCC}" REALPATH)
    get_filename_component(home "${nvcc_real}/../.." REALPATH)
  endif()
  if(NOT EXISTS "${home}/bin/nvcc")
    set(home "")
  endif()
  set(${out} "${home}" PARENT_SCOPE)
endfunction()

# Defines torch's imported targets (torch_cpu_library, c10, ...) unless they exist.
macro(vllm_lite_find_torch with_cuda)
  if(NOT TARGET torch_cpu)
    if(${with_cuda})
      vllm_lite_cuda_home(VLLM_LITE_CUDA_HOME)
      if(NOT VLLM_LITE_CUDA_HOME)
        message(FATAL_ERROR "vllm_lite: CUDA kernels need the CUDA toolkit: set CUDA_HOME or "
                            "put nvcc on PATH")
      endif()
      # For torch's FindCUDA, CUDAToolkit and enable_language(CUDA).
      set(CUDA_TOOLKIT_ROOT_DIR "${VLLM_LITE_CUDA_HOME}" CACHE PATH "CUDA toolkit")
      set(CUDAToolkit_ROOT "${VLLM_LITE_CUDA_HOME}")
      if(NOT CMAKE_CUDA_COMPILER)
        set(CMAKE_CUDA_COMPILER "${VLLM_LITE_CUDA_HOME}/bin/nvcc" CACHE FILEPATH "nvcc")
      endif()
    elseif(NOT TARGET torch::cudart)
      add_library(torch::cudart INTERFACE IMPORTED)
    endif()
    find_package(Torch REQUIRED)
    # Without MKL, torch's mkl.cmake still names ${MKL_ROOT}/lib/intel64 and the like as
    # link directories, which would end up in every RUNPATH: keep the ones that exist.
    if(TARGET caffe2::mkl)
      get_target_property(_vllm_lite_dirs caffe2::mkl INTERFACE_LINK_DIRECTORIES)
      if(_vllm_lite_dirs)
        set(_vllm_lite_kept "")
        foreach(_vllm_lite_dir IN LISTS _vllm_lite_dirs)
          if(IS_DIRECTORY "${_vllm_lite_dir}")
            list(APPEND _vllm_lite_kept "${_vllm_lite_dir}")
          endif()
        endforeach()
        set_property(TARGET caffe2::mkl PROPERTY INTERFACE_LINK_DIRECTORIES "${_vllm_lite_kept}")
      endif()
    endif()
  endif()
endmacro()
