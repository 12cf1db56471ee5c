#pragma once
// How much work a test does. The sanitizer build (ASan + UBSan at -O0, 10-50x slower than
// Release) is there to catch memory errors and undefined behaviour on every code path; the
// Release build checks the numbers over the whole sweep. So under the sanitizers a sweep
// runs a sample that still takes every value of every swept parameter (sampled), and long
// runs are shortened (scaled); the Release build always runs all of it.

// KVKIT_TEST_SANITIZED: defined in the sanitizer build, for what must be decided by the
// preprocessor (a replaced operator new, say).
#if defined(__SANITIZE_ADDRESS__)
#define KVKIT_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVKIT_TEST_SANITIZED 1
#endif
#endif

namespace kvkit {
namespace test {

#if defined(KVKIT_TEST_SANITIZED)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

/// `full` in the Release build, `sanitized` under the sanitizers.
template <class I>
constexpr I scaled(I full, I sanitized) {
  return kSanitized ? sanitized : full;
}

/// Whether case number `c` (counted from 0 over a sweep's nested loops) runs: every case in
/// the Release build, every `stride`-th under the sanitizers. With a stride coprime to the
/// innermost loop's length and at least `stride` outer cases, each value of each loop
/// still comes up.
constexpr bool sampled(long c, long stride) { return !kSanitized || c % stride == 0; }

}  // namespace test
}  // namespace kvkit
