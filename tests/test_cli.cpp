// Tests of the `kvkit` CLI (examples/kvkit_cli.cpp): runs the built binary (KVKIT_CLI_PATH)
// and checks its output against the example engine.

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/engine.hpp"
#include "engine/npy.hpp"

using namespace kvkit;
using namespace kvkit::engine;
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

// Runs `steps` engine steps for the given prompts; returns every sequence's tokens.
std::vector<std::vector<std::int32_t>> run_engine(std::shared_ptr<const Checkpoint> ck,
                                                  EngineOptions o,
                                                  const std::vector<std::vector<std::int32_t>>& prompts,
                                                  int steps) {
  o.max_batch = static_cast<std::int32_t>(prompts.size());
  Engine eng(std::move(ck), o);
  std::vector<SeqId> ids;
  for (const auto& p : prompts) ids.push_back(eng.add_sequence(p));
  for (int s = 0; s < steps; ++s) eng.step();
  std::vector<std::vector<std::int32_t>> out;
  for (SeqId id : ids) out.push_back(eng.tokens(id));
  return out;
}

// ---------------------------------------------------------------------------------------
// A minimal JSON reader for the CLI output (objects, arrays, strings, numbers, literals).
struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  double num = 0;
  bool b = false;
  std::string str;
  std::vector<Json> arr;
  std::map<std::string, Json> obj;

  bool has(const std::string& k) const { return kind == kObject && obj.count(k); }
  const Json& operator[](const std::string& k) const { return obj.at(k); }
  std::vector<std::int32_t> ints() const {
    std::vector<std::int32_t> v;
    for (const Json& e : arr) v.push_back(static_cast<std::int32_t>(e.num));
    return v;
  }
};

struct JsonParser {
  const std::string& s;
  std::size_t i = 0;
  void ws() {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  }
  void expect(char c) {
    ws();
    if (i >= s.size() || s[i] != c) throw std::runtime_error(std::string("json: expected ") + c);
    ++i;
  }
  std::string string() {
    expect('"');
    std::string o;
    while (i < s.size() && s[i] != '"') {
      if (s[i] == '\\') {
        ++i;
        if (s[i] == 'u') {
          o += static_cast<char>(std::stoi(s.substr(i + 1, 4), nullptr, 16));
          i += 4;
        } else {
          o += s[i] == 'n' ? '\n' : s[i];
        }
      } else {
        o += s[i];
      }
      ++i;
    }
    expect('"');
    return o;
  }
  Json value() {
    ws();
    Json j;
    if (i >= s.size()) throw std::runtime_error("json: unexpected end");
    const char c = s[i];
    if (c == '{') {
      j.kind = Json::kObject;
      ++i;
      ws();
      if (s[i] == '}') return ++i, j;
      while (true) {
        std::string k = string();
        expect(':');
        j.obj[k] = value();
        ws();
        if (s[i] == ',') { ++i; continue; }
        expect('}');
        return j;
      }
    }
    if (c == '[') {
      j.kind = Json::kArray;
      ++i;
      ws();
      if (s[i] == ']') return ++i, j;
      while (true) {
        j.arr.push_back(value());
        ws();
        if (s[i] == ',') { ++i; continue; }
        expect(']');
        return j;
      }
    }
    if (c == '"') {
      j.kind = Json::kString;
      j.str = string();
      return j;
    }
    if (s.compare(i, 4, "true") == 0) { i += 4; j.kind = Json::kBool; j.b = true; return j; }
    if (s.compare(i, 5, "false") == 0) { i += 5; j.kind = Json::kBool; return j; }
    if (s.compare(i, 4, "null") == 0) { i += 4; return j; }
    std::size_t used = 0;
    j.num = std::stod(s.substr(i), &used);
    j.kind = Json::kNumber;
    i += used;
    return j;
  }
};

// Parses `text` as exactly one JSON value (nothing but whitespace may follow).
Json parse_json(const std::string& text) {
  JsonParser p{text};
  Json j = p.value();
  p.ws();
  if (p.i != text.size()) throw std::runtime_error("json: trailing text after the object");
  return j;
}

struct CliResult {
  int code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs the built `kvkit` binary with `args` (already shell-quoted where needed).
CliResult run_cli(const std::string& args) {
  static int counter = 0;
  TempDir tmp("cli" + std::to_string(counter++));
  const std::string out = tmp.file("out.txt"), err = tmp.file("err.txt");
  const std::string cmd = std::string("'") + KVKIT_CLI_PATH + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  CliResult r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace

TEST_CASE("kvkit CLI generate matches the library and reports usage errors", "[engine][cli]") {
  const int steps = 48;
  {
    const CliResult r = run_cli("generate --json --steps 48 --batch 2 --page-size 8 --layout hnd");
    INFO("stderr: " << r.err);
    REQUIRE(r.code == 0);
    const Json j = parse_json(r.out);
    for (const char* k : {"tokens", "batch_tokens", "steps", "tokens_per_s", "kv_bytes_peak",
                          "kv_bytes_final", "pages_in_use", "model", "page_size", "layout", "batch"})
      CHECK(j.has(k));
    EngineOptions o;
    o.page_size = 8;
    o.layout = KVLayout::kHND;
    const auto lib = run_engine(std::make_shared<const Checkpoint>(default_synthetic_checkpoint()), o,
                                {{kBosToken}, {kBosToken}}, steps);
    CHECK(j["tokens"].ints() == lib[0]);
    REQUIRE(j["batch_tokens"].arr.size() == 2);
    CHECK(j["batch_tokens"].arr[1].ints() == lib[1]);
    CHECK(j["model"].str == "synthetic");
    CHECK(j["steps"].num == steps);
    CHECK(j["batch"].num == 2);
    CHECK(j["page_size"].num == 8);
    CHECK(j["layout"].str == "hnd");
    CHECK(j["pages_in_use"].num == 12);
    CHECK(j["kv_bytes_final"].num == 12.0 * 8 * 32 * 4 * 5 * 2);
    CHECK(j["kv_bytes_peak"].num == j["kv_bytes_final"].num);
    CHECK(j["tokens_per_s"].num > 0);
  }
  {
    const CliResult r = run_cli("generate --steps 8");
    REQUIRE(r.code == 0);
    CHECK(r.out.find("model: synthetic (no --model given)") != std::string::npos);
    CHECK(r.out.find("tokens: 1 ") != std::string::npos);
    CHECK(r.err.empty());  // no progress output when stderr is not a terminal
  }
  if (fs::exists(kModelPath)) {
    const CliResult r = run_cli("generate --json --steps 64 --page-size 16 --model '" + kModelPath + "'");
    INFO("stderr: " << r.err);
    REQUIRE(r.code == 0);
    const Json j = parse_json(r.out);
    const auto lib = run_engine(std::make_shared<const Checkpoint>(load_checkpoint(kModelPath)),
                                EngineOptions{}, {{kBosToken}}, 64);
    CHECK(j["tokens"].ints() == lib[0]);
    CHECK(j["model"].str == kModelPath);
    CHECK_FALSE(j.has("batch_tokens"));
  } else {
    WARN("skipped: no model file " << kModelPath);
  }
  struct Bad { std::string args, needle; };
  for (const Bad& b : {Bad{"generate --bogus", "--bogus"}, Bad{"generate --steps 0", "0"},
                       Bad{"generate --steps abc", "abc"}, Bad{"generate --steps", "--steps needs a value"},
                       Bad{"generate --steps 600", "600"}, Bad{"generate --page-size -3", "-3"},
                       Bad{"generate --layout xyz", "xyz"}, Bad{"generate --batch 0", "--batch"},
                       Bad{"generate --out x", "--out"}, Bad{"trace --steps 4", "--out"},
                       Bad{"frobnicate", "frobnicate"}, Bad{"", "missing command"},
                       Bad{"generate --json --steps 99999999999", "99999999999"}}) {
    INFO("args: " << b.args);
    const CliResult r = run_cli(b.args);
    CHECK(r.code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.rfind("kvkit: error: ", 0) == 0);
    CHECK(r.err.find(b.needle) != std::string::npos);
  }
  {
    const CliResult r = run_cli("generate --model /nonexistent/model.bin");
    CHECK(r.code == 1);
    CHECK(r.err.find("/nonexistent/model.bin") != std::string::npos);
  }
  {
    const CliResult r = run_cli("--help");
    CHECK(r.code == 0);
    CHECK(r.out.find("usage: kvkit") != std::string::npos);
  }
}

TEST_CASE("kvkit CLI trace writes K/V/Q, tokens and logits as npy", "[engine][cli]") {
  TempDir tmp("trace");
  const int N = 12;
  const CliResult r = run_cli("trace --json --steps 12 --page-size 5 --out '" + tmp.file("t") + "'");
  INFO("stderr: " << r.err);
  REQUIRE(r.code == 0);
  const Json j = parse_json(r.out);
  CHECK(j["files"].arr.size() == 5 * 3 + 2);
  const auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  const ModelConfig& c = ck->config();
  EngineOptions o;
  o.page_size = 5;
  o.max_batch = 1;
  Engine eng(ck, o);
  const SeqId id = eng.add_sequence({kBosToken});
  std::vector<std::vector<float>> q(static_cast<std::size_t>(c.n_layers));
  eng.add_step_hook([&](Engine&, const StepInfo& info) {
    for (int l = 0; l < c.n_layers; ++l) q[l].insert(q[l].end(), info.queries[l], info.queries[l] + c.dim);
  });
  for (int s = 0; s < N; ++s) eng.step();
  CHECK(j["tokens"].ints() == eng.tokens(id));

  const NpyArray tokens = read_npy(tmp.file("t/tokens.npy"));
  CHECK(tokens.shape == std::vector<std::int64_t>{N});
  const auto tv = tokens.as<std::int64_t>();
  for (int t = 0; t < N; ++t) CHECK(tv[t] == eng.tokens(id)[t]);
  const NpyArray logits = read_npy(tmp.file("t/logits.npy"));
  CHECK(logits.shape == std::vector<std::int64_t>{N, c.vocab_size});
  const auto lv = logits.as<float>();
  for (int t = 0; t < N; ++t) {
    const auto row = lv.begin() + static_cast<std::ptrdiff_t>(t) * c.vocab_size;
    CHECK(std::max_element(row, row + c.vocab_size) - row == eng.tokens(id)[t + 1]);
  }
  CHECK(std::equal(lv.end() - c.vocab_size, lv.end(), eng.last_logits(id).begin()));
  const auto& views = eng.layer_views();
  const int hd = c.head_dim();
  for (int l = 0; l < c.n_layers; ++l) {
    INFO("layer " << l);
    const NpyArray k = read_npy(tmp.file("t/k_L" + std::to_string(l) + ".npy"));
    const NpyArray v = read_npy(tmp.file("t/v_L" + std::to_string(l) + ".npy"));
    const NpyArray qa = read_npy(tmp.file("t/q_L" + std::to_string(l) + ".npy"));
    CHECK(k.descr == "<f4");
    CHECK(k.shape == std::vector<std::int64_t>{c.n_kv_heads, N, hd});
    CHECK(v.shape == std::vector<std::int64_t>{c.n_kv_heads, N, hd});
    CHECK(qa.shape == std::vector<std::int64_t>{c.n_heads, N, hd});
    const auto kv = k.as<float>(), vv = v.as<float>(), qv = qa.as<float>();
    bool same = true;
    for (int h = 0; h < c.n_kv_heads; ++h)
      for (int t = 0; t < N; ++t)
        for (int d = 0; d < hd; ++d) {
          const std::size_t i = (static_cast<std::size_t>(h) * N + t) * hd + d;
          same = same && kv[i] == views[l].k_ptr(0, t, h)[d] && vv[i] == views[l].v_ptr(0, t, h)[d];
        }
    for (int h = 0; h < c.n_heads; ++h)
      for (int t = 0; t < N; ++t)
        for (int d = 0; d < hd; ++d)
          same = same && qv[(static_cast<std::size_t>(h) * N + t) * hd + d] == q[l][static_cast<std::size_t>(t) * c.dim + h * hd + d];
    CHECK(same);
  }
}
