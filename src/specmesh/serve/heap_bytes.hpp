// How many bytes the process's allocator holds for the application: allocated and not yet
// freed. What a leak makes grow, unlike the resident set, which also counts the pages an
// allocator keeps after a free (jemalloc returns them over its decay time, a few at a time,
// and never those of a slab still partly in use).
#pragma once

#include <cstdint>
#include <optional>

namespace specmesh::serve {

// jemalloc's stats.allocated when jemalloc is the allocator (the CLI links it); glibc's
// mallinfo2() in-use bytes otherwise; nullopt when neither answers.
std::optional<uint64_t> heap_allocated_bytes();

}  // namespace specmesh::serve
