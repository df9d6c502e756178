// What the fuzz targets share: a property check that fails the run like a crash does.
#pragma once

#include <cstdio>
#include <cstdlib>

// Aborts (libFuzzer then saves the input) when a property of the code under test is broken.
#define FUZZ_REQUIRE(cond)                                                                   \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: property broken: %s\n", __FILE__, __LINE__, #cond);     \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)
