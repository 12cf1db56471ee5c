# BlockStore tests (kvkit/store/): the format + in-memory connector test, and the Redis
# backend test when the kvkit::redis component exists. zstd payloads are tested when the
# kvkit::zstd component exists (libzstd found; it adds KVKIT_HAS_ZSTD=1), else the raw path only.
kvkit_add_test(test_block_store test_block_store.cpp)
if(TARGET kvkit::zstd)
  target_link_libraries(test_block_store PRIVATE kvkit::zstd)
endif()
if(TARGET kvkit::redis AND EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/test_redis_store.cpp)
  kvkit_add_test(test_redis_store test_redis_store.cpp)
  target_link_libraries(test_redis_store PRIVATE kvkit::redis)
  if(TARGET kvkit::zstd)
    target_link_libraries(test_redis_store PRIVATE kvkit::zstd)
  endif()
endif()
# The store-demo workload and the engine's StoreConnector (examples/cli/store_demo.hpp,
# examples/engine/store_connector.hpp); its Redis case when kvkit::redis exists.
if(TARGET kvkit_example_engine)
  kvkit_add_test(test_store_demo test_store_demo.cpp)
  target_link_libraries(test_store_demo PRIVATE kvkit_example_engine)
  if(TARGET kvkit::redis)
    target_link_libraries(test_store_demo PRIVATE kvkit::redis)
    target_compile_definitions(test_store_demo PRIVATE KVKIT_TEST_REDIS=1)
  endif()
endif()
# `kvkit store-demo` as a subprocess: memory, a private redis-server and a private 3-master
# Redis Cluster give the same numbers (tests/test_cli_store_demo.cpp).
if(TARGET kvkit_cli AND TARGET kvkit::redis)
  find_package(nlohmann_json 3 CONFIG REQUIRED)  # found for kvkit_cli already
  kvkit_add_test(test_cli_store_demo test_cli_store_demo.cpp)
  target_link_libraries(test_cli_store_demo PRIVATE kvkit::redis nlohmann_json::nlohmann_json)
  target_compile_definitions(test_cli_store_demo PRIVATE KVKIT_CLI_PATH="$<TARGET_FILE:kvkit_cli>")
  add_dependencies(test_cli_store_demo kvkit_cli)
endif()
