// Built only with -fno-exceptions -DKVKIT_NO_EXCEPTIONS (KVKIT_HOST_NO_EXCEPTIONS): the
// umbrella header, the thread pool and kernel calls on the built-in workers and on a
// ThreadPool must compile and run without exceptions, and failures still come back as a
// Status (run paths never needed to throw).
#include <kvkit/core/thread_pool.hpp>
#include <kvkit/kvkit.hpp>

#include "no_cuda_check.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#if KVKIT_HAS_EXCEPTIONS
#error "this TU must be compiled with -fno-exceptions"
#endif
#if !defined(KVKIT_NO_EXCEPTIONS)
#error "this TU must be compiled with -DKVKIT_NO_EXCEPTIONS"
#endif

namespace {

// One decode step on a tiny pool: write one token per sequence, attend, and return the
// output (checked equal across executors by the caller).
bool decode_step(kvkit::exec::Host ex, std::vector<float>& out) {
  const kvkit::KVGeometry geo{/*num_kv_heads=*/2, /*head_dim=*/8, /*page_size=*/4,
                              /*num_pages=*/8};
  const kvkit::KVStrides st = kvkit::packed_strides(geo, kvkit::KVLayout::kNHD);
  std::vector<float> k(static_cast<std::size_t>(geo.num_pages * st.page)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = std::sin(0.37f * static_cast<float>(i));
    v[i] = std::cos(0.11f * static_cast<float>(i));
  }
  std::vector<std::int32_t> block_table = {5, 2, 7, 1}, seq_lens = {6, 3};
  auto view = kvkit::make_block_table_view(
      geo, k.data(), st, v.data(), st,
      kvkit::BlockTable{block_table.data(), /*row_stride=*/2, seq_lens.data(), /*batch=*/2});
  std::vector<float> k_new(2 * 2 * 8, 0.25f), v_new(k_new.size(), -0.5f);
  const std::int64_t slots[] = {2 * 4 + 1, 1 * 4 + 2};  // token 5 of seq 0, token 2 of seq 1
  kvkit::Status s = kvkit::write_kv(ex, view, k_new.data(), v_new.data(), slots, 2, 2 * 8);
  const kvkit::DecodeAttentionParams params{/*num_qo_heads=*/4, 1.f / std::sqrt(8.f)};
  std::vector<unsigned char> ws(kvkit::paged_decode_attention_workspace_size(ex, view, params));
  std::vector<float> q(2 * 4 * 8, 0.3f);
  out.assign(q.size(), 0.f);
  if (s) s = kvkit::paged_decode_attention(ex, view, q.data(), out.data(), params,
                                           kvkit::Workspace{ws.data(), ws.size()});
  if (!s) {
    std::fprintf(stderr, "no_exceptions: %s\n", s.to_string().c_str());
    return false;
  }
  // An out-of-range page id is a Status, not a throw.
  const std::int32_t src[] = {0}, dst[] = {99};
  const kvkit::Status bad = kvkit::copy_pages(ex, view, src, dst, 1);
  if (bad.code() != kvkit::StatusCode::kInvalidArgument) {
    std::fprintf(stderr, "no_exceptions: copy_pages accepted page 99\n");
    return false;
  }
  return true;
}

}  // namespace

int no_exceptions_check() {
  std::vector<float> builtin, pooled, serial;
  kvkit::ThreadPool pool(2);
  if (!decode_step(kvkit::exec::Host{2}, builtin) || !decode_step(pool.host(), pooled) ||
      !decode_step(kvkit::exec::Host{1}, serial))
    return 1;
  if (std::memcmp(builtin.data(), pooled.data(), builtin.size() * sizeof(float)) != 0 ||
      std::memcmp(builtin.data(), serial.data(), builtin.size() * sizeof(float)) != 0) {
    std::fprintf(stderr, "no_exceptions: outputs differ between executors\n");
    return 1;
  }
  for (float o : builtin)
    if (!std::isfinite(o)) return 1;
  std::printf("no_exceptions ok: built with -fno-exceptions -DKVKIT_NO_EXCEPTIONS\n");
  return 0;
}
