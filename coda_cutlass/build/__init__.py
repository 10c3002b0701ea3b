"""Building generated sources into shared libraries: toolchain discovery, the content-hash cache,
prebuilt lookup and nvcc runs with progress."""
