// Block payload format (header, XXH64, zstd), keys, the in-memory LRU backend and the
// BlockStore connector (prefix match, load into shuffled pages, save) over RandomPools.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvkit/store/block_store.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::store;
using kvkit::test::PoolSpec;
using kvkit::test::RandomPool;

namespace {

BlockHash random_hash(std::mt19937_64& rng) {
  BlockHash h;
  for (auto& b : h.bytes) b = static_cast<std::uint8_t>(rng());
  return h;
}

// Rows of (page, all slots, all heads) of K or V as raw bytes in (slot, head, d) order.
template <class T>
std::vector<T> page_rows(const RandomPool<T>& p, std::int32_t page, KVKind kind) {
  std::vector<T> out;
  const std::int32_t dim = kind == KVKind::kKey ? p.geometry.head_dim : p.geometry.v_dim();
  for (std::int32_t t = 0; t < p.geometry.page_size; ++t)
    for (std::int32_t h = 0; h < p.geometry.num_kv_heads; ++h)
      for (std::int32_t d = 0; d < dim; ++d)
        out.push_back(kind == KVKind::kKey ? p.k[p.index(page, t, h, d)]
                                           : p.v[p.v_index(page, t, h, d)]);
  return out;
}

template <class T>
BlockExpect expect_of(const RandomPool<T>& p, KVKind kind, std::uint32_t layer,
                      const BlockHash& h) {
  BlockExpect e;
  e.dtype = dtype_of<T>::value;
  e.kind = kind;
  e.layer = layer;
  e.page_size = static_cast<std::uint32_t>(p.geometry.page_size);
  e.num_heads = static_cast<std::uint32_t>(p.geometry.num_kv_heads);
  e.head_dim = static_cast<std::uint32_t>(kind == KVKind::kKey ? p.geometry.head_dim
                                                                : p.geometry.v_dim());
  e.tokens = e.page_size;
  e.hash = h;
  return e;
}

PoolSpec pool_spec(KVLayout layout, std::int32_t blocks, std::int32_t page_size = 8) {
  PoolSpec s;
  s.num_kv_heads = 3;
  s.head_dim = 16;
  s.v_head_dim = 8;
  s.page_size = page_size;
  s.layout = layout;
  s.row_padding = 2;  // strided rows: copies must follow the view's strides
  s.page_padding = 5;
  s.seq_lens = {blocks * page_size};
  s.spare_pages = 4;
  return s;
}

template <class T>
void round_trip_all(std::mt19937_64& rng) {
  for (KVLayout src_layout : {KVLayout::kNHD, KVLayout::kHND})
    for (KVLayout dst_layout : {KVLayout::kNHD, KVLayout::kHND})
      for (KVLayout payload_layout : {KVLayout::kNHD, KVLayout::kHND})
        for (Codec codec : {Codec::kRaw, Codec::kZstd}) {
          CAPTURE(to_string(dtype_of<T>::value), to_string(src_layout), to_string(dst_layout),
                  to_string(payload_layout), static_cast<int>(codec));
          RandomPool<T> src(pool_spec(src_layout, 2), rng);
          RandomPool<T> dst(pool_spec(dst_layout, 2), rng);
          EncodeOptions opt;
          opt.codec = codec;
          opt.layout = payload_layout;
          BlockScratch scratch;
          const BlockHash h = random_hash(rng);
          for (KVKind kind : {KVKind::kKey, KVKind::kValue}) {
            const std::int32_t sp = src.pages[0][1], dp = dst.pages[0][0];
            std::string payload;
            REQUIRE(encode_block(src.view, kind, sp, src.geometry.page_size, 7, h, opt, scratch,
                                 &payload)
                        .is_ok());
            BlockHeader hdr;
            REQUIRE(read_block_header(reinterpret_cast<const std::uint8_t*>(payload.data()),
                                      payload.size(), &hdr)
                        .is_ok());
            CHECK(hdr.codec == (codec == Codec::kZstd && zstd_available() ? Codec::kZstd
                                                                           : Codec::kRaw));
            const auto other_k = dst.k;
            const auto other_v = dst.v;
            REQUIRE(decode_block(payload, expect_of(dst, kind, 7, h), dst.view, dp, scratch)
                        .is_ok());
            CHECK(test::bitwise_equal(page_rows(src, sp, kind), page_rows(dst, dp, kind)));
            // Nothing outside the destination page's rows of this kind changed.
            auto restore_page = [&](std::vector<T> expect_pool, const std::vector<T>& now,
                                    bool is_k) {
              const std::int32_t dim = is_k ? dst.geometry.head_dim : dst.geometry.v_dim();
              for (std::int32_t t = 0; t < dst.geometry.page_size; ++t)
                for (std::int32_t hd = 0; hd < dst.geometry.num_kv_heads; ++hd)
                  for (std::int32_t d = 0; d < dim; ++d) {
                    const std::size_t i = is_k ? dst.index(dp, t, hd, d) : dst.v_index(dp, t, hd, d);
                    expect_pool[i] = now[i];
                  }
              return test::bitwise_equal(expect_pool, now);
            };
            if (kind == KVKind::kKey) {
              CHECK(restore_page(other_k, dst.k, true));
              CHECK(test::bitwise_equal(other_v, dst.v));
            } else {
              CHECK(restore_page(other_v, dst.v, false));
              CHECK(test::bitwise_equal(other_k, dst.k));
            }
          }
        }
}

}  // namespace

TEST_CASE("xxh64 matches the reference vectors", "[store][format]") {
  CHECK(xxh64("", 0) == 0xEF46DB3751D8E999ull);
  CHECK(xxh64("abc", 3) == 0x44BC2CF5AD770999ull);
  // Low 32 bits of XXH64 of bytes(range(256)) * 3 + "xyz", from `zstd --check`'s frame
  // checksum (the zstd CLI stores them little-endian: f8 79 d7 5b).
  std::string v;
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 256; ++i) v.push_back(static_cast<char>(i));
  v += "xyz";
  CHECK((xxh64(v.data(), v.size()) & 0xffffffffull) == 0x5BD779F8ull);
}

TEST_CASE("block keys: seed layout and cluster hash tag", "[store][format]") {
  BlockHash h;
  for (std::size_t i = 0; i < 32; ++i) h.bytes[i] = static_cast<std::uint8_t>(i);
  const std::string hex = h.to_hex();
  CHECK(block_key("ns1", 3, h, KVKind::kKey) == "kvblock:ns1:3:" + hex + ":k");
  CHECK(block_key("ns1", 0, h, KVKind::kValue, KeyStyle::kClusterTagged) ==
        "kvblock:ns1:0:{" + hex + "}:v");
  const std::string ns = make_namespace("SmolLM2-135M");
  CHECK(ns.size() == 16);
  CHECK(ns == make_namespace("SmolLM2-135M"));
  CHECK(ns != make_namespace("SmolLM2-135M", "salt"));
  CHECK(make_namespace("SmolLM2-135M", "a") != make_namespace("SmolLM2-135M", "b"));
}

TEST_CASE("payload round trip: every dtype, pool layout, payload layout, codec",
          "[store][format]") {
  KVKIT_TEST_RNG(rng);
  if (!zstd_available()) WARN("built without KVKIT_HAS_ZSTD: zstd requests store raw rows");
  round_trip_all<float>(rng);
  round_trip_all<half_t>(rng);
  round_trip_all<bfloat16_t>(rng);
}

TEST_CASE("corrupt, truncated or mismatched payloads are rejected and leave the page alone",
          "[store][format]") {
  KVKIT_TEST_RNG(rng);
  for (Codec codec : {Codec::kRaw, Codec::kZstd}) {
    CAPTURE(static_cast<int>(codec));
    RandomPool<half_t> src(pool_spec(KVLayout::kNHD, 1), rng);
    RandomPool<half_t> dst(pool_spec(KVLayout::kHND, 1), rng);
    const BlockHash h = random_hash(rng);
    EncodeOptions opt;
    opt.codec = codec;
    BlockScratch scratch;
    std::string good;
    REQUIRE(encode_block(src.view, KVKind::kValue, src.pages[0][0], 8, 2, h, opt, scratch, &good)
                .is_ok());
    const BlockExpect e = expect_of(dst, KVKind::kValue, 2, h);
    const auto k0 = dst.k;
    const auto v0 = dst.v;
    const std::int32_t dp = dst.free_pages[0];
    auto untouched = [&] {
      return test::bitwise_equal(k0, dst.k) && test::bitwise_equal(v0, dst.v);
    };
    // Every single-byte flip (header and body), every truncation, one padding byte.
    for (std::size_t pos = 0; pos < good.size(); ++pos) {
      std::string bad = good;
      bad[pos] = static_cast<char>(bad[pos] ^ (1u << (rng() % 8)));
      const Status st = decode_block(bad, e, dst.view, dp, scratch);
      INFO("flip at byte " << pos);
      REQUIRE_FALSE(st.is_ok());
    }
    for (std::size_t len = 0; len < good.size(); len += 1 + len / 7) {
      INFO("truncated to " << len);
      REQUIRE_FALSE(decode_block(std::string_view(good).substr(0, len), e, dst.view, dp, scratch)
                        .is_ok());
    }
    CHECK_FALSE(decode_block(good + "x", e, dst.view, dp, scratch).is_ok());
    CHECK(untouched());
    // Expectations that differ from the payload: identity and geometry.
    BlockExpect wrong = e;
    wrong.layer = 3;
    CHECK(decode_block(good, wrong, dst.view, dp, scratch).code() == StatusCode::kInvalidArgument);
    wrong = e;
    wrong.kind = KVKind::kKey;
    CHECK_FALSE(decode_block(good, wrong, dst.view, dp, scratch).is_ok());
    wrong = e;
    wrong.hash.bytes[31] ^= 1;
    CHECK_FALSE(decode_block(good, wrong, dst.view, dp, scratch).is_ok());
    wrong = e;
    wrong.tokens = 7;
    CHECK_FALSE(decode_block(good, wrong, dst.view, dp, scratch).is_ok());
    wrong = e;
    wrong.dtype = DType::kBFloat16;
    CHECK_FALSE(decode_block(good, wrong, dst.view, dp, scratch).is_ok());
    // Same bytes into a bf16 pool (dtype), and into a pool with other geometry.
    RandomPool<bfloat16_t> bf(pool_spec(KVLayout::kNHD, 1), rng);
    BlockExpect ebf = e;
    ebf.dtype = DType::kBFloat16;
    CHECK_FALSE(decode_block(good, ebf, bf.view, bf.pages[0][0], scratch).is_ok());
    PoolSpec other = pool_spec(KVLayout::kNHD, 1);
    other.num_kv_heads = 2;
    RandomPool<half_t> geo(other, rng);
    CHECK_FALSE(decode_block(good, e, geo.view, geo.pages[0][0], scratch).is_ok());
    CHECK(untouched());
    // The untouched payload still decodes.
    CHECK(decode_block(good, e, dst.view, dp, scratch).is_ok());
    CHECK(test::bitwise_equal(page_rows(src, src.pages[0][0], KVKind::kValue),
                              page_rows(dst, dp, KVKind::kValue)));
  }
}

TEST_CASE("MemoryBackend: byte-bounded LRU", "[store][memory]") {
  MemoryBackend mem(1000);
  auto put1 = [&](const std::string& k, std::size_t bytes) {
    const std::string v(bytes, 'x');
    KeyState st = KeyState::kError;
    REQUIRE(mem.put(&k, &v, 1, &st).is_ok());
    return st;
  };
  auto has = [&](const std::string& k) {
    KeyState st = KeyState::kError;
    REQUIRE(mem.exists(&k, 1, &st).is_ok());
    return st == KeyState::kHit;
  };
  // 4 entries of 2 + 248 bytes fill it exactly.
  for (const char* k : {"k0", "k1", "k2", "k3"}) CHECK(put1(k, 248) == KeyState::kHit);
  CHECK(mem.used_bytes() == 1000);
  CHECK(has("k0"));  // k0 becomes most recent; k1 is now the LRU entry
  CHECK(put1("k4", 248) == KeyState::kHit);
  CHECK(mem.used_bytes() <= mem.capacity());
  CHECK_FALSE(has("k1"));
  CHECK(has("k0"));
  CHECK(has("k2"));
  CHECK(has("k3"));
  CHECK(has("k4"));
  // A big value evicts as many LRU entries as needed.
  CHECK(put1("big", 600) == KeyState::kHit);
  CHECK(mem.used_bytes() <= 1000);
  CHECK(mem.size() == 2);  // big + the most recent 248-byte one (k4)
  CHECK(has("k4"));
  // Larger than the capacity: refused, nothing else lost.
  CHECK(put1("huge", 2000) == KeyState::kError);
  CHECK(has("big"));
  // Overwrite replaces the old bytes; get returns the value.
  CHECK(put1("big", 10) == KeyState::kHit);
  std::string key = "big", val;
  KeyState st = KeyState::kError;
  REQUIRE(mem.get(&key, 1, &val, &st).is_ok());
  CHECK(st == KeyState::kHit);
  CHECK(val == std::string(10, 'x'));
  REQUIRE(mem.remove(&key, 1).is_ok());
  REQUIRE(mem.get(&key, 1, &val, &st).is_ok());
  CHECK(st == KeyState::kMiss);
}

namespace {

// `layers` RandomPools sharing one page table (as an engine's layers do).
template <class T>
struct LayeredPool {
  std::vector<std::unique_ptr<RandomPool<T>>> pools;
  std::vector<PagedKVView<T>> views;
  LayeredPool(const PoolSpec& spec, int layers, std::mt19937_64& rng) {
    const std::uint64_t table_seed = rng();
    for (int l = 0; l < layers; ++l) {
      // Same shuffle for every layer (same seed), different random contents afterwards.
      std::mt19937_64 r(table_seed);
      pools.push_back(std::make_unique<RandomPool<T>>(spec, r));
      test::fill_uniform(pools.back()->k.data(), pools.back()->k.size(), rng);
      test::fill_uniform(pools.back()->v.data(), pools.back()->v.size(), rng);
      views.push_back(pools.back()->view);
    }
  }
  const std::vector<std::int32_t>& pages() const { return pools[0]->pages[0]; }
};

BlockStoreConfig store_config(int layers, const PoolSpec& s, Codec codec, int per_batch) {
  BlockStoreConfig c;
  c.ns = make_namespace("test-model", "salt");
  c.num_layers = layers;
  c.page_size = s.page_size;
  c.num_kv_heads = s.num_kv_heads;
  c.head_dim = s.head_dim;
  c.v_head_dim = s.v_head_dim;
  c.encode.codec = codec;
  c.blocks_per_batch = per_batch;
  return c;
}

std::vector<BlockHash> chain(std::size_t blocks, int page_size, std::mt19937_64& rng) {
  std::vector<std::int32_t> tokens(blocks * static_cast<std::size_t>(page_size));
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % 50000);
  return prefix_block_hashes(tokens.data(), tokens.size(), page_size);
}

}  // namespace

TEST_CASE("BlockStore: save, prefix match with 10% of keys deleted, load into shuffled pages",
          "[store][connector]") {
  KVKIT_TEST_RNG(rng);
  const int layers = 3;
  const std::int32_t blocks = 40;
  for (Codec codec : {Codec::kRaw, Codec::kZstd}) {
    for (int per_batch : {1, 7, 64}) {
      CAPTURE(static_cast<int>(codec), per_batch);
      const PoolSpec src_spec = pool_spec(KVLayout::kNHD, blocks, 4);
      LayeredPool<half_t> src(src_spec, layers, rng);
      MemoryBackend mem(64u << 20);
      BlockStore<half_t> store(mem, store_config(layers, src_spec, codec, per_batch));
      const std::vector<BlockHash> hashes = chain(blocks, 4, rng);
      std::size_t saved = 0;
      REQUIRE(store.save_sequence(hashes.data(), hashes.size(), src.views.data(), 0, &saved)
                  .is_ok());
      CHECK(saved == static_cast<std::size_t>(blocks));
      CHECK(mem.size() == static_cast<std::size_t>(blocks * layers * 2));
      CHECK(store.match_blocks(hashes.data(), hashes.size()) == static_cast<std::size_t>(blocks));
      CHECK(store.match_tokens(hashes.data(), hashes.size()) == static_cast<std::size_t>(blocks) * 4);

      // Delete 10% of all keys at random; the match is the longest complete prefix.
      std::vector<std::string> all;
      for (std::int32_t b = 0; b < blocks; ++b)
        for (int l = 0; l < layers; ++l)
          for (KVKind k : {KVKind::kKey, KVKind::kValue}) all.push_back(store.key(l, hashes[b], k));
      std::shuffle(all.begin(), all.end(), rng);
      const std::size_t n_del = all.size() / 10;
      std::set<std::string> deleted(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(n_del));
      REQUIRE(mem.remove(all.data(), n_del).is_ok());
      std::size_t expect_blocks = 0;
      for (; expect_blocks < static_cast<std::size_t>(blocks); ++expect_blocks) {
        bool complete = true;
        for (int l = 0; l < layers; ++l)
          for (KVKind k : {KVKind::kKey, KVKind::kValue})
            complete = complete && !deleted.count(store.key(l, hashes[expect_blocks], k));
        if (!complete) break;
      }
      CAPTURE(expect_blocks);
      CHECK(store.match_blocks(hashes.data(), hashes.size()) == expect_blocks);

      // Load into a fresh pool (other layout, other page shuffle): the matched prefix is
      // bit-exact, the blocks after it are reported as misses.
      PoolSpec dst_spec = src_spec;
      dst_spec.layout = KVLayout::kHND;
      dst_spec.row_padding = 0;
      LayeredPool<half_t> dst(dst_spec, layers, rng);
      const LoadResult r = store.load_sequence(hashes.data(), hashes.size(), dst.views.data(), 0);
      CHECK(r.status.is_ok());  // a plain miss ended it
      REQUIRE(r.blocks_loaded == expect_blocks);
      for (std::size_t b = 0; b < expect_blocks; ++b)
        for (int l = 0; l < layers; ++l)
          for (KVKind k : {KVKind::kKey, KVKind::kValue}) {
            INFO("block " << b << " layer " << l);
            CHECK(test::bitwise_equal(page_rows(*src.pools[l], src.pages()[b], k),
                                      page_rows(*dst.pools[l], dst.pages()[b], k)));
          }
    }
  }
}

TEST_CASE("BlockStore: a corrupt block ends the loaded prefix", "[store][connector]") {
  KVKIT_TEST_RNG(rng);
  const PoolSpec spec = pool_spec(KVLayout::kNHD, 12, 4);
  LayeredPool<float> src(spec, 2, rng);
  MemoryBackend mem(16u << 20);
  BlockStore<float> store(mem, store_config(2, spec, Codec::kRaw, 5));
  const auto hashes = chain(12, 4, rng);
  REQUIRE(store.save_sequence(hashes.data(), hashes.size(), src.views.data(), 0).is_ok());
  // Overwrite layer 1's V of block 6 with the same-size payload of another block: present,
  // right size, wrong identity.
  const std::string victim = store.key(1, hashes[6], KVKind::kValue);
  const std::string donor = store.key(1, hashes[2], KVKind::kValue);
  std::string payload;
  KeyState st = KeyState::kError;
  REQUIRE(mem.get(&donor, 1, &payload, &st).is_ok());
  REQUIRE(mem.put(&victim, &payload, 1, &st).is_ok());
  CHECK(store.match_blocks(hashes.data(), hashes.size()) == 12);  // present...
  LayeredPool<float> dst(spec, 2, rng);
  const LoadResult r = store.load_sequence(hashes.data(), hashes.size(), dst.views.data(), 0);
  CHECK(r.blocks_loaded == 6);  // ...but never loaded
  CHECK_FALSE(r.status.is_ok());
  CHECK(store.stats().rejected_payloads == 1);
  // A flipped byte in block 3's K of layer 0.
  const std::string k3 = store.key(0, hashes[3], KVKind::kKey);
  REQUIRE(mem.get(&k3, 1, &payload, &st).is_ok());
  payload[payload.size() / 2] ^= 0x10;
  REQUIRE(mem.put(&k3, &payload, 1, &st).is_ok());
  CHECK(store.load_sequence(hashes.data(), hashes.size(), dst.views.data(), 0).blocks_loaded == 3);
  // Bad arguments are statuses, not throws.
  CHECK(store.save_sequence(hashes.data(), 13, src.views.data(), 0).code() ==
        StatusCode::kOutOfRange);
  CHECK(store.load_sequence(hashes.data(), 1, src.views.data(), 5).status.code() ==
        StatusCode::kOutOfRange);
}
