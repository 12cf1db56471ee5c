// The engine example shown in README.md ("Using kvkit from an engine"); compiled and run
// by the host-only packaging tests so the README stays true.
#include <kvkit/kvkit.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

int readme_example() {
  // The engine's pool for one layer: 64 pages of 16 tokens, 2 KV heads of 64 dims (NHD).
  const kvkit::KVGeometry geo{/*num_kv_heads=*/2, /*head_dim=*/64, /*page_size=*/16,
                              /*num_pages=*/64};
  const kvkit::KVStrides st = kvkit::packed_strides(geo, kvkit::KVLayout::kNHD);
  std::vector<float> k_pool(geo.num_pages * st.page), v_pool(k_pool.size());
  // One sequence in pages 7 then 3; it holds 21 tokens once token 20 is written.
  std::vector<std::int32_t> block_table = {7, 3}, seq_lens = {21};
  auto view = kvkit::make_block_table_view(  // throws kvkit::Error on bad geometry
      geo, k_pool.data(), st, v_pool.data(), st,
      kvkit::BlockTable{block_table.data(), /*row_stride=*/2, seq_lens.data(), /*batch=*/1});

  kvkit::exec::Host host{/*threads=*/2};
  std::vector<float> k_new(2 * 64, 0.5f), v_new(2 * 64, 1.f), q(8 * 64, 0.1f), out(8 * 64);
  const std::int64_t slot = 3 * 16 + 4;  // token 20 = page 3, offset 4 (vLLM slot mapping)
  kvkit::Status s = kvkit::write_kv(host, view, k_new.data(), v_new.data(), &slot, 1, 2 * 64);
  const kvkit::DecodeAttentionParams params{/*num_qo_heads=*/8, 1.f / std::sqrt(64.f)};
  std::vector<unsigned char> ws(kvkit::paged_decode_attention_workspace_size(host, view, params));
  if (s) s = kvkit::paged_decode_attention(host, view, q.data(), out.data(), params,
                                           kvkit::Workspace{ws.data(), ws.size()});
  if (!s) {
    std::fprintf(stderr, "kvkit: %s\n", s.to_string().c_str());
    return 1;
  }
  // Only token 20 has a non-zero value row (all ones), so every output is in (0, 1).
  for (float o : out)
    if (!(o > 0.f && o < 1.f)) return 1;
  return 0;
}
