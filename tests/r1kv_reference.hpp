#pragma once
// Float64 reference of the R1KV spec (../shared/specs/r1kv.md) for one kv head, written
// plainly (the full S x S cosine matrix): importance, redundancy, r(i), scores and the kept
// list with the documented tie-break. Shared by the CPU tests (tests/test_r1kv.cpp) and the
// CUDA parity tests (tests/cuda/test_r1kv_cuda.cu).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvkit/compressor/r1kv.hpp"

namespace kvkit {
namespace test {

enum class Kind { kR1KV, kSnapKV, kStreaming };

// ---- float64 reference ------------------------------------------------------------------

struct RefHead {
  std::vector<double> imp;         // [S-w] I
  std::vector<double> red;         // [S] Rd
  std::vector<std::int32_t> near;  // [S] r(i)
  std::vector<double> z;           // [S-w]
  std::vector<std::int32_t> keep;  // [Bud]
};

// keys: [S, D] of one head; queries: [G, Lq, D] of its query heads (doubles of the T values).
inline RefHead ref_head(const std::vector<double>& keys, const std::vector<double>& queries, int s,
                 int dim, int groups, int lq, const compressor::Params& p, Kind kind) {
  RefHead out;
  const int w = p.window, nc = s - w, rows = std::min(w, lq);
  out.imp.assign(nc, 0.0);
  out.red.assign(s, 0.0);
  out.near.assign(s, 0);
  if (kind != Kind::kStreaming) {
    std::vector<double> a(nc, 0.0);
    for (int r = 0; r < rows; ++r) {
      std::vector<double> l(nc);
      for (int j = 0; j < nc; ++j) {
        double best = -1e300;
        for (int g = 0; g < groups; ++g) {
          double dot = 0;
          for (int d = 0; d < dim; ++d)
            dot += queries[(static_cast<std::size_t>(g) * lq + (lq - rows + r)) * dim + d] *
                   keys[static_cast<std::size_t>(j) * dim + d];
          best = std::max(best, dot);
        }
        l[j] = best / std::sqrt(static_cast<double>(dim));
      }
      const double mx = *std::max_element(l.begin(), l.end());
      double sum = 0;
      for (double& x : l) sum += (x = std::exp(x - mx));
      for (int j = 0; j < nc; ++j) a[j] += l[j] / sum / rows;
    }
    const int half = p.kernel / 2;
    for (int j = 0; j < nc; ++j) {
      double m = -1e300;
      for (int t = std::max(0, j - half); t <= std::min(nc - 1, j + half); ++t) m = std::max(m, a[t]);
      out.imp[j] = m;
    }
  }
  if (kind == Kind::kR1KV) {
    std::vector<double> n(keys.size());
    for (int i = 0; i < s; ++i) {
      double nrm = 0;
      for (int d = 0; d < dim; ++d) nrm += keys[i * dim + d] * keys[i * dim + d];
      for (int d = 0; d < dim; ++d) n[i * dim + d] = keys[i * dim + d] / (std::sqrt(nrm) + 1e-8);
    }
    std::vector<double> c(static_cast<std::size_t>(s) * s);
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < s; ++j) {
        double dot = 0;
        for (int d = 0; d < dim; ++d) dot += n[i * dim + d] * n[j * dim + d];
        c[static_cast<std::size_t>(i) * s + j] = i == j ? 0.0 : dot;
      }
    for (int i = 0; i < s; ++i) {
      int r = 0;
      for (int j = 0; j < s; ++j)
        if (c[static_cast<std::size_t>(i) * s + j] > p.similarity_threshold) r = j;
      out.near[i] = r;
      c[static_cast<std::size_t>(i) * s + r] = 0.0;
    }
    std::vector<double> m(s, 0.0);
    for (int i = 0; i < s; ++i)
      for (int j = 0; j < s; ++j) m[j] += c[static_cast<std::size_t>(i) * s + j];
    for (double& x : m) x /= s;
    const double mx = *std::max_element(m.begin(), m.end());
    double sum = 0;
    for (double& x : m) sum += (x = std::exp(x - mx));
    for (int j = 0; j < s; ++j) out.red[j] = m[j] / sum;
  }
  out.z.resize(nc);
  for (int j = 0; j < nc; ++j) {
    if (kind == Kind::kR1KV)
      out.z[j] = static_cast<double>(p.lambda) * out.imp[j] -
                 (1.0 - static_cast<double>(p.lambda)) * out.red[j];
    else if (kind == Kind::kSnapKV)
      out.z[j] = out.imp[j];
    else
      out.z[j] = j < p.sinks ? 2.0 : static_cast<double>(j) / s;
  }
  std::vector<std::int32_t> idx(nc);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return out.z[a] > out.z[b]; });
  idx.resize(p.budget - w);
  if (p.order == compressor::KeepOrder::kPositional) std::sort(idx.begin(), idx.end());
  out.keep = idx;
  for (int i = 0; i < w; ++i) out.keep.push_back(nc + i);
  return out;
}

}  // namespace test
}  // namespace kvkit
