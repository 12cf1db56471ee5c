#pragma once
// Test helpers shared by kernel tests (CPU and CUDA parity): seeded random fills,
// random paged pools with shuffled page ids, float64 reference implementations of the
// core KV operations, and tolerance checks. Generic over T in {float, half_t, bfloat16_t}.
//
// References read the same rounded T values the kernels read, so the remaining error
// is only the kernel's own float arithmetic and its final rounding to T.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kvkit/core/dtype.hpp"
#include "kvkit/core/paged_kv_view.hpp"

namespace kvkit {
namespace test {

/// Seed for a test's generator: $KVKIT_TEST_SEED when set (to replay a failure), else
/// fresh entropy. Tests print it (Catch INFO / CAPTURE) so failures can be replayed.
inline std::uint64_t test_seed() {
  if (const char* s = std::getenv("KVKIT_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

/// Declares `std::mt19937_64 name` seeded by test_seed() and logs the seed for every
/// failure in the enclosing block (a macro because Catch's INFO is scoped to the block it
/// is written in). The including file must include <catch2/catch.hpp>.
#define KVKIT_TEST_RNG(name)                                     \
  const std::uint64_t name##_seed = ::kvkit::test::test_seed(); \
  INFO("seed " << name##_seed);                                 \
  std::mt19937_64 name(name##_seed)

template <class T>
inline double to_double(T x) {
  return static_cast<double>(to_float(x));
}

/// Fills p[0..n) with values uniform in [lo, hi), rounded to T. Retries the (astronomically
/// unlikely) all-zero outcome so no check ever runs on zeros.
template <class T>
void fill_uniform(T* p, std::size_t n, std::mt19937_64& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  bool nonzero = false;
  while (!nonzero && n > 0) {
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = from_float<T>(dist(rng));
      nonzero = nonzero || to_float(p[i]) != 0.f;
    }
  }
}

template <class T>
std::vector<T> random_vector(std::size_t n, std::mt19937_64& rng, float lo = -1.f, float hi = 1.f) {
  std::vector<T> v(n);
  fill_uniform(v.data(), n, rng, lo, hi);
  return v;
}

/// Bitwise equality of two T arrays (exact copies must match bit for bit, -0 and NaN too).
template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// Bitwise equality of two T values.
template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// Shape of a random pool.
struct PoolSpec {
  std::int32_t num_kv_heads = 2;
  std::int32_t head_dim = 16;
  std::int32_t page_size = 4;
  KVLayout layout = KVLayout::kNHD;
  PageTableKind table = PageTableKind::kCsr;
  std::vector<std::int32_t> seq_lens;  // one entry per sequence; 0 allowed
  std::int32_t spare_pages = 3;        // pool pages no sequence uses (copy targets)
  std::int32_t row_padding = 0;        // extra elements after each head_dim row (strided pools)
  std::int32_t page_padding = 0;       // extra elements after each page
  std::int32_t v_head_dim = 0;         // V row length; 0: head_dim
  int v_layout = -1;                   // V's KVLayout as an int; -1: same as layout
};

/// Page-table arrays a view points at (host or device copies of RandomPool's vectors).
struct TableArrays {
  const std::int32_t* indptr = nullptr;         // [batch + 1]
  const std::int32_t* indices = nullptr;        // [nnz]
  const std::int32_t* last_page_len = nullptr;  // [batch]
  const std::int32_t* block_table = nullptr;    // [batch, row_stride]
  const std::int32_t* seq_lens = nullptr;       // [batch]
};

/// A paged K/V pool filled with random values (every element, padding and unused pages
/// included, so tests can see that untouched memory stays untouched), whose sequences get
/// their pages from a random permutation of the pool. Movable (the view stays valid: moved
/// vectors keep their buffers), not copyable.
template <class T>
class RandomPool {
 public:
  RandomPool(const PoolSpec& spec, std::mt19937_64& rng) : spec_(spec) {
    const std::int32_t batch = static_cast<std::int32_t>(spec.seq_lens.size());
    std::int32_t used = 0, max_pages = 0;
    for (std::int32_t len : spec.seq_lens) {
      const std::int32_t np = (len + spec.page_size - 1) / spec.page_size;
      used += np;
      max_pages = std::max(max_pages, np);
    }
    geometry = KVGeometry{spec.num_kv_heads, spec.head_dim, spec.page_size,
                          std::max(1, used + spec.spare_pages), spec.v_head_dim};
    // Strides of a packed layout whose rows are dim + row_padding long.
    auto make_strides = [&](std::int32_t dim, KVLayout layout) -> KVStrides {
      const std::int64_t row = dim + spec.row_padding;
      const std::int64_t page_elems =
          static_cast<std::int64_t>(spec.page_size) * spec.num_kv_heads * row;
      if (layout == KVLayout::kNHD)
        return {page_elems + spec.page_padding, spec.num_kv_heads * row, row};
      return {page_elems + spec.page_padding, row, spec.page_size * row};
    };
    strides = make_strides(spec.head_dim, spec.layout);
    v_strides = make_strides(geometry.v_dim(), spec.v_layout < 0
                                                   ? spec.layout
                                                   : static_cast<KVLayout>(spec.v_layout));
    k = random_vector<T>(static_cast<std::size_t>(strides.page) * geometry.num_pages, rng);
    v = random_vector<T>(static_cast<std::size_t>(v_strides.page) * geometry.num_pages, rng);

    std::vector<std::int32_t> perm(static_cast<std::size_t>(geometry.num_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::size_t next = 0;
    pages.resize(static_cast<std::size_t>(batch));
    row_stride = max_pages + 1;  // one spare column, as engines over-allocate rows
    indptr.assign(1, 0);
    block_table.assign(static_cast<std::size_t>(batch) * row_stride, -1);
    seq_lens = spec.seq_lens;
    for (std::int32_t b = 0; b < batch; ++b) {
      const std::int32_t len = spec.seq_lens[static_cast<std::size_t>(b)];
      const std::int32_t np = (len + spec.page_size - 1) / spec.page_size;
      for (std::int32_t i = 0; i < np; ++i) {
        const std::int32_t p = perm[next++];
        pages[static_cast<std::size_t>(b)].push_back(p);
        indices.push_back(p);
        block_table[static_cast<std::size_t>(b) * row_stride + i] = p;
      }
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last_page_len.push_back(np == 0 ? 0 : len - (np - 1) * spec.page_size);
    }
    free_pages.assign(perm.begin() + static_cast<std::ptrdiff_t>(next), perm.end());
    view = make_view_over(k.data(), v.data(), host_tables(), MemorySpace::kHost);
  }
  RandomPool(RandomPool&&) = default;
  RandomPool& operator=(RandomPool&&) = default;
  RandomPool(const RandomPool&) = delete;
  RandomPool& operator=(const RandomPool&) = delete;

  const PoolSpec& spec() const { return spec_; }
  std::int32_t batch_size() const { return static_cast<std::int32_t>(spec_.seq_lens.size()); }

  /// This pool's page-table arrays on the host.
  TableArrays host_tables() const {
    return {indptr.data(), indices.data(), last_page_len.data(), block_table.data(),
            seq_lens.data()};
  }
  /// A view with this pool's geometry, strides and table kind over other copies of its
  /// storage and tables (e.g. device buffers of the same sizes).
  template <class U>
  PagedKVView<U> make_view_over(U* k_base, U* v_base, const TableArrays& t,
                                MemorySpace space) const {
    if (spec_.table == PageTableKind::kCsr)
      return make_csr_view(geometry, k_base, strides, v_base, v_strides,
                           CsrPageTable{t.indptr, t.indices, t.last_page_len, batch_size()}, space);
    return make_block_table_view(geometry, k_base, strides, v_base, v_strides,
                                 BlockTable{t.block_table, row_stride, t.seq_lens, batch_size()},
                                 space);
  }

  /// Element index of (page, slot, head, d) in k (v_index: in v, with V's strides).
  std::size_t index(std::int32_t page, std::int32_t slot, std::int32_t head, std::int32_t d) const {
    return static_cast<std::size_t>(page * strides.page + slot * strides.token +
                                    head * strides.head + d);
  }
  std::size_t v_index(std::int32_t page, std::int32_t slot, std::int32_t head,
                      std::int32_t d) const {
    return static_cast<std::size_t>(page * v_strides.page + slot * v_strides.token +
                                    head * v_strides.head + d);
  }
  /// Element index of token t of sequence b, head h, dim d in k (v_token_index: in v).
  std::size_t token_index(std::int32_t b, std::int32_t t, std::int32_t h, std::int32_t d) const {
    const auto& pg = pages[static_cast<std::size_t>(b)];
    return index(pg[static_cast<std::size_t>(t / spec_.page_size)], t % spec_.page_size, h, d);
  }
  std::size_t v_token_index(std::int32_t b, std::int32_t t, std::int32_t h, std::int32_t d) const {
    const auto& pg = pages[static_cast<std::size_t>(b)];
    return v_index(pg[static_cast<std::size_t>(t / spec_.page_size)], t % spec_.page_size, h, d);
  }
  double key(std::int32_t b, std::int32_t t, std::int32_t h, std::int32_t d) const {
    return to_double(k[token_index(b, t, h, d)]);
  }
  double value(std::int32_t b, std::int32_t t, std::int32_t h, std::int32_t d) const {
    return to_double(v[v_token_index(b, t, h, d)]);
  }

  PagedKVView<T> view;  // host view over k, v and the tables below
  KVGeometry geometry;
  KVStrides strides;                        // K's
  KVStrides v_strides;                      // V's (differ when v_head_dim or v_layout do)
  std::vector<T> k;                         // [num_pages * strides.page]
  std::vector<T> v;                         // [num_pages * v_strides.page]
  std::vector<std::int32_t> indptr;         // CSR [batch + 1]
  std::vector<std::int32_t> indices;        // CSR [nnz]
  std::vector<std::int32_t> last_page_len;  // CSR [batch]
  std::vector<std::int32_t> block_table;    // dense [batch, row_stride], -1 where unused
  std::int32_t row_stride = 0;
  std::vector<std::int32_t> seq_lens;            // [batch]
  std::vector<std::vector<std::int32_t>> pages;  // pages[b]: physical ids of sequence b
  std::vector<std::int32_t> free_pages;          // pool pages no sequence uses

 private:
  PoolSpec spec_;
};

/// float64 decode attention over a host view: out[b, hq, :] and lse[b, hq] (natural log;
/// -inf and zeros for empty sequences). q is [batch, Hq, D].
template <class T>
void ref_decode_attention(const PagedKVView<T>& view, const T* q, std::int32_t num_qo_heads,
                          double sm_scale, std::vector<double>& out, std::vector<double>& lse) {
  const std::int32_t dim = view.head_dim, vdim = view.v_head_dim;
  const std::int32_t group = num_qo_heads / view.num_kv_heads;
  out.assign(static_cast<std::size_t>(view.batch_size) * num_qo_heads * vdim, 0.0);
  lse.assign(static_cast<std::size_t>(view.batch_size) * num_qo_heads,
             -std::numeric_limits<double>::infinity());
  std::vector<double> logits;
  for (std::int32_t b = 0; b < view.batch_size; ++b) {
    const std::int32_t len = view.seq_len(b);
    if (len == 0) continue;
    for (std::int32_t hq = 0; hq < num_qo_heads; ++hq) {
      const std::int32_t h = hq / group;
      const T* qv = q + (static_cast<std::size_t>(b) * num_qo_heads + hq) * dim;
      logits.assign(static_cast<std::size_t>(len), 0.0);
      double mx = -std::numeric_limits<double>::infinity();
      for (std::int32_t t = 0; t < len; ++t) {
        const T* kr = view.k_ptr(b, t, h);
        double s = 0;
        for (std::int32_t d = 0; d < dim; ++d) s += to_double(qv[d]) * to_double(kr[d]);
        logits[static_cast<std::size_t>(t)] = s * sm_scale;
        mx = std::max(mx, s * sm_scale);
      }
      double sum = 0;
      for (double& s : logits) sum += (s = std::exp(s - mx));
      double* o = out.data() + (static_cast<std::size_t>(b) * num_qo_heads + hq) * vdim;
      for (std::int32_t t = 0; t < len; ++t) {
        const T* vr = view.v_ptr(b, t, h);
        const double p = logits[static_cast<std::size_t>(t)] / sum;
        for (std::int32_t d = 0; d < vdim; ++d) o[d] += p * to_double(vr[d]);
      }
      lse[static_cast<std::size_t>(b) * num_qo_heads + hq] = mx + std::log(sum);
    }
  }
}

/// Absolute + relative tolerance for values a float-accumulating kernel rounds to T.
struct Tolerance {
  double atol, rtol;
};
template <class T>
Tolerance value_tolerance() {
  if (std::is_same<T, float>::value) return {2e-5, 1e-4};
  if (std::is_same<T, half_t>::value) return {1e-3, 2e-3};
  return {8e-3, 1.6e-2};  // bfloat16: 8 mantissa bits
}

/// Empty when every got[i] is within tol of want[i]; else a message naming the worst
/// element (Catch prints it when a test REQUIREs it empty).
template <class G>
std::string compare_close(const G* got, const std::vector<double>& want, Tolerance tol,
                          const char* what = "value") {
  bool bad = false;
  std::size_t worst = 0;
  double worst_excess = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = to_double(got[i]);
    if (g == want[i]) continue;  // also equal infinities (lse of empty sequences)
    const double excess = std::abs(g - want[i]) - (tol.atol + tol.rtol * std::abs(want[i]));
    if (excess <= 0) continue;  // NaN falls through as a failure
    const double e = std::isnan(excess) ? std::numeric_limits<double>::infinity() : excess;
    if (!bad || e > worst_excess) {
      bad = true;
      worst = i;
      worst_excess = e;
    }
  }
  if (!bad) return {};
  std::ostringstream os;
  os << what << "[" << worst << "] = " << to_double(got[worst]) << " but reference is "
     << want[worst] << " (atol " << tol.atol << ", rtol " << tol.rtol << ")";
  return os.str();
}

/// Normalised mean squared error sum (got-want)^2 / sum want^2 (for parity tests).
template <class G>
double nmse(const G* got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double e = to_double(got[i]) - want[i];
    num += e * e;
    den += want[i] * want[i];
  }
  return den > 0 ? num / den : num;
}

/// Distinct random integers from [0, range), `count` of them (count <= range), unsorted.
inline std::vector<std::int32_t> random_distinct(std::int32_t count, std::int32_t range,
                                                 std::mt19937_64& rng) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(range));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(count));
  return all;
}

}  // namespace test
}  // namespace kvkit
