# Installs the library side as a CMake package a user's project consumes with
#   find_package(ctorch REQUIRED)
#   target_link_libraries(app PRIVATE ctorch::ctorch)
# The package re-finds Torch with find_dependency, so the user's Torch_DIR decides which LibTorch.
include(CMakePackageConfigHelpers)

set(_ctorch_export_targets ctorch_contract)
if(CTORCH_BUILD_TORCH)
  list(APPEND _ctorch_export_targets ctorch_torch_deps ctorch)
  foreach(t ctorch_models ctorch_data)
    if(TARGET ${t})
      list(APPEND _ctorch_export_targets ${t})
    endif()
  endforeach()
endif()
set_target_properties(ctorch_contract PROPERTIES EXPORT_NAME contract)
if(TARGET ctorch_torch_deps)
  set_target_properties(ctorch_torch_deps PROPERTIES EXPORT_NAME torch_deps)
endif()

install(TARGETS ${_ctorch_export_targets}
  EXPORT ctorchTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT ctorchTargets
  NAMESPACE ctorch::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ctorch)

configure_package_config_file(
  ${CMAKE_SOURCE_DIR}/cmake/ctorchConfig.cmake.in
  ${CMAKE_BINARY_DIR}/ctorchConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ctorch)
write_basic_package_version_file(
  ${CMAKE_BINARY_DIR}/ctorchConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${CMAKE_SOURCE_DIR}/cmake/CtorchNccl.cmake
  ${CMAKE_BINARY_DIR}/ctorchConfig.cmake
  ${CMAKE_BINARY_DIR}/ctorchConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ctorch)

# What a user reads: the license, README and docs/ (README's links into docs/ keep working), and the
# metrics plotter as a program. ctorch-train's --help finds the docs from its own path, so a moved
# prefix still points at them.
install(FILES ${CMAKE_SOURCE_DIR}/LICENSE ${CMAKE_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${CMAKE_SOURCE_DIR}/docs/ DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs FILES_MATCHING PATTERN "*.md")
install(PROGRAMS ${CMAKE_SOURCE_DIR}/scripts/plot_metrics.py DESTINATION ${CMAKE_INSTALL_BINDIR}
        RENAME ctorch-plot-metrics)
