#include "kvkit/kernels/cuda/r1kv.cuh"   // the rewritten copy (run.sh puts its dir first)
// Kept lists of the host-emulated CUDA select vs the CPU twin (see run.sh): every case must
// match exactly; the NaN case must report kInvalidArgument for kv head 1 and write nothing.
#include "kvkit/compressor/scorers.hpp"
#include <cstdio>
#include <random>
#include <algorithm>
using namespace kvkit;
namespace cp = kvkit::compressor;

template <class T>
std::vector<T> make_keys(int hkv, int s, int dim, std::mt19937_64& rng, bool identical) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::vector<float> one(dim);
  for (auto& x : one) x = nd(rng);
  std::vector<T> k(static_cast<std::size_t>(hkv) * s * dim);
  for (int h = 0; h < hkv; ++h)
    for (int j = 0; j < s; ++j) {
      T* row = &k[(static_cast<std::size_t>(h) * s + j) * dim];
      if (identical) { for (int d = 0; d < dim; ++d) row[d] = from_float<T>(one[d]); }
      else if (j > 0 && u(rng) < 0.25f) {
        const int src = std::uniform_int_distribution<int>(0, j - 1)(rng);
        const T* from = &k[(static_cast<std::size_t>(h) * s + src) * dim];
        for (int d = 0; d < dim; ++d) row[d] = from_float<T>(to_float(from[d]) + 0.05f * nd(rng));
      } else for (int d = 0; d < dim; ++d) row[d] = from_float<T>(nd(rng));
    }
  return k;
}
int total_cases = 0, bad_cases = 0;
template <class T, class Scorer>
void run(cp::KeepOrder order, int budget, int hkv, int groups, int dim, int s, int lq, bool ident, std::mt19937_64& rng, bool nan = false) {
  cp::Params p; p.budget = budget; p.buffer = 16; p.order = order;
  cp::Compressor<Scorer> comp(p);
  auto keys = make_keys<T>(hkv, s, dim, rng, ident);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> q(static_cast<std::size_t>(hkv) * groups * lq * dim);
  for (auto& x : q) x = from_float<T>(nd(rng));
  if (nan) keys[(s + 5) * dim + 2] = from_float<T>(std::nanf(""));
  cp::Shape sh{hkv, hkv * groups, dim, s, lq};
  int stride = budget + 5;
  exec::Host host{1};
  std::vector<unsigned char> hws(comp.workspace_size(host, sh) + 1);
  std::vector<int> want(hkv * stride, -7), got(hkv * stride, -7);
  int wn = -1, gn = -1;
  Status hs = comp.select(host, keys.data(), q.data(), sh, want.data(), stride, &wn, Workspace{hws.data(), hws.size()});
  DeviceStatus dst;
  std::vector<unsigned char> dws(comp.workspace_size(exec::Cuda{}, sh) + 256);
  Status gs = comp.select(exec::Cuda{nullptr, &dst}, keys.data(), q.data(), sh, got.data(), stride, &gn, Workspace{dws.data(), dws.size()});
  ++total_cases;
  bool ok;
  if (nan) {
    ok = !hs.is_ok() && gs.is_ok() && dst.code == (int)StatusCode::kInvalidArgument && dst.head == 1 && gn == -1 &&
         std::all_of(got.begin(), got.end(), [](int x) { return x == -7; });
  } else {
    ok = hs.is_ok() && gs.is_ok() && dst.code == 0 && gn == wn && got == want;
  }
  if (!ok) {
    ++bad_cases;
    int diff = 0; for (size_t i = 0; i < got.size(); ++i) diff += got[i] != want[i];
    std::printf("MISMATCH %s order %d budget %d hkv %d G %d D %d S %d lq %d ident %d nan %d: hs=%s gs=%s dcode=%d gn=%d wn=%d diffs=%d\n",
                Scorer::kName, (int)order, budget, hkv, groups, dim, s, lq, ident, nan, hs.to_string().c_str(), gs.to_string().c_str(), dst.code, gn, wn, diff);
  }
}
template <class T>
void all(std::mt19937_64& rng) {
  for (auto order : {cp::KeepOrder::kReference, cp::KeepOrder::kPositional}) {
    for (int g : {1, 2, 4, 8}) for (int s : {48, 49, 57, 64}) run<T, cp::R1KV>(order, 48, 2, g, 32, s, 8, false, rng);
    run<T, cp::R1KV>(order, 48, 3, 2, 37, 60, 3, false, rng);
    run<T, cp::R1KV>(order, 48, 1, 4, 4, 50, 8, false, rng);
    run<T, cp::R1KV>(order, 300, 2, 4, 128, 428, 8, false, rng);
    run<T, cp::R1KV>(order, 24, 2, 2, 16, 40, 3, true, rng);
    run<T, cp::R1KV>(order, 48, 2, 2, 32, 30, 8, false, rng);
    run<T, cp::R1KV>(order, 48, 2, 2, 32, 0, 8, false, rng);
    for (int g : {1, 8}) { run<T, cp::SnapKV>(order, 48, 2, g, 32, 64, 8, false, rng); run<T, cp::StreamingLLM>(order, 48, 2, g, 32, 61, 8, false, rng); }
  }
  run<T, cp::R1KV>(cp::KeepOrder::kReference, 16, 2, 2, 16, 30, 8, false, rng, true);
}
int main() {
  std::mt19937_64 rng(42);
  all<float>(rng); all<half_t>(rng); all<bfloat16_t>(rng);
  std::printf("cases %d, mismatched %d, launches %d\n", total_cases, bad_cases, emu::launches);
  return bad_cases != 0;
}
