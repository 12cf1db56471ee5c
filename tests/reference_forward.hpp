#pragma once
// float64 reference llama forward pass for the engine tests (test_engine, test_gguf): a
// straightforward dense implementation with its own KV cache, fed one token at a time, to
// check the Engine's logits against. Reads the Checkpoint's float weights directly.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "engine/checkpoint.hpp"

namespace kvkit {
namespace test {

/// Dense float64 llama forward with its own KV cache. RMSNorm epsilon and RoPE base come
/// from the checkpoint's config, or are given explicitly (the llama2.c tests pin 1e-5 and
/// 10000, the values those files imply).
class RefModel {
 public:
  explicit RefModel(const engine::Checkpoint& ck)
      : RefModel(ck, static_cast<double>(ck.config().norm_eps), ck.config().rope_theta) {}
  RefModel(const engine::Checkpoint& ck, double norm_eps, double rope_theta)
      : ck_(ck), c_(ck.config()), norm_eps_(norm_eps), rope_theta_(rope_theta) {
    k_.resize(static_cast<std::size_t>(c_.n_layers));
    v_.resize(static_cast<std::size_t>(c_.n_layers));
  }

  /// Rounds what an engine with 16-bit K/V pages rounds: every key and value as it is
  /// cached, the queries before their scores and each attention output (empty: none).
  void set_kv_rounding(std::function<double(double)> round) { round_ = std::move(round); }

  /// Logits after feeding `token` at the next position.
  std::vector<double> forward(std::int32_t token) {
    const int dim = c_.dim, hd = c_.head_dim(), kvd = c_.kv_dim(), hid = c_.hidden_dim;
    const int group = c_.n_heads / c_.n_kv_heads;
    const int pos = static_cast<int>(k_[0].size()) / kvd;
    std::vector<double> x(ck_.token_embedding() + static_cast<std::size_t>(token) * dim,
                          ck_.token_embedding() + static_cast<std::size_t>(token + 1) * dim);
    for (int l = 0; l < c_.n_layers; ++l) {
      std::vector<double> xb = rmsnorm(x, ck_.rms_att(l));
      std::vector<double> q = matvec(ck_.wq(l), dim, dim, xb);
      std::vector<double> k = matvec(ck_.wk(l), kvd, dim, xb);
      std::vector<double> v = matvec(ck_.wv(l), kvd, dim, xb);
      rope(q, pos);
      rope(k, pos);
      if (round_)
        for (std::vector<double>* w : {&q, &k, &v})
          for (double& e : *w) e = round_(e);
      k_[l].insert(k_[l].end(), k.begin(), k.end());
      v_[l].insert(v_[l].end(), v.begin(), v.end());
      std::vector<double> att(static_cast<std::size_t>(dim), 0.0);
      const int n = pos + 1;
      for (int h = 0; h < c_.n_heads; ++h) {
        const int kh = h / group;
        std::vector<double> s(static_cast<std::size_t>(n));
        double mx = -1e300;
        for (int t = 0; t < n; ++t) {
          double d = 0;
          for (int i = 0; i < hd; ++i) d += q[h * hd + i] * k_[l][(t * c_.n_kv_heads + kh) * hd + i];
          s[t] = d / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[t]);
        }
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (int t = 0; t < n; ++t)
          for (int i = 0; i < hd; ++i)
            att[h * hd + i] += s[t] / z * v_[l][(t * c_.n_kv_heads + kh) * hd + i];
      }
      if (round_)
        for (double& e : att) e = round_(e);
      std::vector<double> o = matvec(ck_.wo(l), dim, dim, att);
      for (int i = 0; i < dim; ++i) x[i] += o[i];
      xb = rmsnorm(x, ck_.rms_ffn(l));
      std::vector<double> h1 = matvec(ck_.w1(l), hid, dim, xb);
      std::vector<double> h3 = matvec(ck_.w3(l), hid, dim, xb);
      for (int i = 0; i < hid; ++i) h1[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
      o = matvec(ck_.w2(l), dim, hid, h1);
      for (int i = 0; i < dim; ++i) x[i] += o[i];
    }
    return matvec(ck_.classifier(), c_.vocab_size, dim, rmsnorm(x, ck_.rms_final()));
  }

  /// Post-RoPE key of (layer, position, kv head), element i.
  double key(int l, int t, int h, int i) const {
    return k_[l][(static_cast<std::size_t>(t) * c_.n_kv_heads + h) * c_.head_dim() + i];
  }
  double value(int l, int t, int h, int i) const {
    return v_[l][(static_cast<std::size_t>(t) * c_.n_kv_heads + h) * c_.head_dim() + i];
  }

 private:
  static std::vector<double> matvec(const float* w, int rows, int cols, const std::vector<double>& x) {
    std::vector<double> y(static_cast<std::size_t>(rows), 0.0);
    for (int r = 0; r < rows; ++r) {
      const float* row = w + static_cast<std::size_t>(r) * cols;
      double acc = 0;
      for (int c = 0; c < cols; ++c) acc += static_cast<double>(row[c]) * x[c];
      y[r] = acc;
    }
    return y;
  }
  std::vector<double> rmsnorm(const std::vector<double>& x, const float* w) const {
    double ss = 0;
    for (double e : x) ss += e * e;
    const double inv = 1.0 / std::sqrt(ss / x.size() + norm_eps_);
    std::vector<double> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
    return y;
  }
  void rope(std::vector<double>& v, int pos) const {  // pairs (2j, 2j+1) of each head
    const int hd = c_.head_dim();
    for (std::size_t h = 0; h < v.size() / hd; ++h)
      for (int j = 0; j < hd / 2; ++j) {
        const double a = pos * std::pow(rope_theta_, -2.0 * j / hd);
        double& x0 = v[h * hd + 2 * j];
        double& x1 = v[h * hd + 2 * j + 1];
        const double r0 = x0 * std::cos(a) - x1 * std::sin(a), r1 = x0 * std::sin(a) + x1 * std::cos(a);
        x0 = r0;
        x1 = r1;
      }
  }

  const engine::Checkpoint& ck_;
  engine::ModelConfig c_;
  double norm_eps_, rope_theta_;
  std::vector<std::vector<double>> k_, v_;  // [layer][pos, Hkv, D]
  std::function<double(double)> round_;
};

/// Largest absolute difference of got vs ref, relative to ref's largest magnitude.
inline double rel_err(const std::vector<float>& got, const std::vector<double>& ref) {
  double diff = 0, mag = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - ref[i]));
    mag = std::max(mag, std::abs(ref[i]));
  }
  return diff / mag;
}

}  // namespace test
}  // namespace kvkit
