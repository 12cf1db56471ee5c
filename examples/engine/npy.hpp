#pragma once
// Minimal NumPy .npy files (format version 1.0, C order, little-endian '<f4', '<f8' and
// '<i8'),
// so traces of the engine open directly with numpy.load.
//
// Layout: magic "\x93NUMPY", version bytes 1 0, a little-endian uint16 header length,
// then an ASCII dict {'descr': ..., 'fortran_order': False, 'shape': (...), } padded
// with spaces and a final '\n' so the data starts at a multiple of 64 bytes.

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kvkit/core/error.hpp"

namespace kvkit {
namespace engine {

namespace detail {

template <class T>
struct NpyDescr;
template <>
struct NpyDescr<float> {
  static constexpr const char* value = "<f4";
};
template <>
struct NpyDescr<double> {
  static constexpr const char* value = "<f8";
};
template <>
struct NpyDescr<std::int64_t> {
  static constexpr const char* value = "<i8";
};

inline bool host_is_little_endian() {
  const std::uint16_t one = 1;
  unsigned char b;
  std::memcpy(&b, &one, 1);
  return b == 1;
}

}  // namespace detail

/// The header bytes (magic through padding) of a v1.0 .npy file.
inline std::string npy_header(const char* descr, const std::vector<std::int64_t>& shape) {
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  const std::size_t prefix = 10;  // magic(6) + version(2) + header length(2)
  std::size_t total = prefix + dict.size() + 1;
  total = (total + 63) / 64 * 64;
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict += '\n';
  KVKIT_CHECK(dict.size() <= 65535, "kvkit: npy header of ", dict.size(), " bytes is too long");
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(dict.size() & 0xff);
  out += static_cast<char>((dict.size() >> 8) & 0xff);
  return out + dict;
}

/// Writes `data` (prod(shape) elements, C order) as a .npy file. T is float, double or
/// int64_t.
/// Throws kvkit::Error when the file cannot be written.
template <class T>
void write_npy(const std::string& path, const T* data /* [prod(shape)] */,
               const std::vector<std::int64_t>& shape) {
  KVKIT_CHECK(detail::host_is_little_endian(), "kvkit: write_npy supports little-endian hosts only");
  std::int64_t count = 1;
  for (std::int64_t d : shape) {
    KVKIT_CHECK(d >= 0, "kvkit: npy dimension ", d, " is negative");
    count *= d;
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KVKIT_CHECK(out.good(), "kvkit: cannot create '", path, "'");
  const std::string header = npy_header(detail::NpyDescr<T>::value, shape);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  if (count > 0)
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(count * sizeof(T)));
  KVKIT_CHECK(out.good(), "kvkit: write error in '", path, "'");
}

/// A .npy file read back: its descr, shape and raw little-endian payload.
struct NpyArray {
  std::string descr;                  // "<f4", "<f8" or "<i8"
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;   // [prod(shape) * item size]

  std::int64_t size() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    return n;
  }
  /// Copies the payload out as T (descr must match T); throws kvkit::Error otherwise.
  template <class T>
  std::vector<T> as() const {
    KVKIT_CHECK(descr == detail::NpyDescr<T>::value, "kvkit: npy array holds ", descr,
                ", requested ", detail::NpyDescr<T>::value);
    std::vector<T> v(bytes.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
    return v;
  }
};

/// Reads a v1.0 .npy file written by write_npy (C order, '<f4', '<f8' or '<i8'); throws
/// kvkit::Error naming the problem for anything else or for a wrong payload size.
inline NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KVKIT_CHECK(in.good(), "kvkit: cannot open '", path, "'");
  char pre[10];
  in.read(pre, 10);
  KVKIT_CHECK(in.good() && std::memcmp(pre, "\x93NUMPY", 6) == 0, "kvkit: '", path,
              "' is not a .npy file");
  KVKIT_CHECK(pre[6] == 1 && pre[7] == 0, "kvkit: '", path, "' has npy version ",
              static_cast<int>(pre[6]), ".", static_cast<int>(pre[7]), ", only 1.0 is supported");
  const std::size_t hlen = static_cast<unsigned char>(pre[8]) |
                           (static_cast<std::size_t>(static_cast<unsigned char>(pre[9])) << 8);
  std::string dict(hlen, '\0');
  in.read(&dict[0], static_cast<std::streamsize>(hlen));
  KVKIT_CHECK(in.good(), "kvkit: '", path, "' has a truncated npy header");
  NpyArray a;
  auto field = [&](const std::string& key) {
    const std::size_t p = dict.find("'" + key + "': ");
    KVKIT_CHECK(p != std::string::npos, "kvkit: '", path, "' npy header lacks ", key);
    return p + key.size() + 4;
  };
  std::size_t p = field("descr");
  const std::size_t q = dict.find('\'', p + 1);
  KVKIT_CHECK(dict[p] == '\'' && q != std::string::npos, "kvkit: '", path, "' has a bad descr");
  a.descr = dict.substr(p + 1, q - p - 1);
  KVKIT_CHECK(a.descr == "<f4" || a.descr == "<f8" || a.descr == "<i8", "kvkit: '", path,
              "' has dtype ", a.descr, ", only <f4, <f8 and <i8 are supported");
  p = field("fortran_order");
  KVKIT_CHECK(dict.compare(p, 5, "False") == 0, "kvkit: '", path, "' is in Fortran order");
  p = field("shape");
  KVKIT_CHECK(dict[p] == '(', "kvkit: '", path, "' has a bad shape");
  const std::size_t close = dict.find(')', p);
  KVKIT_CHECK(close != std::string::npos, "kvkit: '", path, "' has a bad shape");
  std::string dims = dict.substr(p + 1, close - p - 1);
  std::size_t i = 0;
  while (i < dims.size()) {
    while (i < dims.size() && (dims[i] == ' ' || dims[i] == ',')) ++i;
    if (i >= dims.size()) break;
    KVKIT_CHECK(dims[i] >= '0' && dims[i] <= '9', "kvkit: '", path, "' has a bad shape (", dims, ")");
    std::int64_t d = 0;
    for (; i < dims.size() && dims[i] >= '0' && dims[i] <= '9'; ++i) d = d * 10 + (dims[i] - '0');
    a.shape.push_back(d);
  }
  const std::size_t expect = static_cast<std::size_t>(a.size()) * (a.descr == "<f4" ? 4 : 8);
  a.bytes.resize(expect);
  if (expect) in.read(reinterpret_cast<char*>(a.bytes.data()), static_cast<std::streamsize>(expect));
  KVKIT_CHECK(in.good(), "kvkit: '", path, "' payload is shorter than shape implies (",
              expect, " bytes)");
  in.peek();
  KVKIT_CHECK(in.eof(), "kvkit: '", path, "' has bytes after the payload");
  return a;
}

}  // namespace engine
}  // namespace kvkit
