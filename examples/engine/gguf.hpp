#pragma once
// GGUF (versions 2 and 3, little-endian) reader: metadata, tensor infos and tensor data,
// with dequantization of F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors to float.
//
// File layout (all little-endian): magic "GGUF", uint32 version, uint64 tensor_count,
// uint64 kv_count; kv_count key/values (gguf string key, uint32 value type, value);
// tensor_count tensor infos (gguf string name, uint32 n_dims, n_dims uint64 ne, uint32
// ggml type, uint64 offset); padding to general.alignment (default 32); the tensor data,
// each tensor at data_offset + offset. A gguf string is a uint64 length and that many bytes
// (no terminator). Dims are listed fastest-first: ne[0] is the row length, so a matrix
// [out][in] in row-major order has ne = {in, out}.
//
// The file is untrusted input: every count, length and offset is checked in 64 bits
// against the bytes actually there before it is used, so a truncated or corrupted file is
// a kvkit::Error naming the file, the field and the byte offset, never a crash or a huge
// allocation. The whole file is memory-mapped (POSIX) or read (elsewhere) once; tensor
// data is returned as pointers into it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// KVKIT_GGUF_MMAP: 1 maps files (POSIX), 0 reads them into memory; define it to choose.
#ifndef KVKIT_GGUF_MMAP
#if defined(__unix__) || defined(__APPLE__)
#define KVKIT_GGUF_MMAP 1
#else
#define KVKIT_GGUF_MMAP 0
#endif
#endif
#if KVKIT_GGUF_MMAP
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

#include "kvkit/core/dtype.hpp"
#include "kvkit/core/error.hpp"

namespace kvkit {
namespace engine {

/// Metadata value types (gguf_metadata_value_type).
enum class GgufType : std::uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

/// Name of a metadata value type ("uint32", "array", ...), "type N" when unknown.
inline std::string gguf_type_name(GgufType t) {
  static const char* const names[] = {"uint8",  "int8",   "uint16", "int16", "uint32",
                                      "int32",  "float32", "bool",  "string", "array",
                                      "uint64", "int64",  "float64"};
  const auto i = static_cast<std::uint32_t>(t);
  return i < 13 ? names[i] : kvkit::detail::concat("type ", i);
}

/// Tensor element types (ggml_type). Only the ones whose byte sizes this reader knows are
/// listed; of those, dequantization supports F32, F16, BF16, Q8_0, Q4_0 and Q4_1.
enum class GgmlType : std::uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kBF16 = 30,
};

/// Block geometry of a tensor type: `block` elements take `bytes` bytes.
struct GgmlTypeTraits {
  const char* name = nullptr;  // null: unknown type
  std::uint32_t block = 0;     // elements per block
  std::uint32_t bytes = 0;     // bytes per block
  bool dequantizable = false;  // supported by dequantize_row
};

/// Traits of ggml type id `t` (name null when this reader does not know the type).
inline GgmlTypeTraits ggml_type_traits(std::uint32_t t) {
  switch (t) {
    case 0: return {"F32", 1, 4, true};
    case 1: return {"F16", 1, 2, true};
    case 2: return {"Q4_0", 32, 18, true};
    case 3: return {"Q4_1", 32, 20, true};
    case 6: return {"Q5_0", 32, 22, false};
    case 7: return {"Q5_1", 32, 24, false};
    case 8: return {"Q8_0", 32, 34, true};
    case 9: return {"Q8_1", 32, 36, false};
    case 10: return {"Q2_K", 256, 84, false};
    case 11: return {"Q3_K", 256, 110, false};
    case 12: return {"Q4_K", 256, 144, false};
    case 13: return {"Q5_K", 256, 176, false};
    case 14: return {"Q6_K", 256, 210, false};
    case 15: return {"Q8_K", 256, 292, false};
    case 24: return {"I8", 1, 1, false};
    case 25: return {"I16", 1, 2, false};
    case 26: return {"I32", 1, 4, false};
    case 27: return {"I64", 1, 8, false};
    case 28: return {"F64", 1, 8, false};
    case 30: return {"BF16", 1, 2, true};
    default: return {};
  }
}

/// Printable name of a tensor type ("Q4_1", or "type N" when unknown).
inline std::string ggml_type_name(std::uint32_t t) {
  const GgmlTypeTraits tr = ggml_type_traits(t);
  return tr.name ? std::string(tr.name) : kvkit::detail::concat("type ", t);
}

/// One metadata value. Scalars are decoded at parse (integers and bools in `i`, uint64
/// also in `u` (`i` saturates), floats in `f`, strings in `s`). Arrays are not copied: they
/// keep their element type, count and a pointer to their encoded elements inside the file
/// image (valid while any copy of the GgufFile lives) and decode elements on access, so a
/// corrupted count can never make the parser allocate more than the file holds. Read them
/// with GgufFile::get_*_array, or elements() / element(k) here.
struct GgufValue {
  GgufType type = GgufType::kUint8;
  std::int64_t i = 0;
  std::uint64_t u = 0;
  double f = 0.0;
  std::string s;
  GgufType array_type = GgufType::kUint8;     // element type when type == kArray
  std::uint64_t array_count = 0;              // elements when type == kArray
  const unsigned char* array_data = nullptr;  // [array_bytes] encoded elements (in the file)
  std::uint64_t array_bytes = 0;

  bool is_integer() const {
    switch (type) {
      case GgufType::kUint8: case GgufType::kInt8: case GgufType::kUint16:
      case GgufType::kInt16: case GgufType::kUint32: case GgufType::kInt32:
      case GgufType::kUint64: case GgufType::kInt64: return true;
      default: return false;
    }
  }
  bool is_float() const { return type == GgufType::kFloat32 || type == GgufType::kFloat64; }
  bool is_array() const { return type == GgufType::kArray; }
  /// "uint32", "string", "array of string", ...
  std::string type_string() const {
    return type == GgufType::kArray ? "array of " + gguf_type_name(array_type) : gguf_type_name(type);
  }
  /// Element count of an array (0 for a scalar).
  std::uint64_t size() const { return is_array() ? array_count : 0; }
  /// Every element of an array, decoded (nested arrays stay lazy). Empty for a scalar.
  inline std::vector<GgufValue> elements() const;
  /// Element k of an array: O(1) for numeric and bool elements, a walk for strings and
  /// arrays. Throws kvkit::Error when k >= size().
  inline GgufValue element(std::uint64_t k) const;
};

/// One metadata entry, in file order.
struct GgufKeyValue {
  std::string key;
  GgufValue value;
};

/// One tensor's description. `offset` is relative to the data section; `file_offset` is
/// absolute. ne[d] for d >= n_dims is 1.
struct GgufTensorInfo {
  std::string name;
  std::uint32_t n_dims = 0;
  std::uint64_t ne[4] = {1, 1, 1, 1};  // fastest-first: ne[0] is the row length
  std::uint32_t type = 0;              // ggml type id (see GgmlType)
  std::uint64_t offset = 0;            // from the start of the data section
  std::uint64_t file_offset = 0;       // from the start of the file
  std::uint64_t n_elements = 0;
  std::uint64_t n_bytes = 0;

  GgmlType ggml_type() const { return static_cast<GgmlType>(type); }
  /// "[576, 49152] Q8_0"
  std::string shape_string() const {
    std::string s = "[";
    for (std::uint32_t d = 0; d < n_dims; ++d) s += (d ? ", " : "") + std::to_string(ne[d]);
    return s + "] " + ggml_type_name(type);
  }
};

namespace detail {

inline float gguf_f16(const unsigned char* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return kvkit::detail::half_bits_to_float(h);
}

// Bounds-checked little-endian cursor over the file image. Messages are built only on
// failure: "what" is a literal and subject() names the key or tensor being read.
class GgufReader {
 public:
  GgufReader(const unsigned char* data /* [size] */, std::uint64_t size, std::string source)
      : data_(data), size_(size), source_(std::move(source)) {}

  std::uint64_t pos() const { return pos_; }
  std::uint64_t remaining() const { return size_ - pos_; }
  const unsigned char* here() const { return data_ + pos_; }
  const std::string& source() const { return source_; }
  void set_subject(std::string s) { subject_ = std::move(s); }
  std::string where() const {
    return subject_.empty() ? std::string() : " of " + subject_;
  }

  void need(std::uint64_t n, const char* what) const {
    if (n > remaining())
      fail("kvkit: gguf ", source_, ": truncated file: ", what, where(), " at byte ", pos_,
           " needs ", n, " bytes but the file has ", remaining(), " left (", size_, " bytes in all)");
  }
  void skip(std::uint64_t n, const char* what) {
    need(n, what);
    pos_ += n;
  }
  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(const char* what) {
    const std::uint64_t n = read<std::uint64_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }

 private:
  const unsigned char* data_;
  std::uint64_t size_;
  std::uint64_t pos_ = 0;
  std::string source_;
  std::string subject_;
};

// Encoded size of a fixed-size value type, 0 for strings and arrays.
inline std::uint64_t gguf_fixed_bytes(GgufType t) {
  switch (t) {
    case GgufType::kUint8: case GgufType::kInt8: case GgufType::kBool: return 1;
    case GgufType::kUint16: case GgufType::kInt16: return 2;
    case GgufType::kUint32: case GgufType::kInt32: case GgufType::kFloat32: return 4;
    case GgufType::kUint64: case GgufType::kInt64: case GgufType::kFloat64: return 8;
    default: return 0;
  }
}

inline constexpr int kGgufMaxArrayDepth = 8;

inline GgufType gguf_read_type(GgufReader& r, const char* what) {
  const std::uint32_t t = r.read<std::uint32_t>(what);
  if (t > 12)
    fail("kvkit: gguf ", r.source(), ": ", what, r.where(), " is unknown (", t, ") at byte ", r.pos() - 4);
  return static_cast<GgufType>(t);
}

// Validates and skips `n` encoded elements of type `t` (arrays nested `depth` deep).
inline void gguf_skip_elements(GgufReader& r, GgufType t, std::uint64_t n, int depth) {
  if (const std::uint64_t size = gguf_fixed_bytes(t)) {
    if (n > r.remaining() / size)
      fail("kvkit: gguf ", r.source(), ": truncated file: an array", r.where(), " claims ", n, " ",
           gguf_type_name(t), " elements (", size, " bytes each) but only ", r.remaining(),
           " bytes are left at byte ", r.pos());
    r.skip(n * size, "array elements");
    return;
  }
  for (std::uint64_t k = 0; k < n; ++k) {
    if (t == GgufType::kString) {
      const std::uint64_t len = r.read<std::uint64_t>("string element length");
      r.skip(len, "string element");
    } else {  // nested array
      if (depth >= kGgufMaxArrayDepth)
        fail("kvkit: gguf ", r.source(), r.where(), ": arrays nested deeper than ",
             kGgufMaxArrayDepth, " levels at byte ", r.pos());
      const GgufType et = gguf_read_type(r, "array element type");
      const std::uint64_t m = r.read<std::uint64_t>("array length");
      gguf_skip_elements(r, et, m, depth + 1);
    }
  }
}

// Decodes one value of type `t` (arrays: validated and referenced, not copied).
inline void gguf_read_value(GgufReader& r, GgufType t, GgufValue& v, int depth) {
  const char* const key = "value";
  v.type = t;
  switch (t) {
    case GgufType::kUint8: v.i = r.read<std::uint8_t>(key); break;
    case GgufType::kInt8: v.i = r.read<std::int8_t>(key); break;
    case GgufType::kUint16: v.i = r.read<std::uint16_t>(key); break;
    case GgufType::kInt16: v.i = r.read<std::int16_t>(key); break;
    case GgufType::kUint32: v.i = r.read<std::uint32_t>(key); break;
    case GgufType::kInt32: v.i = r.read<std::int32_t>(key); break;
    case GgufType::kUint64:
      v.u = r.read<std::uint64_t>(key);
      v.i = static_cast<std::int64_t>(std::min<std::uint64_t>(v.u, std::numeric_limits<std::int64_t>::max()));
      break;
    case GgufType::kInt64: v.i = r.read<std::int64_t>(key); break;
    case GgufType::kFloat32: v.f = r.read<float>(key); break;
    case GgufType::kFloat64: v.f = r.read<double>(key); break;
    case GgufType::kBool: v.i = r.read<std::uint8_t>(key) != 0; break;
    case GgufType::kString: v.s = r.read_string("string value"); break;
    case GgufType::kArray: {
      if (depth >= kGgufMaxArrayDepth)
        fail("kvkit: gguf ", r.source(), r.where(), ": arrays nested deeper than ",
             kGgufMaxArrayDepth, " levels at byte ", r.pos());
      v.array_type = gguf_read_type(r, "array element type");
      v.array_count = r.read<std::uint64_t>("array length");
      const std::uint64_t start = r.pos();
      v.array_data = r.here();
      gguf_skip_elements(r, v.array_type, v.array_count, depth + 1);
      v.array_bytes = r.pos() - start;
      break;
    }
  }
}

}  // namespace detail

inline std::vector<GgufValue> GgufValue::elements() const {
  std::vector<GgufValue> out;
  if (!is_array()) return out;
  out.resize(static_cast<std::size_t>(array_count));
  detail::GgufReader r(array_data, array_bytes, "array");
  for (GgufValue& e : out) detail::gguf_read_value(r, array_type, e, 1);
  return out;
}

inline GgufValue GgufValue::element(std::uint64_t k) const {
  KVKIT_CHECK(is_array() && k < array_count, "kvkit: gguf: element ", k, " of a ", type_string(),
              " value of ", size(), " elements");
  detail::GgufReader r(array_data, array_bytes, "array");
  if (const std::uint64_t size = detail::gguf_fixed_bytes(array_type)) {
    r.skip(k * size, "array element");
  } else {
    detail::gguf_skip_elements(r, array_type, k, 1);
  }
  GgufValue e;
  detail::gguf_read_value(r, array_type, e, 1);
  return e;
}

/// Converts `n` elements of a tensor of ggml type `type` starting at `src` to float.
/// `n` must be a multiple of the type's block size (tensor rows always are). Throws
/// kvkit::Error for a type without dequantization support.
///
/// Block layouts (GGML): Q8_0 = f16 scale d + 32 int8 q, value q*d. Q4_0 = f16 d + 16 bytes,
/// byte j holds element j in its low nibble and element j+16 in its high nibble, value
/// (q-8)*d. Q4_1 = f16 d, f16 m + 16 bytes as Q4_0, value q*d + m.
inline void dequantize_row(std::uint32_t type, const void* src /* [bytes of n elements] */,
                           float* dst /* [n] */, std::uint64_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(src);
  const GgmlTypeTraits tr = ggml_type_traits(type);
  KVKIT_CHECK(tr.dequantizable, "kvkit: gguf: dequantizing tensor type ", ggml_type_name(type),
              " is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
  KVKIT_CHECK(n % tr.block == 0, "kvkit: gguf: ", n, " elements is not a multiple of the ",
              tr.name, " block size ", tr.block);
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: std::memcpy(dst, p, static_cast<std::size_t>(n) * 4); break;
    case GgmlType::kF16:
      for (std::uint64_t i = 0; i < n; ++i) dst[i] = detail::gguf_f16(p + 2 * i);
      break;
    case GgmlType::kBF16:
      for (std::uint64_t i = 0; i < n; ++i) {
        std::uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        dst[i] = kvkit::detail::bf16_bits_to_float(b);
      }
      break;
    case GgmlType::kQ8_0:
      for (std::uint64_t b = 0; b < n / 32; ++b, p += 34, dst += 32) {
        const float d = detail::gguf_f16(p);
        for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(static_cast<std::int8_t>(p[2 + j])) * d;
      }
      break;
    case GgmlType::kQ4_0:
      for (std::uint64_t b = 0; b < n / 32; ++b, p += 18, dst += 32) {
        const float d = detail::gguf_f16(p);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>((p[2 + j] & 0x0f) - 8) * d;
          dst[j + 16] = static_cast<float>((p[2 + j] >> 4) - 8) * d;
        }
      }
      break;
    case GgmlType::kQ4_1:
      for (std::uint64_t b = 0; b < n / 32; ++b, p += 20, dst += 32) {
        const float d = detail::gguf_f16(p), m = detail::gguf_f16(p + 2);
        for (int j = 0; j < 16; ++j) {
          dst[j] = static_cast<float>(p[4 + j] & 0x0f) * d + m;
          dst[j + 16] = static_cast<float>(p[4 + j] >> 4) * d + m;
        }
      }
      break;
    default: fail("kvkit: gguf: dequantizing ", ggml_type_name(type), " is not supported");
  }
}

/// A parsed GGUF file: metadata in file order and by key, tensor infos, and the file image
/// the tensor data points into. Cheap to copy (the image is shared).
class GgufFile {
 public:
  GgufFile() = default;

  /// Maps (or reads) the file at `path` and parses it; throws kvkit::Error naming the file
  /// and the problem (missing file, bad magic or version, truncation, bad tensor info).
  static GgufFile open(const std::string& path) {
    GgufFile g;
    g.source_ = "'" + path + "'";
#if KVKIT_GGUF_MMAP
    const int fd = ::open(path.c_str(), O_RDONLY);
    KVKIT_CHECK(fd >= 0, "kvkit: cannot open gguf file '", path, "'");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      fail("kvkit: cannot stat gguf file '", path, "'");
    }
    const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
    if (size == 0) {
      ::close(fd);
      fail("kvkit: gguf '", path, "': truncated file: the file is empty (0 bytes)");
    }
    void* m = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    KVKIT_CHECK(m != MAP_FAILED, "kvkit: cannot map gguf file '", path, "' (", size, " bytes)");
    const std::size_t len = static_cast<std::size_t>(size);
    g.owner_ = std::shared_ptr<const void>(m, [len](const void* q) { ::munmap(const_cast<void*>(q), len); });
    g.data_ = static_cast<const unsigned char*>(m);
    g.size_ = size;
#else
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    KVKIT_CHECK(in.good(), "kvkit: cannot open gguf file '", path, "'");
    const std::streamoff size = in.tellg();
    KVKIT_CHECK(size >= 0, "kvkit: cannot read the size of gguf file '", path, "'");
    auto bytes = std::make_shared<std::vector<unsigned char>>(static_cast<std::size_t>(size));
    in.seekg(0);
    if (size > 0) in.read(reinterpret_cast<char*>(bytes->data()), size);
    KVKIT_CHECK(in.good(), "kvkit: read error in gguf file '", path, "'");
    g.data_ = bytes->data();
    g.size_ = bytes->size();
    g.owner_ = bytes;
#endif
    g.parse_image();
    return g;
  }

  /// Parses a GGUF image held in memory (tests build files this way). `source` names it in
  /// error messages.
  static GgufFile parse(std::vector<unsigned char> bytes, const std::string& source = "<memory>") {
    GgufFile g;
    g.source_ = source;
    auto owned = std::make_shared<std::vector<unsigned char>>(std::move(bytes));
    g.data_ = owned->data();
    g.size_ = owned->size();
    g.owner_ = owned;
    g.parse_image();
    return g;
  }

  const std::string& source() const { return source_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t file_size() const { return size_; }
  std::uint64_t alignment() const { return alignment_; }
  /// Byte offset of the tensor data section.
  std::uint64_t data_offset() const { return data_offset_; }

  // --- metadata ---------------------------------------------------------------------

  /// All key/values in file order.
  const std::vector<GgufKeyValue>& metadata() const { return kv_; }
  /// The value of `key`, or null when absent.
  const GgufValue* find(const std::string& key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second].value;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  /// A string value; throws when absent or not a string.
  std::string get_string(const std::string& key) const { return as_string(require(key), key); }
  std::string get_string(const std::string& key, const std::string& fallback) const {
    const GgufValue* v = find(key);
    return v ? as_string(*v, key) : fallback;
  }
  /// Any integer type (or bool) as int64; throws when absent, not an integer, or a uint64
  /// above INT64_MAX.
  std::int64_t get_int(const std::string& key) const { return as_int(require(key), key); }
  std::int64_t get_int(const std::string& key, std::int64_t fallback) const {
    const GgufValue* v = find(key);
    return v ? as_int(*v, key) : fallback;
  }
  /// float32 / float64 (integers are accepted too) as double.
  double get_float(const std::string& key) const { return as_float(require(key), key); }
  double get_float(const std::string& key, double fallback) const {
    const GgufValue* v = find(key);
    return v ? as_float(*v, key) : fallback;
  }
  bool get_bool(const std::string& key) const {
    const GgufValue& v = require(key);
    KVKIT_CHECK(v.type == GgufType::kBool, "kvkit: gguf ", source_, ": key '", key,
                "' is ", v.type_string(), ", expected bool");
    return v.i != 0;
  }
  bool get_bool(const std::string& key, bool fallback) const { return has(key) ? get_bool(key) : fallback; }

  /// Element count of an array value; throws when absent or not an array.
  std::uint64_t array_size(const std::string& key) const { return require_array(key).array_count; }
  /// An array of strings (tokenizer.ggml.tokens, merges); throws on another element type.
  std::vector<std::string> get_string_array(const std::string& key) const {
    std::vector<std::string> out;
    for_each_element(key, [&](GgufValue& e) { out.push_back(std::move(e.s)); }, "string");
    return out;
  }
  /// An array of integers of any integer type (or bools) as int64.
  std::vector<std::int64_t> get_int_array(const std::string& key) const {
    std::vector<std::int64_t> out;
    for_each_element(key, [&](GgufValue& e) { out.push_back(as_int(e, key + " element")); }, "integer");
    return out;
  }
  /// An array of numbers (floats or integers) as double.
  std::vector<double> get_float_array(const std::string& key) const {
    std::vector<double> out;
    for_each_element(key, [&](GgufValue& e) { out.push_back(as_float(e, key + " element")); }, "number");
    return out;
  }

  // --- tensors ----------------------------------------------------------------------

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  /// The tensor named `name`, or null when absent.
  const GgufTensorInfo* tensor(const std::string& name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  /// The tensor's bytes (n_bytes of them; bounds were checked at parse).
  const unsigned char* tensor_data(const GgufTensorInfo& t) const {
    return data_ + t.file_offset;
  }
  /// Dequantizes the whole tensor into `out` (n_elements floats).
  void dequantize(const GgufTensorInfo& t, float* out /* [t.n_elements] */) const {
    KVKIT_CHECK(ggml_type_traits(t.type).dequantizable, "kvkit: gguf ", source_, ": tensor '",
                t.name, "' has type ", ggml_type_name(t.type),
                ", which this reader cannot dequantize (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
    dequantize_row(t.type, tensor_data(t), out, t.n_elements);
  }
  std::vector<float> dequantize(const GgufTensorInfo& t) const {
    std::vector<float> out(static_cast<std::size_t>(t.n_elements));
    dequantize(t, out.data());
    return out;
  }

 private:
  const GgufValue& require(const std::string& key) const {
    const GgufValue* v = find(key);
    if (!v) fail("kvkit: gguf ", source_, ": missing metadata key '", key, "'");
    return *v;
  }
  // Decodes each element of array `key` into one reused value and hands it to f; throws
  // (naming `expected`) when the elements are not of an acceptable type.
  template <class F>
  void for_each_element(const std::string& key, F f, const char* expected) const {
    const GgufValue& v = require_array(key);
    GgufValue probe;
    probe.type = v.array_type;
    const bool ok = std::string(expected) == "string"
                        ? v.array_type == GgufType::kString
                        : (probe.is_integer() || v.array_type == GgufType::kBool ||
                           (std::string(expected) == "number" && probe.is_float()));
    KVKIT_CHECK(ok, "kvkit: gguf ", source_, ": key '", key, "' is ", v.type_string(),
                ", expected an array of ", expected, "s");
    detail::GgufReader r(v.array_data, v.array_bytes, source_);
    GgufValue e;
    for (std::uint64_t k = 0; k < v.array_count; ++k) {
      detail::gguf_read_value(r, v.array_type, e, 1);
      f(e);
    }
  }
  const GgufValue& require_array(const std::string& key) const {
    const GgufValue& v = require(key);
    KVKIT_CHECK(v.type == GgufType::kArray, "kvkit: gguf ", source_, ": key '", key, "' is ",
                v.type_string(), ", expected an array");
    return v;
  }
  std::string as_string(const GgufValue& v, const std::string& key) const {
    KVKIT_CHECK(v.type == GgufType::kString, "kvkit: gguf ", source_, ": key '", key, "' is ",
                v.type_string(), ", expected string");
    return v.s;
  }
  std::int64_t as_int(const GgufValue& v, const std::string& key) const {
    KVKIT_CHECK(v.is_integer() || v.type == GgufType::kBool, "kvkit: gguf ", source_, ": key '",
                key, "' is ", v.type_string(), ", expected an integer");
    KVKIT_CHECK(v.type != GgufType::kUint64 ||
                    v.u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
                "kvkit: gguf ", source_, ": key '", key, "' = ", v.u, " does not fit in int64");
    return v.i;
  }
  double as_float(const GgufValue& v, const std::string& key) const {
    if (v.is_float()) return v.f;
    KVKIT_CHECK(v.is_integer(), "kvkit: gguf ", source_, ": key '", key, "' is ", v.type_string(),
                ", expected a number");
    return v.type == GgufType::kUint64 ? static_cast<double>(v.u) : static_cast<double>(v.i);
  }

  void parse_image() {
    detail::GgufReader r(data_, size_, source_);
    r.need(4, "magic");
    if (std::memcmp(data_, "GGUF", 4) != 0) {
      char m[4];
      std::memcpy(m, data_, 4);
      std::string shown;
      for (char c : m) shown += (c >= 32 && c < 127) ? c : '?';
      fail("kvkit: gguf ", source_, ": bad magic '", shown, "' (expected 'GGUF'): not a GGUF file");
    }
    r.read<std::uint32_t>("magic");
    version_ = r.read<std::uint32_t>("version");
    KVKIT_CHECK(version_ == 2 || version_ == 3, "kvkit: gguf ", source_, ": unsupported GGUF version ",
                version_, " (this reader handles versions 2 and 3)");
    const std::uint64_t n_tensors = r.read<std::uint64_t>("tensor count");
    const std::uint64_t n_kv = r.read<std::uint64_t>("metadata count");
    // Each key/value takes at least 8 (key length) + 4 (type) + 1 bytes; each tensor info
    // at least 8 + 4 + 4 + 8.
    if (n_kv > r.remaining() / 13)
      fail("kvkit: gguf ", source_, ": truncated file: ", n_kv, " metadata entries cannot fit in the ",
           r.remaining(), " bytes left at byte ", r.pos());
    kv_.reserve(static_cast<std::size_t>(n_kv));
    for (std::uint64_t k = 0; k < n_kv; ++k) {
      GgufKeyValue kv;
      r.set_subject(kvkit::detail::concat("metadata entry #", k));
      kv.key = r.read_string("key");
      r.set_subject("key '" + kv.key + "'");
      const GgufType t = detail::gguf_read_type(r, "value type");
      detail::gguf_read_value(r, t, kv.value, 0);
      KVKIT_CHECK(kv_index_.emplace(kv.key, kv_.size()).second, "kvkit: gguf ", source_,
                  ": duplicate metadata key '", kv.key, "'");
      kv_.push_back(std::move(kv));
    }
    alignment_ = 32;
    if (const GgufValue* a = find("general.alignment")) {
      KVKIT_CHECK(a->is_integer(), "kvkit: gguf ", source_, ": general.alignment is ",
                  a->type_string(), ", expected an integer");
      const std::uint64_t al = a->type == GgufType::kUint64 ? a->u : static_cast<std::uint64_t>(a->i);
      KVKIT_CHECK(a->i > 0 && (al & (al - 1)) == 0 && al <= (1u << 20), "kvkit: gguf ", source_,
                  ": general.alignment ", a->i, " is not a power of two in [1, 2^20]");
      alignment_ = al;
    }
    if (n_tensors > r.remaining() / 24)
      fail("kvkit: gguf ", source_, ": truncated file: ", n_tensors, " tensor infos cannot fit in the ",
           r.remaining(), " bytes left at byte ", r.pos());
    tensors_.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t k = 0; k < n_tensors; ++k) {
      GgufTensorInfo t;
      r.set_subject(kvkit::detail::concat("tensor info #", k));
      t.name = r.read_string("name");
      const std::string what = "tensor '" + t.name + "'";
      r.set_subject(what);
      t.n_dims = r.read<std::uint32_t>("dimension count");
      KVKIT_CHECK(t.n_dims >= 1 && t.n_dims <= 4, "kvkit: gguf ", source_, ": ", what, " has ",
                  t.n_dims, " dimensions (expected 1 to 4)");
      t.n_elements = 1;
      for (std::uint32_t d = 0; d < t.n_dims; ++d) {
        t.ne[d] = r.read<std::uint64_t>("shape");
        KVKIT_CHECK(t.ne[d] > 0 && t.ne[d] <= (std::uint64_t{1} << 40) &&
                        t.n_elements <= (std::uint64_t{1} << 50) / t.ne[d],
                    "kvkit: gguf ", source_, ": ", what, " has an invalid dimension ne[", d,
                    "] = ", t.ne[d]);
        t.n_elements *= t.ne[d];
      }
      t.type = r.read<std::uint32_t>("type");
      const GgmlTypeTraits tr = ggml_type_traits(t.type);
      KVKIT_CHECK(tr.name != nullptr, "kvkit: gguf ", source_, ": ", what,
                  " has an unsupported tensor type ", t.type);
      KVKIT_CHECK(t.ne[0] % tr.block == 0, "kvkit: gguf ", source_, ": ", what, " row length ",
                  t.ne[0], " is not a multiple of the ", tr.name, " block size ", tr.block);
      t.n_bytes = t.n_elements / tr.block * tr.bytes;  // < 2^50 * 292 / 1: no overflow
      t.offset = r.read<std::uint64_t>("offset");
      KVKIT_CHECK(t.offset % alignment_ == 0, "kvkit: gguf ", source_, ": ", what, " offset ",
                  t.offset, " is not a multiple of the alignment ", alignment_);
      KVKIT_CHECK(tensor_index_.emplace(t.name, tensors_.size()).second, "kvkit: gguf ", source_,
                  ": duplicate tensor name '", t.name, "'");
      tensors_.push_back(std::move(t));
    }
    const std::uint64_t header_end = r.pos();
    data_offset_ = header_end + (alignment_ - header_end % alignment_) % alignment_;
    if (!tensors_.empty() && data_offset_ > size_)
      fail("kvkit: gguf ", source_, ": truncated file: the tensor data section starts at byte ",
           data_offset_, " but the file has ", size_, " bytes");
    for (GgufTensorInfo& t : tensors_) {
      const std::uint64_t avail = size_ - data_offset_;
      if (t.offset > avail || t.n_bytes > avail - t.offset)
        fail("kvkit: gguf ", source_, ": tensor '", t.name, "' ", t.shape_string(), " (bytes ",
             t.offset, " to ", t.offset + t.n_bytes, " of the data section at byte ", data_offset_,
             ") lies past the end of the file (", size_, " bytes; truncated?)");
      t.file_offset = data_offset_ + t.offset;
    }
  }

  std::shared_ptr<const void> owner_;
  const unsigned char* data_ = nullptr;  // [size_]
  std::uint64_t size_ = 0;
  std::string source_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::uint64_t data_offset_ = 0;
  std::vector<GgufKeyValue> kv_;
  std::unordered_map<std::string, std::size_t> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, std::size_t> tensor_index_;
};

}  // namespace engine
}  // namespace kvkit
