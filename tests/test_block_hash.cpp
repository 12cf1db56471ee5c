// SHA-256 against the FIPS 180-2 vectors, streaming == one shot, and block hashes
// pinned to digests computed independently with Python's hashlib over the serialisation
// documented in block_hash.hpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

#include "kvkit/core/block_hash.hpp"
#include "reference.hpp"

using namespace kvkit;

namespace {

std::string hex(const Sha256::Digest& d) { return to_hex(d.data(), d.size()); }

// Seeded by test::test_seed() (so KVKIT_TEST_SEED=<seed> replays a failure), cut to the
// 32 bits std::mt19937 uses: the CAPTUREd seed is then exactly the one to replay with.
std::mt19937 fresh_rng(std::uint32_t& seed) {
  seed = static_cast<std::uint32_t>(kvkit::test::test_seed());
  return std::mt19937(seed);
}

}  // namespace

TEST_CASE("SHA-256 matches the FIPS 180-2 test vectors", "[hash][sha256]") {
  CHECK(hex(Sha256::digest("")) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(Sha256::digest("abc")) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(Sha256::digest("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  CHECK(hex(Sha256::digest(million)) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // the million 'a' fed one byte at a time (all buffer paths)
  Sha256 bytewise;
  for (int i = 0; i < 1000000; ++i) bytewise.update("a", 1);
  CHECK(hex(bytewise.finish()) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("SHA-256 streaming in random pieces equals one shot", "[hash][sha256]") {
  std::uint32_t seed = 0;
  std::mt19937 rng = fresh_rng(seed);
  CAPTURE(seed);
  // lengths around the padding boundaries (55/56/63/64 bytes) and a few larger ones
  std::vector<size_t> lengths{0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 1000, 4097};
  for (size_t len : lengths) {
    std::vector<std::uint8_t> data(len);
    for (auto& b : data) b = static_cast<std::uint8_t>(rng());
    const Sha256::Digest whole = Sha256::digest(data.data(), data.size());
    for (int trial = 0; trial < 8; ++trial) {
      Sha256 s;
      size_t pos = 0;
      while (pos < len) {
        const size_t piece = std::min<size_t>(len - pos, std::uniform_int_distribution<size_t>(0, 70)(rng));
        s.update(data.data() + pos, piece);
        pos += piece;
      }
      CAPTURE(len, trial);
      REQUIRE(s.finish() == whole);
    }
    if (len > 0) {  // and the digest depends on the content
      data[std::uniform_int_distribution<size_t>(0, len - 1)(rng)] ^= 0x10;
      REQUIRE(Sha256::digest(data.data(), data.size()) != whole);
    }
  }
}

TEST_CASE("block hashes equal digests pinned from an independent implementation", "[hash][block]") {
  const BlockHash root;
  const std::vector<std::int32_t> a{1, 2, 3, 4}, b{5, 6, 7, 8};
  const BlockHash h1 = block_hash(root, a.data(), a.size());
  const BlockHash h2 = block_hash(h1, b.data(), b.size());
  CHECK(h1.to_hex() == "fc7efdbe83c00a82e93ebbeb2d148a5b007c533a2a2ad7622136917c63519daa");
  CHECK(h2.to_hex() == "bb3a24aa6412c8ccc450833b0eb955e2f34c176b891efa953d821d847ce9e71d");
  CHECK(block_hash(root, nullptr, 0).to_hex() ==
        "bb8ed587460e7d5410c75baf7a2ad85bb49533874d49281379bd23c380bcdef4");
  // negative and extreme ids, a UTF-8 key
  const std::vector<std::int32_t> odd{-1, 0, 2147483647, -2147483647 - 1, 32000};
  CHECK(block_hash(root, odd.data(), odd.size(), {"model=stories260K", "salt:\xc3\xa9"}).to_hex() ==
        "3abced2c5cf96191aff4af662ce47291ecb4c6d55a3e827e71e67c9b612fd33a");
  // non-root parent; key split matters
  BlockHash parent;
  for (int i = 0; i < 32; ++i) parent.bytes[static_cast<size_t>(i)] = static_cast<std::uint8_t>(i);
  const std::int32_t t42 = 42;
  CHECK(block_hash(parent, &t42, 1, {"a", "bc"}).to_hex() ==
        "9bee4c55e0b3c7616b30103d43fcc26926e8eff76a6d2e8d077987a7c0e4511c");
  CHECK(block_hash(parent, &t42, 1, {"ab", "c"}).to_hex() ==
        "55e34ec41047ca5fa40f3216994bc420a45da6a5599249722ed2a05dc7c74581");
  // a chain of three full blocks; the 2 trailing tokens are not hashed
  std::vector<std::int32_t> toks(14);
  for (int i = 0; i < 14; ++i) toks[static_cast<size_t>(i)] = 100 + i;
  const std::vector<BlockHash> chain = prefix_block_hashes(toks.data(), toks.size(), 4, {"m"});
  REQUIRE(chain.size() == 3);
  CHECK(chain[0].to_hex() == "348df967e1cafd7d4b20b4ad460832448aed71c10a103250253bf4a56bde410d");
  CHECK(chain[1].to_hex() == "927abf1578610d5dd72bca0e4790a31918772771128bf719e05c62b0634b9b0d");
  CHECK(chain[2].to_hex() == "38764002bd414cf999a4f89b2e0c878e2ec9067ae0b5adde9808522d4bc66e1f");
}

TEST_CASE("block hash changes with every input it covers", "[hash][block]") {
  std::uint32_t seed = 0;
  std::mt19937 rng = fresh_rng(seed);
  CAPTURE(seed);
  std::uniform_int_distribution<std::int32_t> tok(-5, 50000);
  for (int rep = 0; rep < 20; ++rep) {
    const size_t n = std::uniform_int_distribution<size_t>(1, 40)(rng);
    std::vector<std::int32_t> t(n);
    for (auto& x : t) x = tok(rng);
    BlockHash parent;
    for (auto& byte : parent.bytes) byte = static_cast<std::uint8_t>(rng());
    const std::vector<std::string> keys{"model-a", "salt-" + std::to_string(rng() % 1000)};
    const BlockHash base = block_hash(parent, t.data(), n, keys);
    CAPTURE(rep, n);
    REQUIRE(block_hash(parent, t.data(), n, keys) == base);  // deterministic

    for (size_t i = 0; i < n; ++i) {  // any single token
      auto u = t;
      u[i] += 1;
      REQUIRE(block_hash(parent, u.data(), n, keys) != base);
    }
    for (size_t byte = 0; byte < 32; ++byte) {  // any bit of the parent
      BlockHash p2 = parent;
      p2.bytes[byte] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
      REQUIRE(block_hash(p2, t.data(), n, keys) != base);
    }
    REQUIRE(block_hash(parent, t.data(), n, {"model-b", keys[1]}) != base);  // a key's content
    REQUIRE(block_hash(parent, t.data(), n, {keys[0]}) != base);             // a key dropped
    REQUIRE(block_hash(parent, t.data(), n, {keys[1], keys[0]}) != base);    // key order
    REQUIRE(block_hash(parent, t.data(), n, {keys[0] + keys[1]}) != base);   // keys merged
    REQUIRE(block_hash(parent, t.data(), n) != base);                        // no keys
    REQUIRE(block_hash(parent, t.data(), n - 1, keys) != base);              // a token fewer
    // moving the key boundary by one byte
    REQUIRE(block_hash(parent, t.data(), n, {"model-", "a" + keys[1]}) != base);
    REQUIRE(block_hash(parent, t.data(), n, {"model-a" + keys[1].substr(0, 1), keys[1].substr(1)}) != base);
    // an empty key is still a key
    REQUIRE(block_hash(parent, t.data(), n, {"", ""}) != block_hash(parent, t.data(), n, {""}));
  }
}

TEST_CASE("prefix_block_hashes chains full blocks only", "[hash][block]") {
  std::uint32_t seed = 0;
  std::mt19937 rng = fresh_rng(seed);
  CAPTURE(seed);
  for (int rep = 0; rep < 20; ++rep) {
    const int bs = std::uniform_int_distribution<int>(1, 9)(rng);
    const size_t n = std::uniform_int_distribution<size_t>(0, 60)(rng);
    std::vector<std::int32_t> t(n + static_cast<size_t>(bs));
    for (auto& x : t) x = static_cast<std::int32_t>(rng() % 32000);
    CAPTURE(rep, bs, n);
    const std::vector<std::string> keys{"k"};
    const auto hs = prefix_block_hashes(t.data(), n, bs, keys);
    REQUIRE(hs.size() == n / static_cast<size_t>(bs));
    BlockHash prev;
    for (size_t i = 0; i < hs.size(); ++i) {  // block i = block_hash(block i-1, its tokens)
      REQUIRE(hs[i] == block_hash(prev, t.data() + i * static_cast<size_t>(bs), static_cast<size_t>(bs), keys));
      prev = hs[i];
    }
    // trailing tokens of a partial block do not affect anything
    auto u = t;
    for (size_t i = hs.size() * static_cast<size_t>(bs); i < u.size(); ++i) u[i] += 7;
    REQUIRE(prefix_block_hashes(u.data(), n, bs, keys) == hs);
    // a changed token changes its block and every later block, not earlier ones
    if (!hs.empty()) {
      const size_t pos = std::uniform_int_distribution<size_t>(0, hs.size() * static_cast<size_t>(bs) - 1)(rng);
      auto w = t;
      w[pos] ^= 1;
      const auto hw = prefix_block_hashes(w.data(), n, bs, keys);
      const size_t blk = pos / static_cast<size_t>(bs);
      for (size_t i = 0; i < hs.size(); ++i) REQUIRE((hw[i] == hs[i]) == (i < blk));
    }
    // continuing a chain from its last hash equals hashing the whole sequence
    if (hs.size() >= 2) {
      const size_t cut = hs.size() / 2;
      const auto tail = prefix_block_hashes(t.data() + cut * static_cast<size_t>(bs),
                                            n - cut * static_cast<size_t>(bs), bs, keys, hs[cut - 1]);
      REQUIRE(tail.size() == hs.size() - cut);
      REQUIRE(std::equal(tail.begin(), tail.end(), hs.begin() + static_cast<std::ptrdiff_t>(cut)));
    }
  }
  REQUIRE_THROWS_WITH(prefix_block_hashes(nullptr, 0, 0), Catch::Contains("block_size must be > 0, got 0"));
  REQUIRE_THROWS_WITH(prefix_block_hashes(nullptr, 0, -4), Catch::Contains("got -4"));
  REQUIRE_THROWS_WITH(prefix_block_hashes(nullptr, 5, 4), Catch::Contains("tokens is null for n = 5"));
  REQUIRE_THROWS_WITH(block_hash(BlockHash{}, nullptr, 3), Catch::Contains("tokens is null for n = 3"));
}

TEST_CASE("BlockHash compares, hashes and round-trips through hex", "[hash][block]") {
  std::vector<std::int32_t> t(64);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int32_t>(i * 7);
  const auto hs = prefix_block_hashes(t.data(), t.size(), 1);
  REQUIRE(hs.size() == 64);
  std::unordered_set<BlockHash> uset(hs.begin(), hs.end());
  std::set<BlockHash> oset(hs.begin(), hs.end());
  REQUIRE(uset.size() == 64);
  REQUIRE(oset.size() == 64);
  // operator< is the byte order, which is the order of the hex strings
  std::vector<std::string> hexes;
  for (const auto& h : oset) hexes.push_back(h.to_hex());
  REQUIRE(std::is_sorted(hexes.begin(), hexes.end()));
  for (const auto& h : hs) {
    REQUIRE(h.to_hex().size() == 64);
    const auto back = BlockHash::from_hex(h.to_hex());
    REQUIRE(back.has_value());
    REQUIRE(*back == h);
    // std::hash takes the first 8 bytes little-endian
    std::uint64_t want = 0;
    for (int i = 7; i >= 0; --i) want = (want << 8) | h.bytes[static_cast<size_t>(i)];
    REQUIRE(std::hash<BlockHash>{}(h) == static_cast<size_t>(want));
  }
  std::string upper = hs[3].to_hex();
  std::transform(upper.begin(), upper.end(), upper.begin(), [](char c) { return static_cast<char>(std::toupper(c)); });
  REQUIRE(BlockHash::from_hex(upper) == hs[3]);
  REQUIRE_FALSE(BlockHash::from_hex("abc").has_value());
  REQUIRE_FALSE(BlockHash::from_hex(std::string(63, '0') + "g").has_value());
  REQUIRE(BlockHash::root().to_hex() == std::string(64, '0'));
  REQUIRE(hs[0] != BlockHash::root());
  REQUIRE_FALSE(hs[0] == hs[1]);
}
