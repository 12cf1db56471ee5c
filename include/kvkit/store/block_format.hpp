#pragma once
// Stored form of one KV block (one page of one layer, K or V) and the keys it lives under.
//
// Keys: kvblock:{ns}:{layer}:{block_hash}:{k|v} (the PikiwiDB seed's layout), or the
// cluster-safe variant kvblock:{ns}:{layer}:{<block_hash>}:{k|v} whose braces are a Redis
// Cluster hash tag, so every key of one block (all layers, K and V) maps to one slot.
//
// Payload = a fixed 104-byte little-endian header, then the page's rows, optionally
// zstd-compressed. Header (offsets in bytes):
//    0 u32 magic "KVKB"        4 u16 version (1)       6 u8 dtype (DType)
//    7 u8 layout (KVLayout of the rows)                8 u8 codec (0 raw, 1 zstd)
//    9 u8 kind (0 K, 1 V)     10 u16 reserved (0)     12 u32 layer
//   16 u32 page_size          20 u32 num_heads        24 u32 head_dim
//   28 u32 tokens (rows of each head stored: page_size for a full block)
//   32 u64 raw_bytes (rows before compression)       40 u64 stored_bytes (after the header)
//   48 u64 checksum: XXH64 (seed 0) of the raw rows
//   56 u64 stored_checksum: XXH64 of the stored bytes after the header (= checksum when raw;
//          for zstd it catches any flipped bit, even one that decompresses to the same rows)
//   64 u64 header_checksum: XXH64 of bytes [0, 64) xor XXH64 of bytes [72, 104)
//   72 32 bytes block hash
// Rows: NHD = [tokens][heads][head_dim], HND = [heads][tokens][head_dim], head_dim
// contiguous, elements in the dtype's little-endian bits. Decoding checks every field
// against what the caller expects and both checksums, and returns a failed Status (a miss
// for the connector) on any difference, so a stored block is either bit-exact or unused.
// zstd is compiled in when KVKIT_HAS_ZSTD is 1 (link libzstd); without it, encoding
// with compression stores raw rows and a zstd payload decodes as kUnsupported (a miss).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "kvkit/core/block_hash.hpp"
#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/paged_kv_view.hpp"

#if defined(KVKIT_HAS_ZSTD) && KVKIT_HAS_ZSTD
#include <zstd.h>
#endif

namespace kvkit {
namespace store {

/// K or V half of a block.
enum class KVKind : std::uint8_t { kKey = 0, kValue = 1 };

/// Key spelling: the seed's plain keys, or the Redis Cluster hash-tagged variant.
enum class KeyStyle : std::uint8_t { kPlain = 0, kClusterTagged = 1 };

/// Payload compression.
enum class Codec : std::uint8_t { kRaw = 0, kZstd = 1 };

/// True when this build can write and read zstd payloads.
inline constexpr bool zstd_available() {
#if defined(KVKIT_HAS_ZSTD) && KVKIT_HAS_ZSTD
  return true;
#else
  return false;
#endif
}

/// Store key of one half-block. `ns` is the namespace (see make_namespace); it must not
/// contain '{' or '}' for the cluster style (the hash tag must be the first brace pair).
inline std::string block_key(std::string_view ns, int layer, const BlockHash& hash, KVKind kind,
                             KeyStyle style = KeyStyle::kPlain) {
  std::string k;
  k.reserve(ns.size() + 96);
  k.append("kvblock:").append(ns).append(":").append(std::to_string(layer)).append(":");
  if (style == KeyStyle::kClusterTagged) k.push_back('{');
  k.append(hash.to_hex());
  if (style == KeyStyle::kClusterTagged) k.push_back('}');
  k.append(kind == KVKind::kKey ? ":k" : ":v");
  return k;
}

/// Namespace of a model: 16 hex chars of SHA-256(fingerprint [+ "\0" + salt]). Hashing keeps
/// keys short and free of ':' / '{' whatever the fingerprint (model path, GGUF digest) holds.
inline std::string make_namespace(std::string_view model_fingerprint, std::string_view salt = {}) {
  Sha256 sha;
  sha.update(model_fingerprint);
  if (!salt.empty()) {
    const char zero = 0;
    sha.update(&zero, 1);
    sha.update(salt);
  }
  const Sha256::Digest d = sha.finish();
  return to_hex(d.data(), 8);
}

namespace detail {

inline constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ull, kP2 = 0xC2B2AE3D27D4EB4Full,
                               kP3 = 0x165667B19E3779F9ull, kP4 = 0x85EBCA77C2B2AE63ull,
                               kP5 = 0x27D4EB2F165667C5ull;
inline std::uint64_t rotl64(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline std::uint64_t load_u64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];  // little-endian on any host
  return v;
}
inline std::uint32_t load_u32(const std::uint8_t* p) {
  return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
         std::uint32_t{p[3]} << 24;
}
inline std::uint16_t load_u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | p[1] << 8);
}
inline void store_u64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
inline void store_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
inline void store_u16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}
inline std::uint64_t xxh_round(std::uint64_t acc, std::uint64_t in) {
  return rotl64(acc + in * kP2, 31) * kP1;
}
inline std::uint64_t xxh_merge(std::uint64_t h, std::uint64_t v) {
  return (h ^ xxh_round(0, v)) * kP1 + kP4;
}

}  // namespace detail

/// XXH64 (the xxHash reference algorithm, seed 0 by default) of `n` bytes: the payload
/// checksum. Written out here so the format needs no library.
inline std::uint64_t xxh64(const void* data, std::size_t n, std::uint64_t seed = 0) {  // data: [n]
  using namespace detail;
  const auto* p = static_cast<const std::uint8_t*>(data);
  const std::uint8_t* const end = p + n;
  std::uint64_t h;
  if (n >= 32) {
    std::uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    for (; end - p >= 32; p += 32) {
      v1 = xxh_round(v1, load_u64(p));
      v2 = xxh_round(v2, load_u64(p + 8));
      v3 = xxh_round(v3, load_u64(p + 16));
      v4 = xxh_round(v4, load_u64(p + 24));
    }
    h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    h = xxh_merge(h, v1);
    h = xxh_merge(h, v2);
    h = xxh_merge(h, v3);
    h = xxh_merge(h, v4);
  } else {
    h = seed + kP5;
  }
  h += static_cast<std::uint64_t>(n);
  for (; end - p >= 8; p += 8) h = rotl64(h ^ xxh_round(0, load_u64(p)), 27) * kP1 + kP4;
  if (end - p >= 4) {
    h = rotl64(h ^ (std::uint64_t{load_u32(p)} * kP1), 23) * kP2 + kP3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl64(h ^ (std::uint64_t{*p} * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

inline constexpr std::uint32_t kBlockMagic = 0x424B564Bu;  // "KVKB" read little-endian
inline constexpr std::uint16_t kBlockFormatVersion = 1;
inline constexpr std::size_t kBlockHeaderBytes = 104;

/// What a payload claims to be; decode_block compares it with what the caller expects.
struct BlockHeader {
  DType dtype = DType::kFloat32;
  KVLayout layout = KVLayout::kNHD;
  Codec codec = Codec::kRaw;
  KVKind kind = KVKind::kKey;
  std::uint32_t layer = 0;
  std::uint32_t page_size = 0;
  std::uint32_t num_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t tokens = 0;
  std::uint64_t raw_bytes = 0;
  std::uint64_t stored_bytes = 0;
  std::uint64_t checksum = 0;
  std::uint64_t stored_checksum = 0;
  BlockHash hash;
};

/// Writes the 104 header bytes of `h` (header_checksum computed here).
inline void write_block_header(const BlockHeader& h, std::uint8_t* out) {  // out: [104]
  using namespace detail;
  std::memset(out, 0, kBlockHeaderBytes);
  store_u32(out + 0, kBlockMagic);
  store_u16(out + 4, kBlockFormatVersion);
  out[6] = static_cast<std::uint8_t>(h.dtype);
  out[7] = static_cast<std::uint8_t>(h.layout);
  out[8] = static_cast<std::uint8_t>(h.codec);
  out[9] = static_cast<std::uint8_t>(h.kind);
  store_u32(out + 12, h.layer);
  store_u32(out + 16, h.page_size);
  store_u32(out + 20, h.num_heads);
  store_u32(out + 24, h.head_dim);
  store_u32(out + 28, h.tokens);
  store_u64(out + 32, h.raw_bytes);
  store_u64(out + 40, h.stored_bytes);
  store_u64(out + 48, h.checksum);
  store_u64(out + 56, h.stored_checksum);
  std::memcpy(out + 72, h.hash.bytes.data(), 32);
  store_u64(out + 64, xxh64(out, 64) ^ xxh64(out + 72, 32));
}

/// Parses and self-checks a header (magic, version, header checksum, enum ranges, size
/// arithmetic); kCorrupt / kUnsupported otherwise. Does not compare with expectations.
inline Status read_block_header(const std::uint8_t* in, std::size_t n,  // in: [n]
                                BlockHeader* out) {
  using namespace detail;
  KVKIT_CHECK_STATUS(n >= kBlockHeaderBytes, StatusCode::kCorrupt, "block payload of ", n,
                     " bytes is shorter than its ", kBlockHeaderBytes, "-byte header");
  KVKIT_CHECK_STATUS(load_u32(in) == kBlockMagic, StatusCode::kCorrupt, "bad block magic");
  KVKIT_CHECK_STATUS(load_u16(in + 4) == kBlockFormatVersion, StatusCode::kUnsupported,
                     "block format version ", load_u16(in + 4), ", expected ",
                     kBlockFormatVersion);
  KVKIT_CHECK_STATUS(load_u64(in + 64) == (xxh64(in, 64) ^ xxh64(in + 72, 32)),
                     StatusCode::kCorrupt, "block header checksum mismatch");
  KVKIT_CHECK_STATUS(in[6] <= 2 && in[7] <= 1 && in[8] <= 1 && in[9] <= 1 &&
                         load_u16(in + 10) == 0,
                     StatusCode::kCorrupt, "block header enum out of range");
  BlockHeader h;
  h.dtype = static_cast<DType>(in[6]);
  h.layout = static_cast<KVLayout>(in[7]);
  h.codec = static_cast<Codec>(in[8]);
  h.kind = static_cast<KVKind>(in[9]);
  h.layer = load_u32(in + 12);
  h.page_size = load_u32(in + 16);
  h.num_heads = load_u32(in + 20);
  h.head_dim = load_u32(in + 24);
  h.tokens = load_u32(in + 28);
  h.raw_bytes = load_u64(in + 32);
  h.stored_bytes = load_u64(in + 40);
  h.checksum = load_u64(in + 48);
  h.stored_checksum = load_u64(in + 56);
  std::memcpy(h.hash.bytes.data(), in + 72, 32);
  const std::uint64_t rows_bytes = std::uint64_t{h.tokens} * h.num_heads * h.head_dim *
                                   static_cast<std::uint64_t>(dtype_size(h.dtype));
  KVKIT_CHECK_STATUS(h.tokens <= h.page_size && h.raw_bytes == rows_bytes, StatusCode::kCorrupt,
                     "block header sizes disagree: raw_bytes ", h.raw_bytes, " vs ", rows_bytes);
  KVKIT_CHECK_STATUS(h.stored_bytes == n - kBlockHeaderBytes, StatusCode::kCorrupt,
                     "block payload truncated or padded: ", n - kBlockHeaderBytes,
                     " bytes after the header, header says ", h.stored_bytes);
  KVKIT_CHECK_STATUS(h.codec == Codec::kZstd ||
                         (h.stored_bytes == h.raw_bytes && h.stored_checksum == h.checksum),
                     StatusCode::kCorrupt, "raw block stores ", h.stored_bytes, " bytes, expected ",
                     h.raw_bytes);
  *out = h;
  return Status::ok();
}

/// Identity and geometry a caller expects of a payload (taken from its own pool).
struct BlockExpect {
  DType dtype = DType::kFloat32;
  KVKind kind = KVKind::kKey;
  std::uint32_t layer = 0;
  std::uint32_t page_size = 0;
  std::uint32_t num_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t tokens = 0;
  BlockHash hash;
};

namespace detail {

// Visits the rows of `tokens` tokens x `heads` heads of one page in `layout` order: f(row
// index in that order, slot, head).
template <class F>
void for_each_row(KVLayout layout, std::int32_t tokens, std::int32_t heads, F&& f) {
  std::size_t r = 0;
  if (layout == KVLayout::kNHD) {
    for (std::int32_t t = 0; t < tokens; ++t)
      for (std::int32_t h = 0; h < heads; ++h) f(r++, t, h);
  } else {
    for (std::int32_t h = 0; h < heads; ++h)
      for (std::int32_t t = 0; t < tokens; ++t) f(r++, t, h);
  }
}

// Pool base, strides and row length of K or V of a view.
template <class T>
struct PoolSide {
  T* data;  // pool base
  std::int64_t page, token, head;
  std::int32_t dim;
};
template <class T>
PoolSide<T> pool_side(const PagedKVView<T>& v, KVKind kind) {
  if (kind == KVKind::kKey)
    return {v.k_data, v.k_stride_page, v.k_stride_token, v.k_stride_head, v.head_dim};
  return {v.v_data, v.v_stride_page, v.v_stride_token, v.v_stride_head, v.v_head_dim};
}

}  // namespace detail

/// Reusable buffers of encode/decode (rows before compression); keep one per thread so
/// steady-state calls do not allocate.
struct BlockScratch {
  std::string raw;
};

/// Options of encode_block.
struct EncodeOptions {
  Codec codec = Codec::kRaw;       // kZstd needs KVKIT_HAS_ZSTD, else rows are stored raw
  int zstd_level = 1;              // fast: KV rows compress little, speed matters more
  KVLayout layout = KVLayout::kNHD;  // row order of the payload (any pool layout can load it)
};

/// Encodes the first `tokens` rows of page `page` (K or V per `kind`) of a host view into
/// `out` (replaced). Returns kInvalidArgument for a bad page/token count, kIoError if
/// compression fails.
template <class T>
Status encode_block(const PagedKVView<T>& view, KVKind kind, std::int32_t page,
                    std::int32_t tokens, std::uint32_t layer, const BlockHash& hash,
                    const EncodeOptions& opt, BlockScratch& scratch, std::string* out) {
  KVKIT_CHECK_STATUS(view.space == MemorySpace::kHost, StatusCode::kWrongMemorySpace,
                     "encode_block needs a host view");
  KVKIT_CHECK_STATUS(page >= 0 && page < view.num_pages_total, StatusCode::kOutOfRange, "page ",
                     page, " outside [0, ", view.num_pages_total, ")");
  KVKIT_CHECK_STATUS(tokens >= 0 && tokens <= view.page_size, StatusCode::kOutOfRange, "tokens ",
                     tokens, " outside [0, ", view.page_size, "]");
  const detail::PoolSide<T> s = detail::pool_side(view, kind);
  const std::size_t row_bytes = static_cast<std::size_t>(s.dim) * sizeof(T);
  const std::size_t raw_bytes =
      static_cast<std::size_t>(tokens) * static_cast<std::size_t>(view.num_kv_heads) * row_bytes;
  BlockHeader h;
  h.dtype = dtype_of<T>::value;
  h.layout = opt.layout;
  h.kind = kind;
  h.layer = layer;
  h.page_size = static_cast<std::uint32_t>(view.page_size);
  h.num_heads = static_cast<std::uint32_t>(view.num_kv_heads);
  h.head_dim = static_cast<std::uint32_t>(s.dim);
  h.tokens = static_cast<std::uint32_t>(tokens);
  h.raw_bytes = raw_bytes;
  h.hash = hash;
  const T* base = s.data + static_cast<std::int64_t>(page) * s.page;
  const bool compress = opt.codec == Codec::kZstd && zstd_available();
  // Raw rows go straight after the header unless they are compressed from scratch.
  std::uint8_t* rows;
  if (compress) {
    scratch.raw.resize(raw_bytes);
    rows = reinterpret_cast<std::uint8_t*>(&scratch.raw[0]);
  } else {
    out->resize(kBlockHeaderBytes + raw_bytes);
    rows = reinterpret_cast<std::uint8_t*>(&(*out)[0]) + kBlockHeaderBytes;
  }
  detail::for_each_row(opt.layout, tokens, view.num_kv_heads,
                       [&](std::size_t r, std::int32_t t, std::int32_t hd) {
                         std::memcpy(rows + r * row_bytes, base + t * s.token + hd * s.head,
                                     row_bytes);
                       });
  h.checksum = xxh64(rows, raw_bytes);
  if (compress) {
#if defined(KVKIT_HAS_ZSTD) && KVKIT_HAS_ZSTD
    out->resize(kBlockHeaderBytes + ZSTD_compressBound(raw_bytes));
    const std::size_t z = ZSTD_compress(&(*out)[0] + kBlockHeaderBytes,
                                        out->size() - kBlockHeaderBytes, rows, raw_bytes,
                                        opt.zstd_level);
    KVKIT_CHECK_STATUS(!ZSTD_isError(z), StatusCode::kIoError, "zstd compression failed: ",
                       ZSTD_getErrorName(z));
    out->resize(kBlockHeaderBytes + z);
    h.codec = Codec::kZstd;
    h.stored_checksum =
        xxh64(reinterpret_cast<const std::uint8_t*>(out->data()) + kBlockHeaderBytes, z);
#endif
  } else {
    h.stored_checksum = h.checksum;
  }
  h.stored_bytes = out->size() - kBlockHeaderBytes;
  write_block_header(h, reinterpret_cast<std::uint8_t*>(&(*out)[0]));
  return Status::ok();
}

/// Checks `payload` against `expect` (every header field, both checksums, sizes) and, only
/// when everything matches, writes its rows into page `page` of the view (K or V per
/// expect.kind, any pool layout or strides). On failure the page is untouched and the
/// Status says why (kCorrupt, kUnsupported, kInvalidArgument for a geometry mismatch).
template <class T>
Status decode_block(std::string_view payload, const BlockExpect& expect,
                    const PagedKVView<T>& view, std::int32_t page, BlockScratch& scratch) {
  KVKIT_CHECK_STATUS(view.space == MemorySpace::kHost, StatusCode::kWrongMemorySpace,
                     "decode_block needs a host view");
  KVKIT_CHECK_STATUS(page >= 0 && page < view.num_pages_total, StatusCode::kOutOfRange, "page ",
                     page, " outside [0, ", view.num_pages_total, ")");
  const auto* in = reinterpret_cast<const std::uint8_t*>(payload.data());
  BlockHeader h;
  KVKIT_RETURN_IF_ERROR(read_block_header(in, payload.size(), &h));
  const detail::PoolSide<T> s = detail::pool_side(view, expect.kind);
  KVKIT_CHECK_STATUS(h.dtype == dtype_of<T>::value && h.dtype == expect.dtype,
                     StatusCode::kInvalidArgument, "block dtype ", to_string(h.dtype),
                     ", expected ", to_string(expect.dtype));
  KVKIT_CHECK_STATUS(h.kind == expect.kind && h.layer == expect.layer && h.hash == expect.hash,
                     StatusCode::kInvalidArgument, "block identity (layer ", h.layer,
                     ", kind, hash) differs from its key's");
  KVKIT_CHECK_STATUS(
      h.page_size == expect.page_size && h.num_heads == expect.num_heads &&
          h.head_dim == expect.head_dim && h.tokens == expect.tokens &&
          h.page_size == static_cast<std::uint32_t>(view.page_size) &&
          h.num_heads == static_cast<std::uint32_t>(view.num_kv_heads) &&
          h.head_dim == static_cast<std::uint32_t>(s.dim),
      StatusCode::kInvalidArgument, "block geometry page_size=", h.page_size, " heads=",
      h.num_heads, " head_dim=", h.head_dim, " tokens=", h.tokens, " differs from expected ",
      expect.page_size, "/", expect.num_heads, "/", expect.head_dim, "/", expect.tokens);
  const std::uint8_t* rows = in + kBlockHeaderBytes;
  if (h.codec == Codec::kZstd) {
#if defined(KVKIT_HAS_ZSTD) && KVKIT_HAS_ZSTD
    KVKIT_CHECK_STATUS(xxh64(rows, h.stored_bytes) == h.stored_checksum, StatusCode::kCorrupt,
                       "compressed block checksum mismatch");
    scratch.raw.resize(h.raw_bytes);
    const std::size_t z = ZSTD_decompress(&scratch.raw[0], h.raw_bytes, rows, h.stored_bytes);
    KVKIT_CHECK_STATUS(!ZSTD_isError(z) && z == h.raw_bytes, StatusCode::kCorrupt,
                       "zstd block does not decompress to ", h.raw_bytes, " bytes");
    rows = reinterpret_cast<const std::uint8_t*>(scratch.raw.data());
#else
    (void)scratch;
    return make_status(StatusCode::kUnsupported, "zstd block, but built without KVKIT_HAS_ZSTD");
#endif
  }
  // Raw: stored_checksum == checksum (read_block_header checked), so one hash covers both.
  KVKIT_CHECK_STATUS(xxh64(rows, h.raw_bytes) == h.checksum, StatusCode::kCorrupt,
                     "block checksum mismatch");
  const std::size_t row_bytes = static_cast<std::size_t>(s.dim) * sizeof(T);
  T* base = s.data + static_cast<std::int64_t>(page) * s.page;
  detail::for_each_row(h.layout, static_cast<std::int32_t>(h.tokens), view.num_kv_heads,
                       [&](std::size_t r, std::int32_t t, std::int32_t hd) {
                         std::memcpy(base + t * s.token + hd * s.head, rows + r * row_bytes,
                                     row_bytes);
                       });
  return Status::ok();
}

}  // namespace store
}  // namespace kvkit
