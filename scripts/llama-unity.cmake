# Included by scripts/build-llama-tools.sh into llama.cpp's CMake project (CMAKE_PROJECT_INCLUDE) for a
# unity build: sources compile in batches, so the big shared headers (nlohmann/json, httplib) are parsed
# a few times instead of once per file (measured: 659-693 s of compiler time instead of 883 s). These sources
# cannot share a batch, so they compile on their own (deferred: their targets do not exist yet here).
# json.cpp specializes templates that the other sources of its batch instantiate first.
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL set_source_files_properties
  ${CMAKE_SOURCE_DIR}/common/json.cpp DIRECTORY ${CMAKE_SOURCE_DIR}/common PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
# mtmd's public helpers refuse to compile beside mtmd's internal headers.
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL set_source_files_properties
  ${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper.cpp ${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper-gen.cpp
  DIRECTORY ${CMAKE_SOURCE_DIR}/tools/mtmd PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
