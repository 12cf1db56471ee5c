// `kvkit r1kv` (examples/cli/cmd_r1kv.hpp): run the built binary (KVKIT_CLI_PATH) on .npy
// files written here and check the kept slots against the library's Compressor<R1KV> on
// the same data, the compressed K/V rows bit for bit, and the error exits.


#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli_runner.hpp"
#include "engine/npy.hpp"
#include "kvkit/compressor/r1kv.hpp"

using namespace kvkit;
namespace fs = std::filesystem;

namespace {

using kvkit::test::CliResult;
using kvkit::test::TempDir;

// Runs `kvkit r1kv <args>`: the exit code, stdout and stderr.
CliResult run_r1kv(const TempDir&, const std::string& args) { return kvkit::test::run_cli("r1kv " + args); }

// Random data with planted near-duplicate keys (so redundancy matters), never all zero.
template <class T>
std::vector<T> random_array(std::size_t n, std::mt19937_64& rng, std::int64_t dim = 0) {
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(nd(rng));
  if (dim > 0)  // every 5th row a near copy of the row before it
    for (std::size_t r = 5; (r + 1) * static_cast<std::size_t>(dim) <= n; r += 5)
      for (std::int64_t d = 0; d < dim; ++d)
        v[r * dim + d] = static_cast<T>(v[(r - 1) * dim + d] + 0.01 * nd(rng));
  return v;
}

struct Case {
  std::int64_t hkv, hq, s, lq, d, dv;
  bool rank4, f64;
};

// The library's kept slots for the same inputs (float64 rounded to float32 as the CLI does).
std::vector<std::int64_t> library_keep(const std::vector<float>& k, const std::vector<float>& q,
                                       const Case& c, const compressor::Params& p,
                                       std::int32_t* n_out) {
  const compressor::Compressor<compressor::R1KV> comp(p);
  const compressor::Shape sh{static_cast<std::int32_t>(c.hkv), static_cast<std::int32_t>(c.hq),
                             static_cast<std::int32_t>(c.d), static_cast<std::int32_t>(c.s),
                             static_cast<std::int32_t>(c.lq)};
  const exec::Host ex{1};
  std::vector<unsigned char> ws(comp.workspace_size(ex, sh) + 1);
  std::vector<std::int32_t> keep(static_cast<std::size_t>(c.hkv * p.budget));
  std::int32_t n = 0;
  REQUIRE(comp.select(ex, k.data(), q.data(), sh, keep.data(), p.budget, &n,
                      Workspace{ws.data(), ws.size()})
              .is_ok());
  std::vector<std::int64_t> out;
  for (std::int64_t h = 0; h < c.hkv; ++h)
    for (std::int32_t i = 0; i < n; ++i) out.push_back(keep[static_cast<std::size_t>(h * p.budget + i)]);
  *n_out = n;
  return out;
}

template <class T>
void write_array(const std::string& path, const std::vector<T>& v, std::int64_t h, std::int64_t n,
                 std::int64_t d, bool rank4) {
  if (rank4)
    engine::write_npy(path, v.data(), {1, h, n, d});
  else
    engine::write_npy(path, v.data(), {h, n, d});
}

template <class T>
void check_case(const Case& c, std::int32_t budget, const std::string& extra,
                const compressor::Params& p, std::mt19937_64& rng) {
  TempDir dir("case");
  const std::vector<T> k = random_array<T>(static_cast<std::size_t>(c.hkv * c.s * c.d), rng, c.d);
  const std::vector<T> v = random_array<T>(static_cast<std::size_t>(c.hkv * c.s * c.dv), rng);
  const std::vector<T> q = random_array<T>(static_cast<std::size_t>(c.hq * c.lq * c.d), rng);
  write_array(dir.file("k.npy"), k, c.hkv, c.s, c.d, c.rank4);
  write_array(dir.file("v.npy"), v, c.hkv, c.s, c.dv, c.rank4);
  write_array(dir.file("q.npy"), q, c.hq, c.lq, c.d, c.rank4);
  const std::string args = "--keys '" + dir.file("k.npy") + "' --queries '" + dir.file("q.npy") +
                           "' --values '" + dir.file("v.npy") + "' --budget " +
                           std::to_string(budget) + " --out '" + dir.file("kept.npy") +
                           "' --out-k '" + dir.file("ck.npy") + "' --out-v '" +
                           dir.file("cv.npy") + "' " + extra;
  const CliResult r = run_r1kv(dir, args);
  INFO("kvkit r1kv " << args << "\nstderr: " << r.err);
  REQUIRE(r.code == 0);
  std::int32_t n = 0;
  const std::vector<std::int64_t> want = library_keep(std::vector<float>(k.begin(), k.end()),
                                                      std::vector<float>(q.begin(), q.end()), c, p, &n);
  const engine::NpyArray kept = engine::read_npy(dir.file("kept.npy"));
  REQUIRE(kept.descr == "<i8");
  REQUIRE(kept.shape == std::vector<std::int64_t>{1, c.hkv, n});
  REQUIRE(kept.as<std::int64_t>() == want);
  // Compressed K and V: the kept rows, bit for bit, in the input's rank and dtype.
  const engine::NpyArray ck = engine::read_npy(dir.file("ck.npy"));
  const engine::NpyArray cv = engine::read_npy(dir.file("cv.npy"));
  const std::vector<std::int64_t> kshape =
      c.rank4 ? std::vector<std::int64_t>{1, c.hkv, n, c.d} : std::vector<std::int64_t>{c.hkv, n, c.d};
  const std::vector<std::int64_t> vshape =
      c.rank4 ? std::vector<std::int64_t>{1, c.hkv, n, c.dv} : std::vector<std::int64_t>{c.hkv, n, c.dv};
  REQUIRE(ck.shape == kshape);
  REQUIRE(cv.shape == vshape);
  const std::vector<T> ckv = ck.as<T>(), cvv = cv.as<T>();
  for (std::int64_t h = 0; h < c.hkv; ++h)
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = want[static_cast<std::size_t>(h * n + i)];
      for (std::int64_t e = 0; e < c.d; ++e)
        REQUIRE(ckv[static_cast<std::size_t>((h * n + i) * c.d + e)] ==
                k[static_cast<std::size_t>((h * c.s + t) * c.d + e)]);
      for (std::int64_t e = 0; e < c.dv; ++e)
        REQUIRE(cvv[static_cast<std::size_t>((h * n + i) * c.dv + e)] ==
                v[static_cast<std::size_t>((h * c.s + t) * c.dv + e)]);
    }
}

}  // namespace

TEST_CASE("kvkit r1kv keeps what Compressor<R1KV> keeps, in output order", "[cli][r1kv]") {
  std::mt19937_64 rng(20261123);
  compressor::Params p;  // the spec's defaults: window 8, kernel 7, lambda 0.07, reference
  SECTION("defaults, float32, [1, H, S, D], GQA 4") {
    p.budget = 24;
    check_case<float>({2, 8, 40, 8, 16, 16, true, false}, 24, "", p, rng);
  }
  SECTION("float64, [H, S, D], GQA 1, Dv != D, fewer queries than the window") {
    p.budget = 20;
    check_case<double>({3, 3, 33, 5, 8, 12, false, true}, 20, "", p, rng);
  }
  SECTION("positional order and every option set") {
    p.budget = 30;
    p.window = 4;
    p.kernel = 3;
    p.lambda = 0.5f;
    p.order = compressor::KeepOrder::kPositional;
    check_case<float>({2, 4, 64, 6, 16, 16, true, false}, 30,
                      "--window 4 --kernel 3 --lambda 0.5 --order positional --threads 2", p, rng);
  }
  SECTION("S == budget and S < budget keep everything") {
    p.budget = 16;
    check_case<float>({2, 4, 16, 8, 8, 8, true, false}, 16, "", p, rng);
    check_case<float>({2, 4, 10, 8, 8, 8, true, false}, 16, "", p, rng);
  }
}

TEST_CASE("kvkit r1kv rejects mismatched shapes, dtypes and bad values", "[cli][r1kv]") {
  std::mt19937_64 rng(7);
  TempDir dir("err");
  auto f = [&](const char* n) { return "'" + dir.file(n) + "'"; };
  const std::vector<float> k = random_array<float>(2 * 20 * 8, rng);
  const std::vector<float> q = random_array<float>(4 * 8 * 8, rng);
  const std::vector<double> q64(q.begin(), q.end());
  engine::write_npy(dir.file("k.npy"), k.data(), {1, 2, 20, 8});
  engine::write_npy(dir.file("v.npy"), k.data(), {1, 2, 20, 8});
  engine::write_npy(dir.file("q.npy"), q.data(), {1, 4, 8, 8});
  engine::write_npy(dir.file("q64.npy"), q64.data(), {1, 4, 8, 8});
  engine::write_npy(dir.file("q_d4.npy"), q.data(), {1, 8, 8, 4});    // D 4 != 8
  engine::write_npy(dir.file("q_h3.npy"), q.data(), {1, 2, 16, 8});   // fine: Hq 2
  engine::write_npy(dir.file("v_s.npy"), k.data(), {1, 2, 10, 16});   // S 10 != 20
  engine::write_npy(dir.file("k_b2.npy"), k.data(), {2, 1, 20, 8});   // batch 2
  engine::write_npy(dir.file("k_r2.npy"), k.data(), {40, 8});         // rank 2
  const std::vector<std::int64_t> ints(16, 1);
  engine::write_npy(dir.file("i.npy"), ints.data(), {1, 2, 1, 8});
  const std::string base = " --out " + f("kept.npy");
  struct Bad {
    std::string args, says;
    int code;
  };
  const std::vector<Bad> cases = {
      {"--keys " + f("k.npy") + " --queries " + f("q64.npy") + " --values " + f("v.npy") + " --budget 12", "dtypes differ", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q_d4.npy") + " --values " + f("v.npy") + " --budget 12", "does not match --keys", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v_s.npy") + " --budget 12", "--values [1, 2, 10, 16] does not match", 2},
      {"--keys " + f("k_b2.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12", "--keys has shape [2, 1, 20, 8]", 2},
      {"--keys " + f("k_r2.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12", "--keys has shape [40, 8]", 2},
      {"--keys " + f("i.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12", "has dtype <i8", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 8", "budget must be > window", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12 --kernel 4", "kernel must be odd", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12 --lambda 1.5", "lambda must be in [0, 1]", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12 --order newest", "order", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12 --out-k " + f("ck.npy"), "--out-k requires --out-v", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy"), "--budget", 2},
      {"--keys " + f("k.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12 --bogus", "--bogus", 2},
      {"--keys " + f("missing.npy") + " --queries " + f("q.npy") + " --values " + f("v.npy") + " --budget 12", "cannot open", 1},
  };
  for (const Bad& b : cases) {
    const CliResult r = run_r1kv(dir, b.args + base);
    INFO("kvkit r1kv " << b.args << "\nstderr: " << r.err);
    CHECK(r.code == b.code);
    CHECK(r.err.find(b.says) != std::string::npos);
    CHECK(!fs::exists(dir.path / "kept.npy"));
  }
  // Hq 2 over Hkv 2 (GQA 1) is fine.
  const CliResult ok = run_r1kv(dir, "--keys " + f("k.npy") + " --queries " + f("q_h3.npy") +
                                         " --values " + f("v.npy") + " --budget 12" + base);
  INFO(ok.err);
  CHECK(ok.code == 0);
}
