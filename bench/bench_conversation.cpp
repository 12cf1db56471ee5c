// Cost of starting a conversation's next turn with its cached KV, by history length
// (1K to 32K tokens, page size 16, a 64-token new turn), on synthetic pages (a bare
// BlockAllocator: no K/V bytes move in either method):
//   prefix_lookup    the baseline, block-level prefix caching as vLLM does it
//                    (examples/engine/prefix_lru.hpp): hash the prompt's full blocks
//                    (chained SHA-256), look each up, take a reference to each hit;
//   resume           ConversationCache::resume(id, prompt): compare the prompt with the
//                    cached tokens, hand the page list over (no hashing, no lookups);
//   resume_extending ConversationCache::resume_extending(id, n): the caller guarantees
//                    the prompt extends the history, so no comparison either;
//   suspend          ConversationCache::suspend (the turn's end): one retain per page.
// Only the call itself is timed (thread CPU time: the reference machine is shared); the
// state is put back outside the timed region. Counters: us per call and, for the cache
// calls, speedup = prefix_lookup time / this time at the same history length (the
// baseline runs first in the same process). Every call's result is checked (all history
// blocks hit, cached_len as expected); a wrong one fails the run. --kvkit_small: 1K only.

#include <benchmark/benchmark.h>
#include <time.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/block_allocator.hpp"
#include "engine/conversation_host.hpp"
#include "engine/prefix_lru.hpp"
#include "kvkit/conversation/conversation_cache.hpp"

namespace {

constexpr std::int32_t kPage = 16;
constexpr std::int32_t kNewTokens = 64;
bool g_small = false;
bool g_failed = false;
std::map<std::int64_t, double> g_prefix_us;  // history -> baseline us per call

double cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::vector<std::int32_t> tokens(std::int64_t n) {
  std::mt19937_64 rng(99 + static_cast<std::uint64_t>(n));
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = static_cast<std::int32_t>(rng() % 49152);
  return t;
}

void fail(const char* what, std::int64_t h) {
  if (!g_failed) std::fprintf(stderr, "bench_conversation: wrong result (%s) at history %lld\n", what, static_cast<long long>(h));
  g_failed = true;
}

void finish(benchmark::State& state, std::int64_t h, double total_s, bool baseline) {
  const double us = 1e6 * total_s / static_cast<double>(state.iterations());
  state.counters["us"] = us;
  if (baseline) {
    g_prefix_us[h] = us;
  } else if (g_prefix_us.count(h) != 0) {
    state.counters["speedup"] = g_prefix_us[h] / us;
  }
}

// A history of h tokens in h / 16 full pages, cached by the prefix cache; each call looks
// up the prompt (history + 64 new tokens).
void BM_prefix_lookup(benchmark::State& state) {
  const std::int64_t h = state.range(0);
  const std::int32_t n_pages = static_cast<std::int32_t>(h / kPage);
  kvkit::engine::BlockAllocator alloc(n_pages + 16);
  kvkit::engine::PrefixLruCache cache(alloc, kPage);
  const std::vector<std::int32_t> prompt = tokens(h + kNewTokens);
  std::vector<std::int32_t> pages;
  for (std::int32_t i = 0; i < n_pages; ++i) pages.push_back(alloc.allocate());
  cache.cache_blocks(prompt.data(), static_cast<std::size_t>(h), pages);
  for (std::int32_t p : pages) alloc.release(p);
  cache.queue_unused(pages);
  double total = 0;
  for (auto _ : state) {
    const double t0 = cpu_s();
    kvkit::engine::PrefixLruCache::Hit hit = cache.lookup(prompt.data(), prompt.size());
    total += cpu_s() - t0;
    if (hit.cached_len != h) fail("prefix hit", h);
    for (std::int32_t p : hit.pages) alloc.release(p);  // the request ends
    cache.queue_unused(hit.pages);
  }
  finish(state, h, total, true);
}

enum class Mode { kResume, kExtending, kSuspend };

void run_cache(benchmark::State& state, Mode mode) {
  const std::int64_t h = state.range(0);
  const std::int32_t n_pages = static_cast<std::int32_t>(h / kPage);
  kvkit::engine::BlockAllocator alloc(n_pages + 16);
  kvkit::engine::AllocatorPageHost host(alloc, kPage);
  kvkit::conversation::ConversationCache<float> cache(host, kvkit::conversation::Params{});
  const std::vector<std::int32_t> prompt = tokens(h + kNewTokens);
  const std::vector<std::int32_t> history(prompt.begin(), prompt.begin() + h);
  std::vector<std::int32_t> pages;
  for (std::int32_t i = 0; i < n_pages; ++i) pages.push_back(alloc.allocate());
  cache.create("c");
  cache.suspend("c", history, pages);
  for (std::int32_t p : pages) alloc.release(p);
  double total = 0;
  for (auto _ : state) {
    double t0 = cpu_s();
    kvkit::conversation::Resume r = mode == Mode::kExtending
                                        ? cache.resume_extending("c", prompt.size())
                                        : cache.resume("c", prompt);
    if (mode != Mode::kSuspend) total += cpu_s() - t0;
    if (r.cached_len != h || static_cast<std::int64_t>(r.pages.size()) != n_pages) fail("resume", h);
    t0 = cpu_s();
    cache.suspend("c", history, r.pages);  // the turn ends: the cache keeps the pages again
    if (mode == Mode::kSuspend) total += cpu_s() - t0;
    for (std::int32_t p : r.pages) alloc.release(p);  // the request's references
  }
  finish(state, h, total, false);
}

void BM_resume(benchmark::State& state) { run_cache(state, Mode::kResume); }
void BM_resume_extending(benchmark::State& state) { run_cache(state, Mode::kExtending); }
void BM_suspend(benchmark::State& state) { run_cache(state, Mode::kSuspend); }

void register_all() {
  std::vector<std::int64_t> hs = {1024, 2048, 4096, 8192, 16384, 32768};
  if (g_small) hs = {1024};
  for (std::int64_t h : hs) {
    // Baseline first, so the cache calls of the same length can report their speedup.
    benchmark::RegisterBenchmark(("prefix_lookup/H" + std::to_string(h)).c_str(), BM_prefix_lookup)->Arg(h);
    benchmark::RegisterBenchmark(("resume/H" + std::to_string(h)).c_str(), BM_resume)->Arg(h);
    benchmark::RegisterBenchmark(("resume_extending/H" + std::to_string(h)).c_str(), BM_resume_extending)->Arg(h);
    benchmark::RegisterBenchmark(("suspend/H" + std::to_string(h)).c_str(), BM_suspend)->Arg(h);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--kvkit_small") == 0) {
      g_small = true;
      continue;
    }
    args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return g_failed ? 1 : 0;
}
