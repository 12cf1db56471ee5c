#pragma once
// kvkit's version, from the KVKIT_VERSION_{MAJOR,MINOR,PATCH} macros in core/config.hpp
// (kept equal to project(VERSION) in CMakeLists.txt; the packaging tests check it).
//   KVKIT_VERSION          "MAJOR.MINOR.PATCH" string literal
//   KVKIT_VERSION_NUMBER   MAJOR * 10000 + MINOR * 100 + PATCH, for #if comparisons

#include "kvkit/core/config.hpp"

#define KVKIT_DETAIL_STRINGIFY_(x) #x
#define KVKIT_DETAIL_STRINGIFY(x) KVKIT_DETAIL_STRINGIFY_(x)

#define KVKIT_VERSION                            \
  KVKIT_DETAIL_STRINGIFY(KVKIT_VERSION_MAJOR)    \
  "." KVKIT_DETAIL_STRINGIFY(KVKIT_VERSION_MINOR) \
  "." KVKIT_DETAIL_STRINGIFY(KVKIT_VERSION_PATCH)

#define KVKIT_VERSION_NUMBER \
  (KVKIT_VERSION_MAJOR * 10000 + KVKIT_VERSION_MINOR * 100 + KVKIT_VERSION_PATCH)

namespace kvkit {

/// The version of the headers in use, "MAJOR.MINOR.PATCH".
inline constexpr const char* version() { return KVKIT_VERSION; }

}  // namespace kvkit
