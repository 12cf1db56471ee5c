#pragma once
// Redis Cluster key slots: CRC16 (XMODEM) of the key, or of its hash tag, mod 16384.
//
// This is the routing function of a cluster client; the cluster backend itself (slot map
// from CLUSTER SLOTS, MOVED / ASK / TRYAGAIN handling) is redis_cluster_store.hpp. With
// KeyStyle::kClusterTagged block keys, the tag is the block hash, so all 2L keys of one
// block (every layer, K and V) share a slot and a block lives on one node.
// Dependency-free: no hiredis needed for this header.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvkit {
namespace store {

/// Slots of a Redis Cluster.
inline constexpr int kClusterSlots = 16384;

/// CRC16-CCITT (XMODEM: polynomial 0x1021, initial value 0, no reflection), the checksum
/// Redis Cluster hashes keys with. crc16_xmodem("123456789") == 0x31C3.
inline std::uint16_t crc16_xmodem(const void* data, std::size_t n) {  // data: [n]
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::uint16_t crc = 0;
  for (std::size_t i = 0; i < n; ++i) {
    crc = static_cast<std::uint16_t>(crc ^ (static_cast<std::uint16_t>(p[i]) << 8));
    for (int b = 0; b < 8; ++b)
      crc = static_cast<std::uint16_t>((crc & 0x8000u) ? (crc << 1) ^ 0x1021u : crc << 1);
  }
  return crc;
}

/// The part of a key Redis Cluster hashes: the bytes between the first '{' and the first
/// '}' after it when that is non-empty, else the whole key.
inline std::string_view cluster_hash_part(std::string_view key) {
  const std::size_t open = key.find('{');
  if (open == std::string_view::npos) return key;
  const std::size_t close = key.find('}', open + 1);
  if (close == std::string_view::npos || close == open + 1) return key;
  return key.substr(open + 1, close - open - 1);
}

/// Cluster slot of a key (what CLUSTER KEYSLOT answers), in [0, 16384).
inline int cluster_key_slot(std::string_view key) {
  const std::string_view part = cluster_hash_part(key);
  return crc16_xmodem(part.data(), part.size()) & (kClusterSlots - 1);
}

}  // namespace store
}  // namespace kvkit
