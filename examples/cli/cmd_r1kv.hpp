#pragma once
// `kvkit r1kv`: one R1KV compression of one layer's KV, from .npy files (e.g. a
// `kvkit trace` dump or numpy arrays) to the kept slot indices and, optionally, the
// compressed K and V.
//
//   kvkit r1kv --keys k.npy --queries q.npy --values v.npy --budget B [--window W]
//              [--kernel K] [--lambda L] [--order reference|positional] [--threads N]
//              --out kept.npy [--out-k ck.npy --out-v cv.npy]
//
// K and V are [1, Hkv, S, D] or [Hkv, S, D] (V may have its own Dv), Q is [1, Hq, Lq, D]
// or [Hq, Lq, D] with Hq a multiple of Hkv (query head h*G+g reads kv head h); all three
// float32 or all three float64 (float64 is rounded to float32, the library's key dtype,
// for scoring). kept.npy: int64 [1, Hkv, N] with N = min(S, B), each head's kept slots in
// the chosen output order (reference: by score; positional: ascending). ck/cv: the kept
// rows of K and V in that order, in the input's rank and dtype (S replaced by N), bit for
// bit the input rows. Defaults are the spec's: window 8, kernel 7, lambda 0.07, reference
// order. Exit codes as the rest of the CLI: 0 ok, 1 I/O error (unreadable or unwritable
// file, not a .npy), 2 usage error (unknown option, bad value, mismatched shapes or
// dtypes), each with one "kvkit: ..." line on stderr.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/parse_subcommand.hpp"
#include "engine/npy.hpp"
#include "kvkit/compressor/r1kv.hpp"
#include "kvkit/core/error.hpp"
#include "kvkit/core/exec.hpp"
#include "kvkit/core/workspace.hpp"

namespace kvkit {
namespace cli {

/// Options of `kvkit r1kv` (defaults: the spec's).
struct R1kvOptions {
  std::string keys, queries, values, out, out_k, out_v;
  std::int32_t budget = 0, window = 8, kernel = 7, threads = 1;
  float lambda = 0.07f;
  std::string order = "reference";
};

namespace detail {

/// A mistake in the command line or the inputs' shapes/dtypes: exit code 2.
struct R1kvUsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// The (heads, rows, dim) of a [1, H, N, D] or [H, N, D] array named `what`.
struct Dims3 {
  std::int64_t heads = 0, rows = 0, dim = 0;
};

inline Dims3 dims3(const engine::NpyArray& a, const std::string& what, const char* names) {
  const auto& s = a.shape;
  const bool ok = (s.size() == 3 || (s.size() == 4 && s[0] == 1));
  if (!ok)
    throw R1kvUsageError(what + " has shape " + shape_string(s) + "; expected [1, " + names +
                         "] or [" + names + "]");
  const std::size_t o = s.size() - 3;
  return Dims3{s[o], s[o + 1], s[o + 2]};
}

/// Rows of a float32 or float64 payload as float32 (float64 rounds to nearest).
inline std::vector<float> as_float32(const engine::NpyArray& a) {
  if (a.descr == "<f4") return a.as<float>();
  const std::vector<double> d = a.as<double>();
  return std::vector<float>(d.begin(), d.end());
}

/// out[h, i, :] = in[h, kept[h, i], :] on raw bytes (any item size), so the rows are
/// copied bit for bit in the input's dtype.
inline std::vector<unsigned char> take_rows(const engine::NpyArray& a, const Dims3& d,
                                            const std::vector<std::int64_t>& kept,  // [H, n]
                                            std::int64_t n) {
  const std::size_t item = a.descr == "<f4" ? 4 : 8;
  const std::size_t row = item * static_cast<std::size_t>(d.dim);
  std::vector<unsigned char> out(static_cast<std::size_t>(d.heads * n) * row);
  for (std::int64_t h = 0; h < d.heads; ++h)
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = kept[static_cast<std::size_t>(h * n + i)];
      std::memcpy(out.data() + static_cast<std::size_t>(h * n + i) * row,
                  a.bytes.data() + static_cast<std::size_t>(h * d.rows + t) * row, row);
    }
  return out;
}

/// Writes rows taken by take_rows with `like`'s rank and dtype, S replaced by n.
inline void write_rows(const std::string& path, const engine::NpyArray& like, std::int64_t n,
                       const std::vector<unsigned char>& rows) {
  std::vector<std::int64_t> shape = like.shape;
  shape[shape.size() - 2] = n;
  if (like.descr == "<f4") {
    std::vector<float> v(rows.size() / sizeof(float));
    if (!v.empty()) std::memcpy(v.data(), rows.data(), rows.size());
    engine::write_npy(path, v.data(), shape);
  } else {
    std::vector<double> v(rows.size() / sizeof(double));
    if (!v.empty()) std::memcpy(v.data(), rows.data(), rows.size());
    engine::write_npy(path, v.data(), shape);
  }
}

/// The command once parsed: reads, checks, selects, writes. Throws R1kvUsageError for
/// shape/dtype/parameter mistakes, kvkit::Error for I/O problems.
inline void r1kv_run(const R1kvOptions& o) {
  // Parameters first (a usage error even before any file is read).
  compressor::Params p;
  p.budget = o.budget;
  p.window = o.window;
  p.kernel = o.kernel;
  p.lambda = o.lambda;
  p.order = o.order == "positional" ? compressor::KeepOrder::kPositional
                                    : compressor::KeepOrder::kReference;
  try {
    p.validate();
  } catch (const Error& e) {
    throw R1kvUsageError(e.what());
  }
  const engine::NpyArray k = engine::read_npy(o.keys);
  const engine::NpyArray q = engine::read_npy(o.queries);
  const engine::NpyArray v = engine::read_npy(o.values);
  for (const auto* a : {&k, &q, &v})
    if (a->descr != "<f4" && a->descr != "<f8")
      throw R1kvUsageError(std::string(a == &k ? "--keys" : a == &q ? "--queries" : "--values") +
                           " has dtype " + a->descr + "; expected float32 (<f4) or float64 (<f8)");
  if (k.descr != q.descr || k.descr != v.descr)
    throw R1kvUsageError("dtypes differ: keys " + k.descr + ", queries " + q.descr + ", values " +
                         v.descr + " (all float32 or all float64)");
  const Dims3 kd = dims3(k, "--keys", "Hkv, S, D");
  const Dims3 vd = dims3(v, "--values", "Hkv, S, Dv");
  const Dims3 qd = dims3(q, "--queries", "Hq, Lq, D");
  if (kd.heads < 1 || kd.rows < 1 || kd.dim < 1)
    throw R1kvUsageError("--keys " + shape_string(k.shape) + " has an empty dimension");
  if (vd.heads != kd.heads || vd.rows != kd.rows || vd.dim < 1)
    throw R1kvUsageError("--values " + shape_string(v.shape) + " does not match --keys " +
                         shape_string(k.shape) + " (same Hkv and S, Dv >= 1)");
  if (qd.dim != kd.dim || qd.heads < 1 || qd.heads % kd.heads != 0 || qd.rows < 1)
    throw R1kvUsageError("--queries " + shape_string(q.shape) + " does not match --keys " +
                         shape_string(k.shape) +
                         " (need the same D, Hq a positive multiple of Hkv, Lq >= 1)");
  constexpr std::int64_t kMax = 1 << 30;
  if (kd.heads * kd.rows > kMax || qd.heads * qd.rows > kMax || kd.dim > kMax)
    throw R1kvUsageError("inputs too large for one select call");

  const std::vector<float> keys = as_float32(k), queries = as_float32(q);
  const compressor::Shape shape{static_cast<std::int32_t>(kd.heads),
                                static_cast<std::int32_t>(qd.heads),
                                static_cast<std::int32_t>(kd.dim),
                                static_cast<std::int32_t>(kd.rows),
                                static_cast<std::int32_t>(qd.rows)};
  const compressor::Compressor<compressor::R1KV> comp(p);
  const exec::Host ex{o.threads};
  std::vector<unsigned char> ws(comp.workspace_size(ex, shape) + 1);
  std::vector<std::int32_t> keep(static_cast<std::size_t>(kd.heads) * p.budget);
  std::int32_t num_keep = 0;
  const Status st = comp.select(ex, keys.data(), queries.data(), shape, keep.data(), p.budget,
                                &num_keep, Workspace{ws.data(), ws.size()});
  if (!st.is_ok()) throw R1kvUsageError("r1kv: " + st.to_string());
  const std::int64_t n = num_keep;
  std::vector<std::int64_t> kept(static_cast<std::size_t>(kd.heads * n));
  for (std::int64_t h = 0; h < kd.heads; ++h)
    for (std::int64_t i = 0; i < n; ++i)
      kept[static_cast<std::size_t>(h * n + i)] = keep[static_cast<std::size_t>(h * p.budget + i)];
  engine::write_npy(o.out, kept.data(), {1, kd.heads, n});
  if (!o.out_k.empty()) write_rows(o.out_k, k, n, take_rows(k, kd, kept, n));
  if (!o.out_v.empty()) write_rows(o.out_v, v, n, take_rows(v, vd, kept, n));
  std::cout << "r1kv: kept " << n << " of " << kd.rows << " slots per kv head (" << kd.heads
            << " heads, " << o.order << " order) -> " << o.out << "\n";
}

}  // namespace detail

/// Runs `kvkit r1kv` with the arguments after the command word (argv[0] == "r1kv").
/// Returns the exit code; prints help for --help.
inline int run_r1kv(int argc, char** argv) {
  R1kvOptions o;
  CLI::App app("kvkit r1kv: one R1KV compression of one layer's KV from .npy files", "kvkit r1kv");
  app.add_option("--keys", o.keys, "K, [1, Hkv, S, D] or [Hkv, S, D], float32 or float64")
      ->type_name("K.npy")
      ->required();
  app.add_option("--queries", o.queries, "the last queries, [1, Hq, Lq, D] or [Hq, Lq, D]")
      ->type_name("Q.npy")
      ->required();
  app.add_option("--values", o.values, "V, [1, Hkv, S, Dv] or [Hkv, S, Dv]")
      ->type_name("V.npy")
      ->required();
  app.add_option("--budget", o.budget, "slots kept per kv head (> window)")
      ->type_name("B")
      ->required();
  app.add_option("--window", o.window, "last slots always kept, also the query rows used (default 8)")
      ->type_name("W");
  app.add_option("--kernel", o.kernel, "max-pool width, odd (default 7)")->type_name("K");
  app.add_option("--lambda", o.lambda, "mix of importance and redundancy in [0, 1] (default 0.07)")
      ->type_name("L");
  app.add_option("--order", o.order, "output order of the kept slots: reference (by score, default) or positional (ascending)")
      ->type_name("ORDER")
      ->check(CLI::IsMember({"reference", "positional"}));
  app.add_option("--threads", o.threads, "worker threads (default 1)")
      ->type_name("N")
      ->check(CLI::Range(1, 64));
  app.add_option("--out", o.out, "kept slot indices, int64 [1, Hkv, min(S, B)]")
      ->type_name("KEPT.npy")
      ->required();
  CLI::Option* ok = app.add_option("--out-k", o.out_k, "compressed K (input rank and dtype)")
                        ->type_name("CK.npy");
  CLI::Option* ov = app.add_option("--out-v", o.out_v, "compressed V (input rank and dtype)")
                        ->type_name("CV.npy");
  ok->needs(ov);
  ov->needs(ok);
  auto usage_error = [](int code, const std::string& m) {
    std::cerr << "kvkit: error: r1kv: " << m << "\n";
    return code;
  };
  if (const int rc = parse_subcommand(app, argc, argv, usage_error); rc != kParsed) return rc;
  try {
    detail::r1kv_run(o);
  } catch (const detail::R1kvUsageError& e) {
    std::string m = e.what();
    if (m.rfind("kvkit: ", 0) == 0) m = m.substr(7);
    return usage_error(2, m);
  } catch (const std::exception& e) {
    std::string m = e.what();
    if (m.rfind("kvkit: ", 0) == 0) m = m.substr(7);
    std::cerr << "kvkit: r1kv: " << m << "\n";
    return 1;
  }
  return 0;
}

}  // namespace cli
}  // namespace kvkit
