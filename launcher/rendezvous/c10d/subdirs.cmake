# Included (OPTIONAL) by launcher/CMakeLists.txt: the multi-node pieces (the c10d dynamic
# rendezvous and the Slurm derivation), each in its own folder with its own CMakeLists.txt.
# A file, not a line there, because CMake needs one command per line.
foreach(d rendezvous/c10d slurm)
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/${d}/CMakeLists.txt)
    add_subdirectory(${d})
  endif()
endforeach()
