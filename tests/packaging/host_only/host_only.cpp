// Host-only TU: the umbrella header must compile as plain C++ with no CUDA anywhere.
#include <kvkit/kvkit.hpp>
#include <kvkit/version.hpp>

#include "no_cuda_check.hpp"

#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

int readme_example();  // readme_example.cpp
#if defined(KVKIT_HOST_NO_EXCEPTIONS_CHECK)
int no_exceptions_check();  // no_exceptions.cpp
#endif

static_assert(std::is_trivially_copyable<kvkit::PagedKVView<kvkit::half_t>>::value,
              "views are passed by value");

int main() {
  const kvkit::KVGeometry g{1, 4, 2, 3};
  const kvkit::KVStrides s = kvkit::packed_strides(g, kvkit::KVLayout::kHND);
  std::vector<kvkit::half_t> k(static_cast<std::size_t>(g.num_pages * s.page), kvkit::half_t(1.f));
  std::vector<kvkit::half_t> v(k.size(), kvkit::half_t(2.f));
  const std::int32_t indptr[] = {0, 2};
  const std::int32_t indices[] = {2, 0};
  const std::int32_t last_page_len[] = {1};
  const auto view = kvkit::make_csr_view(g, k.data(), s, v.data(), s,
                                         kvkit::CsrPageTable{indptr, indices, last_page_len, 1});
  view.validate_page_table();
  if (view.seq_len(0) != 3 || kvkit::to_float(*view.v_ptr(0, 2, 0)) != 2.f) {
    std::fprintf(stderr, "host_only: view addressing is wrong\n");
    return 1;
  }
  if (readme_example() != 0) {
    std::fprintf(stderr, "host_only: the README example failed\n");
    return 1;
  }
#if defined(KVKIT_HOST_NO_EXCEPTIONS_CHECK)
  if (no_exceptions_check() != 0) return 1;
#endif
  std::printf("host_only ok: kvkit %s as C++%ld, no CUDA header included\n", KVKIT_VERSION,
              static_cast<long>(__cplusplus));
  return 0;
}
