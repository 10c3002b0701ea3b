# Writes the metadata that coda_cutlass.build.prebuilt checks before using a prebuilt kernel.
file(SHA256 "${SO}" hash)
get_filename_component(key "${SO}" NAME_WE)
file(WRITE "${JSON}" "{\"source_key\": \"${key}\", \"so_sha256\": \"${hash}\"}\n")
