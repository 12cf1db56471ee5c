// Host execution: parallel_for with and without an engine executor, kvkit::ThreadPool,
// kernels bitwise identical whatever runs their tasks, and copy_pages' id-clash check at
// pool sizes on both sides of its bitset window.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kvkit/core/thread_pool.hpp"
#include "kvkit/kernels/cpu.hpp"
#include "reference.hpp"

using namespace kvkit;
using namespace kvkit::test;

namespace {

/// An executor that runs the tasks serially in reverse order on the calling thread and
/// counts its calls: the contract allows any order, and results must not care.
struct ReverseExecutor {
  int calls = 0;
  static void run(void* ctx, int num_tasks, exec::HostTask task, void* arg) {
    ++static_cast<ReverseExecutor*>(ctx)->calls;
    for (int i = num_tasks - 1; i >= 0; --i) task(arg, i);
  }
  exec::HostExecutor executor() { return {&ReverseExecutor::run, this}; }
};

using Chunk = std::tuple<std::int64_t, std::int64_t, int>;

/// The (begin, end, worker) chunks parallel_for hands out under ex, sorted.
std::vector<Chunk> chunks_of(exec::Host ex, std::int64_t n) {
  std::vector<Chunk> out(static_cast<std::size_t>(detail::kMaxHostThreads));
  std::atomic<int> count{0};
  std::vector<int> hits(static_cast<std::size_t>(n), 0);
  detail::parallel_for(ex, n, [&](std::int64_t b, std::int64_t e, int w) {
    out[static_cast<std::size_t>(count.fetch_add(1))] = Chunk{b, e, w};
    for (std::int64_t i = b; i < e; ++i) ++hits[static_cast<std::size_t>(i)];
  });
  out.resize(static_cast<std::size_t>(count.load()));
  for (int h : hits) REQUIRE(h == 1);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("HostExecutor is a trivially copyable non-owning reference", "[parallel]") {
  STATIC_REQUIRE(std::is_trivially_copyable<exec::HostExecutor>::value);
  STATIC_REQUIRE(std::is_trivially_copyable<exec::Host>::value);
  const exec::Host plain{3};  // the pre-executor spelling still works
  REQUIRE(plain.threads == 3);
  REQUIRE_FALSE(plain.executor);
}

TEST_CASE("parallel_for gives an executor the same chunks as the built-in workers",
          "[parallel]") {
  ThreadPool pool(3);
  ReverseExecutor reverse;
  for (int threads : {0, 1, 2, 3, 7, 100}) {
    for (std::int64_t n : {0, 1, 2, 5, 64, 1000}) {
      CAPTURE(threads, n);
      const std::vector<Chunk> want = chunks_of(exec::Host{threads}, n);
      REQUIRE(want.size() == static_cast<std::size_t>(n == 0 ? 0 : detail::host_workers(exec::Host{threads}, n)));
      for (std::size_t w = 0; w < want.size(); ++w) REQUIRE(std::get<2>(want[w]) == static_cast<int>(w));
      REQUIRE(chunks_of(exec::Host{threads, pool.executor()}, n) == want);
      const int before = reverse.calls;
      REQUIRE(chunks_of(exec::Host{threads, reverse.executor()}, n) == want);
      // Single-chunk work stays inline: no executor round trip for it.
      REQUIRE(reverse.calls - before == (want.size() > 1 ? 1 : 0));
    }
  }
}

TEST_CASE("ThreadPool runs every task exactly once, call after call", "[parallel][pool]") {
  for (int size : {1, 2, 4}) {
    for (int spin : {0, ThreadPool::kDefaultSpin}) {
      CAPTURE(size, spin);
      ThreadPool pool(size, spin);
      REQUIRE(pool.size() == size);
      REQUIRE(pool.host().threads == size);
      REQUIRE(static_cast<bool>(pool.host().executor));
      std::vector<std::atomic<int>> hits(97);
      for (int round = 0; round < 300; ++round) {
        const int tasks = 1 + round % 97;
        for (int i = 0; i < tasks; ++i) hits[static_cast<std::size_t>(i)].store(0);
        pool.run(tasks, [](void* arg, int i) {
          static_cast<std::atomic<int>*>(arg)[i].fetch_add(1);
        }, hits.data());
        for (int i = 0; i < tasks; ++i) REQUIRE(hits[static_cast<std::size_t>(i)].load() == 1);
      }
      pool.run(0, [](void*, int) { FAIL("no task expected"); }, nullptr);
    }
  }
}

TEST_CASE("ThreadPool uses its workers, nests inline and serialises callers",
          "[parallel][pool]") {
  ThreadPool pool(3, 0);
  SECTION("tasks reach more than one thread") {
    // Each task waits (bounded) until two tasks run at once: only possible on 2+ threads.
    // The bound is 20 s of wall clock, not a count of yields: on a loaded 2-core CI
    // machine a second worker may take a while to be scheduled.
    std::atomic<int> running{0}, overlapped{0};
    struct Ctx {
      std::atomic<int>* running;
      std::atomic<int>* overlapped;
    } ctx{&running, &overlapped};
    pool.run(3, [](void* arg, int) {
      auto& c = *static_cast<Ctx*>(arg);
      c.running->fetch_add(1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (c.running->load() < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      if (c.running->load() >= 2) c.overlapped->fetch_add(1);
    }, &ctx);
    REQUIRE(overlapped.load() >= 1);
  }
  SECTION("run from inside a task runs inline") {
    std::atomic<int> inner{0};
    struct Ctx {
      ThreadPool* pool;
      std::atomic<int>* inner;
    } ctx{&pool, &inner};
    pool.run(4, [](void* arg, int) {
      auto& c = *static_cast<Ctx*>(arg);
      c.pool->run(5, [](void* a, int) { static_cast<std::atomic<int>*>(a)->fetch_add(1); },
                  c.inner);
    }, &ctx);
    REQUIRE(inner.load() == 20);
  }
  SECTION("two threads submitting at once") {
    std::atomic<long> sum{0};
    auto submit = [&] {
      for (int r = 0; r < 200; ++r)
        pool.run(7, [](void* a, int i) { static_cast<std::atomic<long>*>(a)->fetch_add(i + 1); },
                 &sum);
    };
    std::thread other(submit);
    submit();
    other.join();
    REQUIRE(sum.load() == 2L * 200 * 28);
  }
}

TEST_CASE("ThreadPool rejects a bad size", "[parallel][pool]") {
  REQUIRE_THROWS_WITH(ThreadPool(0), Catch::Contains("got 0"));
}

TEMPLATE_TEST_CASE("kernels are bitwise identical under any executor", "[parallel][pool]",
                   float, half_t) {
  using T = TestType;
  KVKIT_TEST_RNG(rng);
  ThreadPool pool(4);
  ReverseExecutor reverse;
  const exec::Host runners[] = {exec::Host{1}, exec::Host{4}, exec::Host{4, pool.executor()},
                                exec::Host{4, reverse.executor()}, pool.host()};
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    CAPTURE(static_cast<int>(layout));
    PoolSpec spec;
    spec.num_kv_heads = 4;
    spec.head_dim = 32;
    spec.page_size = 8;
    spec.layout = layout;
    spec.seq_lens = {0, 8, 37, 100, 3, 64};
    spec.spare_pages = 16;
    const std::uint64_t seed = rng();
    const std::int32_t hkv = spec.num_kv_heads, dim = spec.head_dim, batch = 6, hq = 8;
    const std::vector<T> q = random_vector<T>(static_cast<std::size_t>(batch) * hq * dim, rng);
    const std::vector<T> k_new = random_vector<T>(static_cast<std::size_t>(3) * hkv * dim, rng);
    const std::vector<T> v_new = random_vector<T>(k_new.size(), rng);

    std::vector<std::vector<T>> outs;
    std::vector<std::vector<T>> ks, vs;
    std::vector<std::vector<float>> lses;
    for (const exec::Host& ex : runners) {
      std::mt19937_64 r(seed);
      RandomPool<T> p(spec, r);
      // write_kv into three slots of the last sequence's pages, then decode, then copy
      // four spare pages and compact every sequence to its odd tokens.
      const std::int64_t slots[] = {p.pages[3][0] * 8 + 1, p.pages[3][12] * 8 + 3,
                                    p.pages[5][7] * 8 + 7};
      REQUIRE(write_kv(ex, p.view, k_new.data(), v_new.data(), slots, 3, hkv * dim).is_ok());
      const DecodeAttentionParams params{hq, 1.f / std::sqrt(static_cast<float>(dim))};
      std::vector<unsigned char> ws(paged_decode_attention_workspace_size(ex, p.view, params) + 1);
      std::vector<T> out(q.size());
      std::vector<float> lse(static_cast<std::size_t>(batch) * hq);
      REQUIRE(paged_decode_attention(ex, p.view, q.data(), out.data(), params,
                                     Workspace{ws.data(), ws.size()}, lse.data())
                  .is_ok());
      const std::vector<std::int32_t> src(p.indices.begin(), p.indices.begin() + 4);
      const std::vector<std::int32_t> dst(p.free_pages.begin(), p.free_pages.begin() + 4);
      REQUIRE(copy_pages(ex, p.view, src.data(), dst.data(), 4).is_ok());
      const std::int32_t stride = 50;
      std::vector<std::int32_t> keep(static_cast<std::size_t>(batch) * hkv * stride, 0);
      std::vector<std::int32_t> num_keep(static_cast<std::size_t>(batch));
      for (std::int32_t b = 0; b < batch; ++b) {
          const std::int32_t nk = std::min(spec.seq_lens[static_cast<std::size_t>(b)] / 2, stride);
        num_keep[static_cast<std::size_t>(b)] = nk;
        // Even heads keep odd tokens ascending (in-place path), odd heads descending
        // (staged through the per-worker workspace).
        for (std::int32_t h = 0; h < hkv; ++h)
          for (std::int32_t i = 0; i < nk; ++i)
            keep[(static_cast<std::size_t>(b) * hkv + h) * stride + static_cast<std::size_t>(i)] =
                h % 2 == 0 ? 2 * i + 1 : 2 * nk - 1 - 2 * i;
      }
      std::vector<unsigned char> cws(compact_tokens_workspace_size(ex, p.view, stride) + 1);
      REQUIRE(compact_tokens(ex, p.view, keep.data(), num_keep.data(), stride,
                             Workspace{cws.data(), cws.size()})
                  .is_ok());
      outs.push_back(out);
      lses.push_back(lse);
      ks.push_back(p.k);
      vs.push_back(p.v);
    }
    for (std::size_t i = 1; i < outs.size(); ++i) {
      CAPTURE(i);
      REQUIRE(bitwise_equal(outs[i], outs[0]));
      REQUIRE(bitwise_equal(lses[i], lses[0]));
      REQUIRE(bitwise_equal(ks[i], ks[0]));
      REQUIRE(bitwise_equal(vs[i], vs[0]));
    }
    REQUIRE(reverse.calls > 0);
  }
}

// ---------------------------------------------------------------------------------------
// copy_pages: the src/dst clash check

namespace {

/// The rule copy_pages enforces, by brute force: first i with dst[i] a source, or equal
/// to an earlier destination.
detail::cpu::CopyClash ref_clash(const std::vector<std::int32_t>& src,
                                 const std::vector<std::int32_t>& dst) {
  const std::set<std::int32_t> sources(src.begin(), src.end());
  std::set<std::int32_t> seen;
  for (std::size_t i = 0; i < dst.size(); ++i) {
    if (sources.count(dst[i])) return {static_cast<std::int32_t>(i), false};
    if (!seen.insert(dst[i]).second) return {static_cast<std::int32_t>(i), true};
  }
  return {};
}

void require_same(detail::cpu::CopyClash got, detail::cpu::CopyClash want) {
  REQUIRE(got.position == want.position);
  if (want.position >= 0) REQUIRE(got.repeated == want.repeated);
}

detail::cpu::CopyClash sorted_clash(const std::vector<std::int32_t>& src,
                                    const std::vector<std::int32_t>& dst) {
  std::vector<std::int32_t> s(src.size());
  std::vector<std::uint64_t> d(dst.size());
  return detail::cpu::find_copy_clash_sorted(src.data(), dst.data(),
                                             static_cast<std::int32_t>(src.size()), s.data(),
                                             d.data());
}

}  // namespace

TEST_CASE("copy_pages clash check: windowed and sorted agree with brute force",
          "[copy_pages][parallel]") {
  KVKIT_TEST_RNG(rng);
  constexpr std::int32_t kW = detail::cpu::kCopyPagesBitsetPages;
  for (std::int32_t range : {50, kW, kW + 1, 3 * kW + 17, 1 << 24, 2147483647}) {
    for (int trial = 0; trial < 40; ++trial) {
      CAPTURE(range, trial);
      const std::int32_t n = 1 + static_cast<std::int32_t>(rng() % 300);
      std::uniform_int_distribution<std::int32_t> id(0, range - 1);
      // Distinct ids split into sources and destinations, then (in most trials) one clash
      // planted at a random position: a repeated destination or a destination that is a
      // source. Ids near window edges are over-represented.
      std::set<std::int32_t> pool_ids;
      while (static_cast<std::int32_t>(pool_ids.size()) < std::min(2 * n, range)) {
        std::int32_t x = id(rng);
        if (rng() % 4 == 0) {  // the first or last id of x's window
          const std::int64_t edge = std::int64_t{x} / kW * kW + (rng() % 2 ? 0 : kW - 1);
          x = static_cast<std::int32_t>(std::min<std::int64_t>(range - 1, edge));
        }
        pool_ids.insert(x);
      }
      std::vector<std::int32_t> ids(pool_ids.begin(), pool_ids.end());
      std::shuffle(ids.begin(), ids.end(), rng);
      if (static_cast<std::int32_t>(ids.size()) < 2 * n) continue;  // tiny range
      std::vector<std::int32_t> src(ids.begin(), ids.begin() + n);
      std::vector<std::int32_t> dst(ids.begin() + n, ids.begin() + 2 * n);
      // Sources may repeat (one page feeding several destinations).
      if (n > 1 && rng() % 2) src[rng() % n] = src[rng() % n];
      const int kind = static_cast<int>(rng() % 3);
      const auto at = static_cast<std::size_t>(rng() % n);
      if (kind == 1 && n > 1 && at > 0) dst[at] = dst[rng() % at];
      if (kind == 2) dst[at] = src[rng() % n];
      const detail::cpu::CopyClash want = ref_clash(src, dst);
      if (kind == 0) REQUIRE(want.position < 0);
      std::int64_t passes = 0;
      require_same(detail::cpu::find_copy_clash_windowed(src.data(), dst.data(), n, &passes),
                   want);
      require_same(sorted_clash(src, dst), want);
      require_same(detail::cpu::find_copy_clash_selected(src.data(), dst.data(), n), want);
      require_same(detail::cpu::find_copy_clash_no_scratch(src.data(), dst.data(), n, range),
                   want);
      REQUIRE(passes >= 1);
      REQUIRE(passes <= 2 * n + 1);
    }
  }
}

TEST_CASE("copy_pages clash check: selection passes carry an id across pass boundaries",
          "[copy_pages][parallel]") {
  // 7 source pages feed 10000 copies, so each source id has ~1430 entries and the
  // 4096-entry selection passes split ids; clashes planted inside split ids are found.
  KVKIT_TEST_RNG(rng);
  const std::int32_t n = 10000;
  std::vector<std::int32_t> src(static_cast<std::size_t>(n)), dst(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) {
    src[static_cast<std::size_t>(i)] = 1000 + i % 7;
    dst[static_cast<std::size_t>(i)] = 2000 + i;
  }
  std::shuffle(dst.begin(), dst.end(), rng);
  for (int plant = 0; plant < 4; ++plant) {
    CAPTURE(plant);
    std::vector<std::int32_t> d = dst;
    if (plant == 1) d[n - 1] = 1003;       // a source id split across passes
    if (plant == 2) d[4321] = d[17];       // repeated destination
    if (plant == 3) {                      // both: the earlier position wins
      d[9000] = 1001;
      d[8000] = d[100];
    }
    std::int64_t passes = 0;
    const detail::cpu::CopyClash got =
        detail::cpu::find_copy_clash_selected(src.data(), d.data(), n, &passes);
    REQUIRE(passes == (2 * n + detail::cpu::kCopyPagesSelectEntries - 1) /
                          detail::cpu::kCopyPagesSelectEntries);
    require_same(got, ref_clash(src, d));
    require_same(detail::cpu::find_copy_clash_windowed(src.data(), d.data(), n), got);
  }
}

TEST_CASE("copy_pages clash check stays linear above 131072 pages", "[copy_pages][parallel]") {
  // Before: pools over kCopyPagesBitsetPages pages fell back to an all-pairs scan (n^2
  // comparisons: 60000 copies took seconds at 131073 pages). Now the number of passes over
  // the ids is bounded by the windows the ids occupy, whatever n is.
  KVKIT_TEST_RNG(rng);
  constexpr std::int32_t kW = detail::cpu::kCopyPagesBitsetPages;
  const std::int32_t n = 60000;
  for (std::int32_t np : {kW, kW + 1, 4 * kW, 1 << 21}) {
    CAPTURE(np);
    std::vector<std::int32_t> ids = random_distinct(2 * n, np, rng);
    std::vector<std::int32_t> src(ids.begin(), ids.begin() + n), dst(ids.begin() + n, ids.end());
    std::int64_t passes = 0;
    REQUIRE(detail::cpu::find_copy_clash_windowed(src.data(), dst.data(), n, &passes).position ==
            -1);
    REQUIRE(passes <= (np + kW - 1) / kW + 1);
    dst[n - 1] = src[0];  // the clash at the very end is found
    const detail::cpu::CopyClash c =
        detail::cpu::find_copy_clash_windowed(src.data(), dst.data(), n, &passes);
    REQUIRE(c.position == n - 1);
    REQUIRE_FALSE(c.repeated);
    require_same(sorted_clash(src, dst), c);
  }
  // Ids spread over the whole int32 range: the no-scratch check switches to selection
  // passes, whose count depends on n only (not on the 16384 windows of the range).
  std::vector<std::int32_t> src(static_cast<std::size_t>(n)), dst(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) {
    src[static_cast<std::size_t>(i)] = i * 17881;  // distinct, up to 2^31 - 1.8e6
    dst[static_cast<std::size_t>(i)] = (n + i) * 17881;
  }
  std::int64_t passes = 0;
  REQUIRE(detail::cpu::find_copy_clash_selected(src.data(), dst.data(), n, &passes).position == -1);
  REQUIRE(passes == (2 * n + detail::cpu::kCopyPagesSelectEntries - 1) /
                        detail::cpu::kCopyPagesSelectEntries);
  dst[n / 2] = src[n - 1];
  const detail::cpu::CopyClash c = detail::cpu::find_copy_clash_no_scratch(
      src.data(), dst.data(), n, std::numeric_limits<std::int32_t>::max());
  REQUIRE(c.position == n / 2);
  REQUIRE_FALSE(c.repeated);
}

TEST_CASE("copy_pages on pools past the bitset window, with and without workspace",
          "[copy_pages][parallel]") {
  KVKIT_TEST_RNG(rng);
  constexpr std::int32_t kW = detail::cpu::kCopyPagesBitsetPages;
  for (std::int32_t np : {kW + 1, (1 << 21) + 5}) {
    CAPTURE(np);
    PoolSpec spec;
    spec.num_kv_heads = 1;
    spec.head_dim = 2;
    spec.page_size = 1;
    spec.seq_lens = {};
    spec.spare_pages = np;
    RandomPool<float> pool(spec, rng);
    REQUIRE(pool.view.num_pages_total == np);
    const std::int32_t n = 60000;
    const std::vector<std::int32_t> ids = random_distinct(2 * n, np, rng);
    std::vector<std::int32_t> src(ids.begin(), ids.begin() + n), dst(ids.begin() + n, ids.end());
    const std::size_t need = copy_pages_workspace_size(exec::Host{2}, pool.view, n);
    REQUIRE((need == 0) == (np <= 16 * kW));  // a workspace only helps past 16 windows
    std::vector<unsigned char> ws(need + 1);
    const Workspace w{ws.data(), ws.size()};

    // A clash at the last position is rejected with and without workspace; nothing moves.
    const std::vector<float> k0 = pool.k, v0 = pool.v;
    std::vector<std::int32_t> bad = dst;
    bad[n - 1] = bad[7];
    for (const Workspace& use : {Workspace{}, w}) {
      const Status st = copy_pages(exec::Host{2}, pool.view, src.data(), bad.data(), n, use);
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      REQUIRE_THAT(st.message(), Catch::Contains("destination page id " + std::to_string(bad[7]) +
                                                  " at position 59999 is repeated"));
    }
    REQUIRE(bitwise_equal(pool.k, k0));
    REQUIRE(bitwise_equal(pool.v, v0));

    // A valid batch copies every page, with the workspace path on the larger pool.
    REQUIRE(copy_pages(exec::Host{2}, pool.view, src.data(), dst.data(), n, w).is_ok());
    std::vector<float> want_k = k0, want_v = v0;
    for (std::size_t i = 0; i < src.size(); ++i)
      for (std::int32_t d = 0; d < 2; ++d) {
        want_k[pool.index(dst[i], 0, 0, d)] = k0[pool.index(src[i], 0, 0, d)];
        want_v[pool.v_index(dst[i], 0, 0, d)] = v0[pool.v_index(src[i], 0, 0, d)];
      }
    REQUIRE(bitwise_equal(pool.k, want_k));
    REQUIRE(bitwise_equal(pool.v, want_v));
  }
}
