#pragma once
// Prefix-chained content hashes of KV blocks, and the SHA-256 they are built on.
//
// A block's hash names its KV content: the hash of the block before it (so equal hashes
// imply equal whole prefixes), the block's token ids, and extra keys (model id, salt,
// LoRA id, ...) that change the KV for the same tokens. The hash must be identical in
// every process and on every machine, because it is the key under which blocks are
// shared through an external store. So it is SHA-256 over an explicit little-endian byte
// string; no std::hash, no per-process seeds, no host byte order.
//
// Canonical serialisation hashed by block_hash (version 1), in this order:
//   1. the 14 ASCII bytes "kvkit.block.v1" (domain tag, no terminator)
//   2. the parent hash, 32 bytes (the first block of a sequence uses the all-zero root)
//   3. u32 LE  n = number of tokens in the block
//   4. n x u32 LE  token ids (int32 ids as their two's-complement 32-bit pattern)
//   5. u32 LE  k = number of extra keys
//   6. k x (u32 LE byte length, then the key's raw bytes)
// The length prefixes make every field boundary explicit, so e.g. the keys {"ab", "c"}
// and {"a", "bc"} serialise differently. Changing this layout changes every stored key:
// bump the tag's version when doing so.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvkit/core/error.hpp"

namespace kvkit {

namespace detail {

inline constexpr std::array<std::uint32_t, 64> kSha256Round = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u,
    0xab1c5ed5u, 0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu,
    0x9bdc06a7u, 0xc19bf174u, 0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu,
    0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau, 0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u,
    0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u, 0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu,
    0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u, 0xa2bfe8a1u, 0xa81a664bu,
    0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u, 0x19a4c116u,
    0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u,
    0xc67178f2u};

inline constexpr std::array<std::uint32_t, 8> kSha256Init = {
    0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
    0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};

constexpr std::uint32_t rotr32(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

}  // namespace detail

/// Incremental SHA-256 (FIPS 180-4). Feed bytes with update() in any number of pieces,
/// then finish() once; the digest equals that of the concatenated pieces.
class Sha256 {
 public:
  using Digest = std::array<std::uint8_t, 32>;

  Sha256() : state_(detail::kSha256Init) {}

  Sha256& update(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    total_bytes_ += n;
    if (buffered_ > 0) {  // top up a partial block first
      const std::size_t take = n < 64 - buffered_ ? n : 64 - buffered_;
      std::memcpy(buffer_.data() + buffered_, p, take);
      buffered_ += take;
      p += take;
      n -= take;
      if (buffered_ < 64) return *this;
      compress(buffer_.data());
      buffered_ = 0;
    }
    for (; n >= 64; n -= 64, p += 64) compress(p);
    if (n > 0) std::memcpy(buffer_.data(), p, n);
    buffered_ = n;
    return *this;
  }
  Sha256& update(std::string_view s) { return update(s.data(), s.size()); }

  /// Pads, processes the last block(s) and returns the digest. Call once.
  Digest finish() {
    const std::uint64_t bit_len = total_bytes_ * 8;
    buffer_[buffered_++] = 0x80;
    if (buffered_ > 56) {  // no room for the length: pad out this block
      std::memset(buffer_.data() + buffered_, 0, 64 - buffered_);
      compress(buffer_.data());
      buffered_ = 0;
    }
    std::memset(buffer_.data() + buffered_, 0, 56 - buffered_);
    for (int i = 0; i < 8; ++i)
      buffer_[56 + i] = static_cast<std::uint8_t>(bit_len >> (56 - 8 * i));  // big-endian
    compress(buffer_.data());
    Digest out{};
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<std::uint8_t>(state_[i] >> (24 - 8 * j));
    return out;
  }

  /// One-shot digest of `n` bytes.
  static Digest digest(const void* data, std::size_t n) { return Sha256().update(data, n).finish(); }
  static Digest digest(std::string_view s) { return digest(s.data(), s.size()); }

 private:
  void compress(const std::uint8_t* block) {
    using detail::rotr32;
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (std::uint32_t{block[4 * i]} << 24) | (std::uint32_t{block[4 * i + 1]} << 16) |
             (std::uint32_t{block[4 * i + 2]} << 8) | std::uint32_t{block[4 * i + 3]};
    for (int i = 16; i < 64; ++i) {
      const std::uint32_t s0 = rotr32(w[i - 15], 7) ^ rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = rotr32(w[i - 2], 17) ^ rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
    std::uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
      const std::uint32_t sum1 = rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25);
      const std::uint32_t choose = (e & f) ^ (~e & g);
      const std::uint32_t t1 = h + sum1 + choose + detail::kSha256Round[i] + w[i];
      const std::uint32_t sum0 = rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22);
      const std::uint32_t majority = (a & b) ^ (a & c) ^ (b & c);
      const std::uint32_t t2 = sum0 + majority;
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state_[0] += a;
    state_[1] += b;
    state_[2] += c;
    state_[3] += d;
    state_[4] += e;
    state_[5] += f;
    state_[6] += g;
    state_[7] += h;
  }

  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
};

/// Lowercase hex of `n` bytes.
inline std::string to_hex(const std::uint8_t* bytes, std::size_t n) {  // bytes: [n]
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    s[2 * i] = kDigits[bytes[i] >> 4];
    s[2 * i + 1] = kDigits[bytes[i] & 0xf];
  }
  return s;
}

/// The 32-byte content hash of a KV block (a SHA-256 digest). The default value, all
/// zero bytes, is the root: the parent of a sequence's first block.
struct BlockHash {
  std::array<std::uint8_t, 32> bytes{};

  static BlockHash root() { return BlockHash{}; }

  friend bool operator==(const BlockHash& a, const BlockHash& b) { return a.bytes == b.bytes; }
  friend bool operator!=(const BlockHash& a, const BlockHash& b) { return a.bytes != b.bytes; }
  /// Lexicographic byte order (the order of to_hex() strings).
  friend bool operator<(const BlockHash& a, const BlockHash& b) { return a.bytes < b.bytes; }

  /// 64 lowercase hex characters.
  std::string to_hex() const { return kvkit::to_hex(bytes.data(), bytes.size()); }

  /// Parses 64 hex characters (either case); nullopt for anything else. Never throws, so
  /// keys read back from a store can be parsed on I/O paths.
  static std::optional<BlockHash> from_hex(std::string_view hex) {
    if (hex.size() != 64) return std::nullopt;
    auto nibble = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    BlockHash h;
    for (std::size_t i = 0; i < 32; ++i) {
      const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
      if (hi < 0 || lo < 0) return std::nullopt;
      h.bytes[i] = static_cast<std::uint8_t>(hi << 4 | lo);
    }
    return h;
  }
};

/// Domain tag that starts every serialised block (see the file comment).
inline constexpr std::string_view kBlockHashTag = "kvkit.block.v1";

namespace detail {

inline void put_u32_le(Sha256& sha, std::uint32_t v) {
  const std::uint8_t b[4] = {static_cast<std::uint8_t>(v), static_cast<std::uint8_t>(v >> 8),
                             static_cast<std::uint8_t>(v >> 16),
                             static_cast<std::uint8_t>(v >> 24)};
  sha.update(b, 4);
}

inline std::uint32_t checked_u32(std::size_t n, const char* what) {
  KVKIT_CHECK(n <= 0xffffffffu, "kvkit: block hash ", what, " ", n, " does not fit in 32 bits");
  return static_cast<std::uint32_t>(n);
}

}  // namespace detail

/// Hash of one block: SHA-256 of the canonical serialisation in the file comment, over
/// the parent's hash, the block's `n` token ids and the extra keys. Deterministic across
/// processes, machines and byte orders. Throws kvkit::Error when `tokens` is null with
/// n > 0, or a count or key length exceeds 32 bits.
inline BlockHash block_hash(const BlockHash& parent, const std::int32_t* tokens,  // [n]
                            std::size_t n, const std::vector<std::string>& extra_keys = {}) {
  KVKIT_CHECK(n == 0 || tokens != nullptr, "kvkit: block_hash tokens is null for n = ", n);
  Sha256 sha;
  sha.update(kBlockHashTag);
  sha.update(parent.bytes.data(), parent.bytes.size());
  detail::put_u32_le(sha, detail::checked_u32(n, "token count"));
  // Serialise tokens through a small stack buffer: explicit LE bytes, no allocation.
  std::uint8_t buf[256];
  std::size_t used = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = static_cast<std::uint32_t>(tokens[i]);
    buf[used++] = static_cast<std::uint8_t>(v);
    buf[used++] = static_cast<std::uint8_t>(v >> 8);
    buf[used++] = static_cast<std::uint8_t>(v >> 16);
    buf[used++] = static_cast<std::uint8_t>(v >> 24);
    if (used == sizeof(buf)) {
      sha.update(buf, used);
      used = 0;
    }
  }
  sha.update(buf, used);
  detail::put_u32_le(sha, detail::checked_u32(extra_keys.size(), "extra key count"));
  for (const std::string& key : extra_keys) {
    detail::put_u32_le(sha, detail::checked_u32(key.size(), "extra key length"));
    sha.update(key.data(), key.size());
  }
  BlockHash h;
  h.bytes = sha.finish();
  return h;
}

/// Chained hashes of the full blocks of a token sequence: block i covers tokens
/// [i * block_size, (i + 1) * block_size) and its parent is block i-1's hash (`parent`
/// for block 0, the root by default; pass the last known hash to continue a chain).
/// A partial trailing block is not hashed, since its content is still changing. The same
/// extra keys apply to every block. Throws kvkit::Error for block_size <= 0 or null
/// tokens with n > 0.
inline std::vector<BlockHash> prefix_block_hashes(const std::int32_t* tokens,  // [n]
                                                  std::size_t n, int block_size,
                                                  const std::vector<std::string>& extra_keys = {},
                                                  const BlockHash& parent = BlockHash::root()) {
  KVKIT_CHECK(block_size > 0, "kvkit: prefix_block_hashes block_size must be > 0, got ",
              block_size);
  KVKIT_CHECK(n == 0 || tokens != nullptr, "kvkit: prefix_block_hashes tokens is null for n = ",
              n);
  const std::size_t bs = static_cast<std::size_t>(block_size);
  std::vector<BlockHash> out;
  out.reserve(n / bs);
  BlockHash prev = parent;
  for (std::size_t start = 0; start + bs <= n; start += bs) {
    prev = block_hash(prev, tokens + start, bs, extra_keys);
    out.push_back(prev);
  }
  return out;
}

}  // namespace kvkit

/// Hashing for unordered containers: the first 8 bytes, read little-endian (the digest
/// is already uniformly distributed, so no further mixing is needed).
namespace std {
template <>
struct hash<kvkit::BlockHash> {
  std::size_t operator()(const kvkit::BlockHash& h) const noexcept {
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | h.bytes[static_cast<std::size_t>(i)];
    return static_cast<std::size_t>(v);
  }
};
}  // namespace std
