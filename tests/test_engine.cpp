// Tests of the example engine (examples/engine) and the `kvkit` CLI.
//
// Runs on the real stories260K checkpoint when KVKIT_MODEL_DIR holds it (skipping with a
// message otherwise) and always on a generated checkpoint of the same shape.

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/block_allocator.hpp"
#include "engine/checkpoint.hpp"
#include "engine/engine.hpp"
#include "engine/npy.hpp"
#include "reference_forward.hpp"
#include "engine_runs.hpp"
#include "test_scale.hpp"

using namespace kvkit;
using namespace kvkit::engine;
using kvkit::test::run_engine;
namespace fs = std::filesystem;

namespace {

const std::string kModelPath = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";

// A fresh per-test temporary folder, removed at the end of the scope.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() /
           ("kvkit_test_engine_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};


std::size_t distinct(const std::vector<std::int32_t>& v) {
  return std::set<std::int32_t>(v.begin(), v.end()).size();
}

const char* table_name(PageTableKind k) { return k == PageTableKind::kCsr ? "csr" : "block"; }

// float64 reference forward (RefModel) and rel_err: reference_forward.hpp.
using test::RefModel;
using test::rel_err;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// =======================================================================================

TEST_CASE("paged layouts, page sizes and page tables decode identical tokens", "[engine]") {
  for (const test::NamedModel& m : test::synthetic_and_stories()) {
    INFO("model " << m.name);
    const int steps = test::scaled(256, 128);  // 128: still 8 pages of 16, 2 of 64
    EngineOptions contiguous;
    contiguous.contiguous = true;
    const auto ref = run_engine(m.ckpt, contiguous, {{kBosToken}}, steps)[0];
    REQUIRE(ref.size() == static_cast<std::size_t>(steps + 1));
    REQUIRE(ref[0] == kBosToken);
    // A degenerate decode (one token repeated) would make the comparison meaningless.
    CHECK(distinct(ref) >= 20);
    for (std::int32_t ps : {1, 16, 64})
      for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND})
        for (PageTableKind table : {PageTableKind::kCsr, PageTableKind::kBlockTable}) {
          INFO("page_size " << ps << " layout " << to_string(layout) << " table " << table_name(table));
          EngineOptions o;
          o.page_size = ps;
          o.layout = layout;
          o.table_kind = table;
          o.shuffle_seed = 1234 + ps;  // scattered page ids
          o.max_batch = 1;
          Engine eng(m.ckpt, o);
          const SeqId id = eng.add_sequence({kBosToken});
          for (int s = 0; s < steps; ++s) eng.step();
          CHECK(eng.tokens(id) == ref);
          const std::int32_t pages = (steps + ps - 1) / ps;
          CHECK(eng.pages_in_use() == pages);
          CHECK(eng.kv_bytes_in_use() ==
                static_cast<std::int64_t>(pages) * ps * m.ckpt->config().kv_dim() * 4 *
                    m.ckpt->config().n_layers * 2);
          CHECK(eng.kv_bytes_peak() == eng.kv_bytes_in_use());
          eng.free_sequence(id);
          CHECK(eng.pages_in_use() == 0);
          CHECK(eng.kv_bytes_peak() > 0);
        }
  }
}

TEST_CASE("a batch with different prompts matches each sequence run alone", "[engine]") {
  for (const test::NamedModel& m : test::synthetic_and_stories()) {
    INFO("model " << m.name);
    const int steps = test::scaled(256, 128);
    const std::vector<std::vector<std::int32_t>> prompts = {
        {kBosToken}, {kBosToken, 300, 301, 302}, {kBosToken, 400}, {kBosToken, 7, 99, 260, 261, 262, 263}};
    std::vector<std::vector<std::int32_t>> alone;
    EngineOptions contiguous;
    contiguous.contiguous = true;
    for (const auto& p : prompts) alone.push_back(run_engine(m.ckpt, contiguous, {p}, steps)[0]);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      REQUIRE(alone[i].size() == static_cast<std::size_t>(steps + 1));
      CHECK(std::equal(prompts[i].begin(), prompts[i].end(), alone[i].begin()));
    }
    CHECK(alone[0] != alone[1]);
    struct Cfg { std::int32_t ps; KVLayout layout; PageTableKind table; };
    for (const Cfg& cfg : {Cfg{16, KVLayout::kNHD, PageTableKind::kCsr},
                           Cfg{1, KVLayout::kHND, PageTableKind::kBlockTable},
                           Cfg{7, KVLayout::kHND, PageTableKind::kCsr}}) {
      INFO("page_size " << cfg.ps << " layout " << to_string(cfg.layout) << " table "
                        << table_name(cfg.table));
      EngineOptions o;
      o.page_size = cfg.ps;
      o.layout = cfg.layout;
      o.table_kind = cfg.table;
      o.shuffle_seed = 99;
      o.validate_tables = true;
      const auto batch = run_engine(m.ckpt, o, prompts, steps);
      for (std::size_t i = 0; i < prompts.size(); ++i) CHECK(batch[i] == alone[i]);
    }
  }
}

TEST_CASE("sequences joining and leaving mid-run reuse pages without changing others", "[engine]") {
  const auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  EngineOptions contiguous;
  contiguous.contiguous = true;
  const auto a_ref = run_engine(ck, contiguous, {{kBosToken}}, 96)[0];
  const auto c_ref = run_engine(ck, contiguous, {{kBosToken, 77}}, 40)[0];
  EngineOptions o;
  o.page_size = 4;
  o.shuffle_seed = 5;
  o.max_batch = 3;
  o.num_pages = 40;  // tight: freed pages (with stale K/V) must be reused
  Engine eng(ck, o);
  const SeqId a = eng.add_sequence({kBosToken});
  const SeqId b = eng.add_sequence({kBosToken, 300});
  for (int s = 0; s < 56; ++s) eng.step();
  const std::int32_t before = eng.pages_in_use();
  eng.free_sequence(b);
  CHECK(eng.pages_in_use() == before - 14);
  CHECK_THROWS_WITH(eng.tokens(b), Catch::Contains("no sequence with id 1"));
  const SeqId c = eng.add_sequence({kBosToken, 77});
  for (int s = 0; s < 40; ++s) eng.step();
  CHECK(eng.tokens(a) == a_ref);
  CHECK(eng.tokens(c) == c_ref);
  CHECK(eng.sequences() == std::vector<SeqId>{a, c});
  CHECK(eng.position(a) == 96);
  CHECK(eng.kv_len(c) == 40);
}

TEST_CASE("engine logits match a float64 reference forward pass", "[engine][reference]") {
  for (const test::NamedModel& m : test::synthetic_and_stories()) {
    INFO("model " << m.name);
    const ModelConfig& c = m.ckpt->config();
    const int steps = 64;
    for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
      INFO("layout " << to_string(layout));
      EngineOptions o;
      o.page_size = layout == KVLayout::kNHD ? 16 : 3;
      o.layout = layout;
      o.table_kind = layout == KVLayout::kNHD ? PageTableKind::kBlockTable : PageTableKind::kCsr;
      o.shuffle_seed = 17;
      o.max_batch = 2;
      Engine eng(m.ckpt, o);
      const std::vector<std::vector<std::int32_t>> prompts = {{kBosToken}, {kBosToken, 321, 5}};
      std::vector<SeqId> ids;
      std::vector<RefModel> refs;
      for (const auto& p : prompts) {
        ids.push_back(eng.add_sequence(p));
        refs.emplace_back(*m.ckpt, 1e-5, 10000.0);  // llama2.c: fixed eps and RoPE base
      }
      double worst = 0;
      for (int s = 0; s < steps; ++s) {
        eng.step();
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const std::vector<double> ref = refs[i].forward(eng.tokens(ids[i])[static_cast<std::size_t>(s)]);
          const double e = rel_err(eng.last_logits(ids[i]), ref);
          worst = std::max(worst, e);
          if (e > 1e-4) FAIL("step " << s << " sequence " << i << " relative error " << e);
        }
      }
      CHECK(worst <= 1e-4);
      // The pool holds the reference's post-RoPE keys and values at every position.
      const auto& views = eng.layer_views();
      double kv_diff = 0, kv_mag = 0;
      for (std::size_t i = 0; i < ids.size(); ++i)
        for (int l = 0; l < c.n_layers; ++l)
          for (int t = 0; t < steps; ++t)
            for (int h = 0; h < c.n_kv_heads; ++h)
              for (int d = 0; d < c.head_dim(); ++d) {
                const double rk = refs[i].key(l, t, h, d), rv = refs[i].value(l, t, h, d);
                kv_diff = std::max({kv_diff, std::abs(views[l].k_ptr(static_cast<int>(i), t, h)[d] - rk),
                                    std::abs(views[l].v_ptr(static_cast<int>(i), t, h)[d] - rv)});
                kv_mag = std::max({kv_mag, std::abs(rk), std::abs(rv)});
              }
      CHECK(kv_mag > 0);
      CHECK(kv_diff / kv_mag <= 1e-4);
    }
  }
}

TEST_CASE("teacher forcing, step hooks, truncation and cached prefixes", "[engine]") {
  const auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  const ModelConfig& c = ck->config();
  EngineOptions o;
  o.page_size = 4;
  o.max_batch = 2;

  SECTION("forward_tokens reproduces greedy decoding and follows forced tokens") {
    Engine greedy(ck, o), forced(ck, o);
    const SeqId g = greedy.add_sequence({kBosToken, 10});
    const SeqId f = forced.add_sequence({kBosToken, 10});
    for (int s = 0; s < 20; ++s) {
      greedy.step();
      const std::size_t next = static_cast<std::size_t>(s) + 1;
      forced.forward_tokens({s == 0 ? -1 : greedy.tokens(g)[next]});
      CHECK(forced.last_logits(f) == greedy.last_logits(g));
    }
    CHECK(forced.tokens(f) == greedy.tokens(g));
    // Force a token the model would not choose; the result equals a run whose prompt has it.
    const auto& lg = greedy.last_logits(g);
    const std::int32_t best = static_cast<std::int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
    const std::int32_t other = (best + 1) % c.vocab_size;
    Engine a(ck, o), b(ck, o);
    const SeqId ia = a.add_sequence({kBosToken});
    a.forward_tokens({other});
    CHECK(a.tokens(ia) == std::vector<std::int32_t>{kBosToken, other});
    const SeqId ib = b.add_sequence({kBosToken, other});
    b.step();
    a.step();
    b.step();
    CHECK(a.last_logits(ia) == b.last_logits(ib));
    CHECK(a.tokens(ia) == b.tokens(ib));
    CHECK_THROWS_WITH(a.forward_tokens({}), Catch::Contains("got 0 tokens for 1 sequences"));
    CHECK_THROWS_WITH(a.forward_tokens({c.vocab_size}), Catch::Contains(std::to_string(c.vocab_size)));
    CHECK_THROWS_WITH(b.forward_tokens({-1}), Catch::Contains("forced token -1"));
    Engine p(ck, o);
    p.add_sequence({kBosToken, 5, 6});
    CHECK_THROWS_WITH(p.forward_tokens({7}), Catch::Contains("contradicts its prompt token 5"));
    p.forward_tokens({5});
  }

  SECTION("step hooks see every step's views, queries and logits") {
    Engine eng(ck, o);
    const SeqId s0 = eng.add_sequence({kBosToken});
    const SeqId s1 = eng.add_sequence({kBosToken, 40, 41});
    int calls = 0;
    eng.add_step_hook([&](Engine& e, const StepInfo& info) {
      ++calls;
      REQUIRE(info.step == calls);
      REQUIRE(info.batch == 2);
      CHECK(info.seq_ids[0] == s0);
      CHECK(info.seq_ids[1] == s1);
      for (int l = 0; l < c.n_layers; ++l) {
        CHECK(info.layer_views[l].seq_len(0) == e.kv_len(s0));
        CHECK(info.layer_views[l].seq_len(1) == calls);
        CHECK(info.layer_views[l].k_data == e.k_pool(l));
        CHECK(info.queries[l] == e.model().queries(l));
      }
      CHECK(std::equal(info.logits, info.logits + c.vocab_size, e.last_logits(s0).begin()));
      CHECK(std::equal(info.logits + c.vocab_size, info.logits + 2 * c.vocab_size,
                       e.last_logits(s1).begin()));
    });
    for (int s = 0; s < 9; ++s) eng.step();
    CHECK(calls == 9);
  }

  SECTION("truncate_kv releases pages and keeps the position") {
    Engine eng(ck, o);
    const SeqId s = eng.add_sequence({kBosToken});
    for (int i = 0; i < 10; ++i) eng.step();
    CHECK(eng.pages_in_use() == 3);
    eng.truncate_kv(s, 4);
    CHECK(eng.pages_in_use() == 1);
    CHECK(eng.kv_len(s) == 4);
    CHECK(eng.position(s) == 10);
    eng.step();
    CHECK(eng.kv_len(s) == 5);
    CHECK(eng.position(s) == 11);
    CHECK(eng.pages_in_use() == 2);
    CHECK_THROWS_WITH(eng.truncate_kv(s, 6), Catch::Contains("to 6 tokens, it caches 5"));
  }

  SECTION("a sequence started on cached prefix pages equals a fresh run") {
    std::vector<std::int32_t> prompt = {kBosToken, 50, 51, 52, 53, 54, 55, 56, 57, 58};
    Engine eng(ck, o);
    const SeqId a = eng.add_sequence(prompt);
    for (int i = 0; i < 12; ++i) eng.step();
    // Share the first 8 positions (two full pages) with a new sequence.
    std::vector<std::int32_t> shared(eng.pages(a).begin(), eng.pages(a).begin() + 2);
    for (std::int32_t p : shared) eng.allocator().retain(p);
    std::vector<std::int32_t> prompt_b = prompt;
    prompt_b.push_back(60);
    const SeqId b = eng.add_sequence(prompt_b, shared, 8);
    CHECK(eng.position(b) == 8);
    for (int i = 0; i < 10; ++i) eng.step();
    const auto fresh = run_engine(ck, o, {prompt_b}, 18)[0];  // 8 cached + 10 steps
    CHECK(eng.tokens(b) == fresh);
    CHECK(eng.allocator().refcount(shared[0]) == 2);
    eng.free_sequence(a);
    CHECK(eng.allocator().refcount(shared[0]) == 1);
    // A shared, partly filled page may be handed over: the next write copies it first
    // (tests/test_engine_hooks.cpp checks the copy-on-write in detail).
    std::vector<std::int32_t> three(eng.pages(b).begin(), eng.pages(b).begin() + 3);
    for (std::int32_t p : three) eng.allocator().retain(p);
    const SeqId c2 = eng.add_sequence(prompt_b, three, 9);
    CHECK(eng.allocator().refcount(three[2]) == 2);
    eng.free_sequence(c2);
    CHECK(eng.allocator().refcount(three[2]) == 1);
    CHECK_THROWS_WITH(eng.add_sequence(prompt_b, shared, 4), Catch::Contains("expected 1"));
  }
}

TEST_CASE("engine configuration errors name the bad value", "[engine][errors]") {
  ModelConfig small;
  small.dim = 16;
  small.hidden_dim = 24;
  small.n_layers = 2;
  small.n_heads = 4;
  small.n_kv_heads = 2;
  small.vocab_size = 32;
  small.seq_len = 16;
  const auto ck = std::make_shared<const Checkpoint>(make_synthetic_checkpoint(small, 3));
  EngineOptions o;
  o.page_size = 4;
  o.max_batch = 2;
  {
    EngineOptions bad = o;
    bad.page_size = 0;
    CHECK_THROWS_WITH(Engine(ck, bad), Catch::Contains("page_size must be > 0, got 0"));
    bad = o;
    bad.max_batch = -2;
    CHECK_THROWS_WITH(Engine(ck, bad), Catch::Contains("got -2"));
  }
  Engine eng(ck, o);
  CHECK_THROWS_WITH(eng.step(), Catch::Contains("no sequences"));
  CHECK_THROWS_WITH(eng.add_sequence({}), Catch::Contains("at least one prompt token"));
  CHECK_THROWS_WITH(eng.add_sequence({1, 32}), Catch::Contains("prompt token 32"));
  CHECK_THROWS_WITH(eng.add_sequence(std::vector<std::int32_t>(17, 1)), Catch::Contains("17 tokens"));
  const SeqId s = eng.add_sequence({1});
  CHECK_THROWS_WITH(eng.last_logits(s), Catch::Contains("has not run a step"));
  for (int i = 0; i < 16; ++i) eng.step();
  CHECK_THROWS_WITH(eng.step(), Catch::Contains("seq_len 16"));
  eng.add_sequence({1});
  CHECK_THROWS_WITH(eng.add_sequence({1}), Catch::Contains("batch is full (max_batch 2)"));
  CHECK_THROWS_WITH(eng.free_sequence(42), Catch::Contains("no sequence with id 42"));

  EngineOptions tiny = o;
  tiny.num_pages = 2;
  Engine full(ck, tiny);
  full.add_sequence({1});
  for (int i = 0; i < 8; ++i) full.step();
  CHECK_THROWS_WITH(full.step(), Catch::Contains("out of KV pages: all 2 pages"));
  CHECK(full.pages_in_use() == 2);
  CHECK(full.steps_run() == 8);
}

TEST_CASE("checkpoints round-trip and bad files are rejected with the value named", "[engine][checkpoint]") {
  TempDir tmp("ckpt");
  ModelConfig c;
  c.dim = 16;
  c.hidden_dim = 24;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 32;
  c.seq_len = 16;
  for (bool shared : {true, false}) {
    c.shared_classifier = shared;
    const Checkpoint ck = make_synthetic_checkpoint(c, 11);
    const std::string path = tmp.file(shared ? "shared.bin" : "unshared.bin");
    save_checkpoint(ck, path);
    CHECK(fs::file_size(path) == expected_checkpoint_bytes(c));
    const Checkpoint back = load_checkpoint(path);
    CHECK(back.config().shared_classifier == shared);
    CHECK(back.weights() == ck.weights());
    CHECK(back.classifier() == (shared ? back.token_embedding() : back.rms_final() + c.dim));
    // Same seed, same weights; another seed, other weights.
    CHECK(make_synthetic_checkpoint(c, 11).weights() == ck.weights());
    CHECK(make_synthetic_checkpoint(c, 12).weights() != ck.weights());
  }
  if (fs::exists(kModelPath)) {
    const Checkpoint real = load_checkpoint(kModelPath);
    CHECK(real.config().dim == 64);
    CHECK(real.config().n_kv_heads == 4);
    CHECK(expected_checkpoint_bytes(real.config()) == 1056540);
  } else {
    WARN("skipped: no model file " << kModelPath);
  }
  c.shared_classifier = true;
  const std::vector<unsigned char> good = serialize_checkpoint(make_synthetic_checkpoint(c, 11));
  auto write = [&](const std::string& name, const std::vector<unsigned char>& bytes) {
    const std::string path = tmp.file(name);
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return path;
  };
  auto with_header = [&](int field, std::int32_t value) {
    std::vector<unsigned char> b = good;
    std::memcpy(b.data() + 4 * field, &value, 4);
    return b;
  };
  const std::string expected = std::to_string(good.size());

  CHECK_THROWS_WITH(load_checkpoint(tmp.file("missing.bin")),
                    Catch::Contains("cannot open") && Catch::Contains("missing.bin"));
  CHECK_THROWS_WITH(load_checkpoint(write("empty.bin", {})), Catch::Contains("is 0 bytes, shorter than the 28-byte header"));
  CHECK_THROWS_WITH(load_checkpoint(write("short.bin", std::vector<unsigned char>(good.begin(), good.begin() + 20))),
                    Catch::Contains("is 20 bytes"));
  const std::vector<unsigned char> cut(good.begin(), good.end() - 100);
  CHECK_THROWS_WITH(load_checkpoint(write("cut.bin", cut)),
                    Catch::Contains("cut.bin") && Catch::Contains(std::to_string(cut.size()) + " bytes, expected " + expected) &&
                        Catch::Contains("truncated"));
  std::vector<unsigned char> longer = good;
  longer.resize(good.size() + 8);
  CHECK_THROWS_WITH(load_checkpoint(write("long.bin", longer)),
                    Catch::Contains(std::to_string(longer.size()) + " bytes, expected " + expected));
  // A negative vocab_size announces an unshared classifier the file does not contain.
  CHECK_THROWS_WITH(load_checkpoint(write("unshared_missing.bin", with_header(5, -32))),
                    Catch::Contains("an unshared classifier") && Catch::Contains("a shared classifier would be " + expected));
  CHECK_THROWS_WITH(load_checkpoint(write("dim0.bin", with_header(0, 0))), Catch::Contains("dim must be > 0, got 0"));
  CHECK_THROWS_WITH(load_checkpoint(write("hid.bin", with_header(1, -7))), Catch::Contains("hidden_dim must be > 0, got -7"));
  CHECK_THROWS_WITH(load_checkpoint(write("layers.bin", with_header(2, 0))), Catch::Contains("n_layers must be > 0, got 0"));
  CHECK_THROWS_WITH(load_checkpoint(write("kv.bin", with_header(4, 3))),
                    Catch::Contains("n_heads 4 is not a multiple of n_kv_heads 3"));
  CHECK_THROWS_WITH(load_checkpoint(write("dimh.bin", with_header(0, 18))), Catch::Contains("dim 18 is not a multiple of n_heads 4"));
  CHECK_THROWS_WITH(load_checkpoint(write("odd.bin", with_header(0, 12))), Catch::Contains("head_dim 3"));
  CHECK_THROWS_WITH(load_checkpoint(write("vocab.bin", with_header(5, 0))), Catch::Contains("vocab_size must be non-zero, got 0"));
  CHECK_THROWS_WITH(load_checkpoint(write("seq.bin", with_header(6, -5))), Catch::Contains("seq_len must be > 0, got -5"));
  CHECK_THROWS_WITH(load_checkpoint(write("huge.bin", with_header(1, 2000000000))), Catch::Contains("expected"));
  std::vector<unsigned char> nan = good;
  const float bad = std::nanf("");
  std::memcpy(nan.data() + 28 + 4 * 40, &bad, 4);
  CHECK_THROWS_WITH(load_checkpoint(write("nan.bin", nan)), Catch::Contains("non-finite weight nan at float index 40"));
  CHECK_THROWS_WITH(make_synthetic_checkpoint(ModelConfig{}, 1), Catch::Contains("dim must be > 0, got 0"));
}

TEST_CASE("block allocator hands out, shares and reclaims pages", "[engine][allocator]") {
  CHECK_THROWS_WITH(BlockAllocator(0), Catch::Contains("num_pages > 0, got 0"));
  BlockAllocator a(4);
  CHECK(a.allocate() == 0);
  CHECK(a.allocate() == 1);
  CHECK(a.pages_in_use() == 2);
  a.retain(1);
  CHECK(a.refcount(1) == 2);
  a.release(1);
  CHECK(a.pages_in_use() == 2);
  a.release(1);
  CHECK(a.pages_in_use() == 1);
  CHECK(a.refcount(1) == 0);
  CHECK_THROWS_WITH(a.release(1), Catch::Contains("double free of page 1"));
  CHECK_THROWS_WITH(a.retain(3), Catch::Contains("retain of free page 3"));
  CHECK_THROWS_WITH(a.release(4), Catch::Contains("page id 4 outside the pool [0, 4)"));
  CHECK_THROWS_WITH(a.release(-1), Catch::Contains("page id -1"));
  CHECK_THROWS_WITH(a.refcount(9), Catch::Contains("page id 9"));
  CHECK(a.allocate() == 1);  // the freed page comes back first
  a.allocate();
  a.allocate();
  CHECK(a.try_allocate() == -1);
  CHECK_THROWS_WITH(a.allocate(), Catch::Contains("all 4 pages are in use"));
  CHECK(a.peak_pages_in_use() == 4);

  // A seeded shuffle scatters ids but still hands out every page exactly once.
  BlockAllocator s(64, 7), s2(64, 7);
  std::vector<std::int32_t> got, got2;
  for (int i = 0; i < 64; ++i) {
    got.push_back(s.allocate());
    got2.push_back(s2.allocate());
  }
  CHECK(got == got2);
  CHECK_FALSE(std::is_sorted(got.begin(), got.end()));
  std::sort(got.begin(), got.end());
  for (int i = 0; i < 64; ++i) CHECK(got[i] == i);
}

TEST_CASE("npy files have a valid v1.0 header and round-trip", "[engine][npy]") {
  TempDir tmp("npy");
  std::vector<float> f(2 * 3 * 5);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = 0.5f * static_cast<float>(i) - 3.f;
  write_npy(tmp.file("f.npy"), f.data(), {2, 3, 5});
  const std::string raw = slurp(tmp.file("f.npy"));
  REQUIRE(raw.size() > 10);
  CHECK(raw.compare(0, 8, std::string("\x93NUMPY\x01\x00", 8)) == 0);
  const std::size_t hlen = static_cast<unsigned char>(raw[8]) | (static_cast<unsigned char>(raw[9]) << 8);
  CHECK((10 + hlen) % 64 == 0);
  CHECK(raw[10 + hlen - 1] == '\n');
  CHECK(raw.find("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 5), }") == 10);
  CHECK(raw.size() == 10 + hlen + f.size() * 4);
  const NpyArray a = read_npy(tmp.file("f.npy"));
  CHECK(a.shape == std::vector<std::int64_t>{2, 3, 5});
  CHECK(a.as<float>() == f);
  std::vector<std::int64_t> t = {1, -2, 1LL << 40};
  write_npy(tmp.file("t.npy"), t.data(), {3});
  CHECK(slurp(tmp.file("t.npy")).find("'shape': (3,), }") != std::string::npos);
  const NpyArray b = read_npy(tmp.file("t.npy"));
  CHECK(b.descr == "<i8");
  CHECK(b.as<std::int64_t>() == t);
  CHECK_THROWS_WITH(b.as<float>(), Catch::Contains("holds <i8"));
}
