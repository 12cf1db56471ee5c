// Tests of the `kvkit` CLI (examples/kvkit_cli.cpp): run the built binary (KVKIT_CLI_PATH)
// and check its output against the example engine run in-process with the same options.
// JSON output is read with nlohmann/json (the tests share no code with the CLI).


#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "cli_runner.hpp"
#include "engine_runs.hpp"
#include "engine/engine.hpp"
#include "engine/gguf.hpp"
#include "engine/npy.hpp"
#include "engine/tokenizer.hpp"
#include "kvkit/version.hpp"

using namespace kvkit;
using namespace kvkit::engine;
using kvkit::test::CliResult;
using kvkit::test::model_arg;
using kvkit::test::run_cli;
using kvkit::test::run_engine;
using kvkit::test::run_json;
using kvkit::test::slurp;
using kvkit::test::TempDir;
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

const std::string kModelPath = std::string(KVKIT_MODEL_DIR) + "/stories260K.bin";
const std::string kSmolPath = std::string(KVKIT_MODEL_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";

std::shared_ptr<const Checkpoint> synthetic() {
  static const auto ck = std::make_shared<const Checkpoint>(default_synthetic_checkpoint());
  return ck;
}

using Tokens = std::vector<std::int32_t>;

Tokens tokens_of(const Json& seq) { return seq.at("tokens").get<Tokens>(); }

std::vector<Tokens> all_tokens(const Json& j) {
  std::vector<Tokens> v;
  for (const Json& s : j.at("sequences")) v.push_back(tokens_of(s));
  return v;
}

// Every key path of `j` ("a", "a.b", "a[].c" for arrays of objects), i.e. its schema.
void key_paths(const Json& j, const std::string& prefix, std::set<std::string>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string p = prefix.empty() ? it.key() : prefix + "." + it.key();
      out.insert(p + ":" + it.value().type_name());
      key_paths(it.value(), p, out);
    }
  } else if (j.is_array()) {
    for (const Json& e : j) key_paths(e, prefix + "[]", out);
  }
}

std::set<std::string> schema(const Json& j) {
  std::set<std::string> s;
  key_paths(j, "", s);
  return s;
}

}  // namespace

// =======================================================================================

TEST_CASE("kvkit CLI generate matches the library", "[cli]") {
  const int steps = 48;
  {
    const Json j = run_json("generate --json --steps 48 --batch 2 --page-size 8 --layout hnd");
    EngineOptions o;
    o.page_size = 8;
    o.layout = KVLayout::kHND;
    const auto lib = run_engine(synthetic(), o, {{kBosToken}, {kBosToken}}, steps);
    REQUIRE(j.at("sequences").size() == 2);
    CHECK(all_tokens(j) == lib);
    CHECK(j.at("sequences")[1].at("prompt") == Tokens{kBosToken});
    CHECK(j.at("sequences")[1].at("index") == 1);
    CHECK(j.at("model") == "synthetic");
    CHECK(j.at("synthetic") == true);
    CHECK(j.at("command") == "generate");
    CHECK(j.at("version") == KVKIT_VERSION);
    CHECK(j.at("steps") == steps);
    CHECK(j.at("batch") == 2);
    CHECK(j.at("page_size") == 8);
    CHECK(j.at("num_pages") == 2 * 64);  // default pool: batch x ceil(512 / 8)
    CHECK(j.at("threads") == 1);
    CHECK(j.at("layout") == "hnd");
    CHECK(j.at("table") == "csr");
    CHECK(j.at("contiguous") == false);
    CHECK(j.at("pages_in_use") == 12);
    CHECK(j.at("kv_bytes_final") == 12 * 8 * 32 * 4 * 5 * 2);
    CHECK(j.at("kv_bytes_peak") == j.at("kv_bytes_final"));
    CHECK(j.at("tokens_per_s").get<double>() > 0);
  }
  {
    const CliResult r = run_cli("generate --steps 8");
    REQUIRE(r.code == 0);
    CHECK(r.out.find("model: synthetic (no --model given)") != std::string::npos);
    CHECK(r.out.find("tokens: 1 ") != std::string::npos);
    CHECK(r.err.empty());  // no progress output when stderr is not a terminal
  }
  {
    const Json j = run_json("generate --json --steps 40 --batch 3 --contiguous --table block");
    CHECK(all_tokens(j) == run_engine(synthetic(), EngineOptions{}, {{1}, {1}, {1}}, 40));
    CHECK(j.at("contiguous") == true);
    CHECK(j.at("page_size") == 512);
    CHECK(j.at("num_pages") == 3);
    CHECK(j.at("table") == "block");
  }
  if (fs::exists(kModelPath)) {
    const Json j = run_json("generate --json --steps 64 --page-size 16 --model '" + kModelPath + "'");
    const auto lib = run_engine(std::make_shared<const Checkpoint>(load_checkpoint(kModelPath)),
                                EngineOptions{}, {{kBosToken}}, 64);
    CHECK(all_tokens(j) == lib);
    CHECK(j.at("model") == kModelPath);
    CHECK(j.at("synthetic") == false);
  } else {
    WARN("skipped: no model file " << kModelPath);
  }
}

TEST_CASE("kvkit CLI --json has the same schema at batch 1 and batch 4", "[cli][json]") {
  const Json one = run_json("generate --json --steps 12");
  const Json four = run_json("generate --json --steps 12 --batch 4 --prompt '1 7' --prompt '1 9'");
  CHECK(one.at("sequences").size() == 1);
  CHECK(four.at("sequences").size() == 4);
  CHECK(schema(one) == schema(four));
  CHECK(schema(one).count("sequences[].tokens:array") == 1);
  CHECK_FALSE(one.contains("tokens"));  // no batch-1-only shortcut
  CHECK_FALSE(four.contains("batch_tokens"));
}

TEST_CASE("kvkit CLI --prompt and --prompt-file decode different prompts", "[cli][prompt]") {
  const auto ck = synthetic();
  const int steps = 30;
  {
    const Json j = run_json("generate --json --steps 30 --prompt '1 5, 9'");
    REQUIRE(j.at("sequences").size() == 1);
    CHECK(j.at("sequences")[0].at("prompt") == Tokens{1, 5, 9});
    CHECK(all_tokens(j) == run_engine(ck, EngineOptions{}, {{1, 5, 9}}, steps));
  }
  TempDir tmp("prompts");
  {
    std::ofstream f(tmp.file("p.txt"));
    f << "# two prompts, cycled over the batch\n1 100 200\n\n  1,300\n";
  }
  {
    const Json j = run_json("generate --json --steps 30 --batch 5 --page-size 4 --prompt-file '" +
                            tmp.file("p.txt") + "'");
    const std::vector<Tokens> prompts = {{1, 100, 200}, {1, 300}, {1, 100, 200}, {1, 300}, {1, 100, 200}};
    REQUIRE(j.at("sequences").size() == 5);
    for (std::size_t b = 0; b < 5; ++b) CHECK(j.at("sequences")[b].at("prompt") == prompts[b]);
    EngineOptions o;
    o.page_size = 4;
    const auto lib = run_engine(ck, o, prompts, steps);
    CHECK(all_tokens(j) == lib);
    CHECK(lib[0] != lib[1]);  // the prompts really differ in what they decode
    CHECK(j.at("batch") == 5);
  }
  {  // without --batch, one sequence per prompt
    const Json j = run_json("generate --json --steps 30 --prompt-file '" + tmp.file("p.txt") + "'");
    CHECK(j.at("batch") == 2);
    CHECK(all_tokens(j) == run_engine(ck, EngineOptions{}, {{1, 100, 200}, {1, 300}}, steps));
  }
  {  // --batch smaller than the number of prompts takes the first ones
    const Json j = run_json("generate --json --steps 30 --batch 1 --prompt '1 300' --prompt '1 2'");
    CHECK(all_tokens(j) == run_engine(ck, EngineOptions{}, {{1, 300}}, steps));
  }
  {  // text mode prints one line per sequence
    const CliResult r = run_cli("generate --steps 6 --prompt '1 300' --prompt '1 2'");
    REQUIRE(r.code == 0);
    CHECK(r.out.find("sequence 0: tokens: 1 300 ") != std::string::npos);
    CHECK(r.out.find("sequence 1: tokens: 1 2 ") != std::string::npos);
  }
}

TEST_CASE("kvkit CLI --threads and --num-pages reach the engine", "[cli][engine-options]") {
  const Json j = run_json("generate --json --steps 40 --batch 3 --page-size 8 --threads 3 --num-pages 17");
  CHECK(j.at("threads") == 3);
  CHECK(j.at("num_pages") == 17);
  EngineOptions o;
  o.page_size = 8;
  o.threads = 3;
  o.num_pages = 17;
  CHECK(all_tokens(j) == run_engine(synthetic(), o, {{1}, {1}, {1}}, 40));
  CHECK(j.at("pages_in_use") == 15);  // 3 x ceil(40 / 8)
  const CliResult r = run_cli("generate --steps 16 --threads 2 --num-pages 2");
  CHECK(r.code == 0);
  CHECK(r.out.find("(2 threads)") != std::string::npos);
  CHECK(r.out.find(" of 2 pages ") != std::string::npos);
}

TEST_CASE("kvkit CLI --kv-dtype stores 16-bit pages: half the KV bytes", "[cli][engine-options][kv_dtype]") {
  const std::string m = model_arg();
  const Json f32 = run_json("generate --json " + m + "--steps 40 --prompt '1 300 7'");
  CHECK(f32.at("kv_dtype") == "float32");
  for (const char* d : {"float16", "bfloat16"}) {
    INFO("--kv-dtype " << d);
    const Json j = run_json("generate --json " + m + "--steps 40 --prompt '1 300 7' --kv-dtype " + d);
    CHECK(j.at("kv_dtype") == d);
    CHECK(j.at("pages_in_use") == f32.at("pages_in_use"));
    CHECK(j.at("kv_bytes_final").get<std::int64_t>() * 2 == f32.at("kv_bytes_final").get<std::int64_t>());
    CHECK(j.at("sequences")[0].at("tokens").size() == f32.at("sequences")[0].at("tokens").size());
  }
}

TEST_CASE("kvkit CLI usage errors exit 2 naming the value", "[cli][errors]") {
  TempDir tmp("errors");
  {
    std::ofstream f(tmp.file("bad.txt"));
    f << "1 2 3\n1 2 x7\n";
    std::ofstream(tmp.file("empty.txt")) << "# nothing\n\n";
  }
  struct Bad {
    std::string args;
    std::vector<std::string> needles;
  };
  const std::string bad = "'" + tmp.file("bad.txt") + "'", empty = "'" + tmp.file("empty.txt") + "'";
  const std::vector<Bad> cases = {
      {"generate --bogus", {"--bogus"}},
      {"generate --steps 0", {"--steps", "0"}},
      {"generate --steps abc", {"--steps", "abc"}},
      {"generate --steps", {"--steps"}},
      {"generate --steps 600", {"600", "seq_len 512"}},
      {"generate --steps 99999999999", {"99999999999"}},
      {"generate --page-size -3", {"--page-size", "-3"}},
      {"generate --layout xyz", {"xyz"}},
      {"generate --table xyz", {"xyz"}},
      {"generate --batch 0", {"--batch", "0"}},
      {"generate --batch 4097", {"--batch", "4097"}},
      {"generate --out x", {"--out"}},
      {"trace --steps 4", {"--out"}},
      {"frobnicate", {"frobnicate"}},
      {"", {"missing command"}},
      {"generate --contiguous --page-size 8", {"--contiguous", "--page-size"}},
      {"generate --page-size 8 --contiguous", {"--contiguous", "--page-size"}},
      // Pools the machine cannot hold: the value and the bytes (page x 32 floats x 5 layers x K,V x 4 B).
      {"generate --page-size 2147483647", {"--page-size 2147483647", "2748779068160 bytes"}},
      {"generate --page-size 1000000000", {"--page-size 1000000000", "1280000000000 bytes"}},
      {"generate --num-pages 2000000000", {"--num-pages 2000000000", "40960000000000 bytes"}},
      {"generate --num-pages 3 --steps 64", {"--num-pages 3", "need 4 pages"}},
      {"generate --threads 0", {"--threads", "0"}},
      {"generate --threads 65", {"--threads", "65"}},
      {"generate --prompt '1 x'", {"--prompt '1 x'", "'x'"}},
      {"generate --prompt '1 512'", {"--prompt '1 512'", "token 512", "[0, 512)"}},
      {"generate --prompt ''", {"--prompt ''", "no token ids"}},
      {"generate --prompt '1 -5'", {"token -5"}},
      {"generate --prompt 1 --prompt-file " + bad, {"--prompt"}},
      {"generate --prompt-file " + bad, {"line 2", "'x7'"}},
      {"generate --prompt-file " + empty, {"holds no prompt"}},
      {"trace --out x --prompt 1 --prompt '1 2'", {"one sequence", "2 prompts"}},
      {"generate --compare-full", {"--compare-full needs --policy"}},
      {"generate --policy nonesuch", {"--policy", "nonesuch"}},
      {"generate --kv-dtype float8", {"--kv-dtype", "float8"}},
      // Text options need a GGUF model (its tokenizer).
      {"generate --chat --prompt hi", {"--chat", "GGUF", "no --model"}},
      {"generate --stop-at-eos", {"--stop-at-eos", "GGUF"}},
      {"generate --max-tokens 4", {"--max-tokens", "GGUF"}},
      {"generate --max-tokens 0", {"--max-tokens", "0"}},
      {"generate --prefill sideways", {"sideways"}},
      {"chat", {"--model"}},
      {"chat --steps 3 --model x.gguf", {"--steps"}},
  };
  for (const Bad& b : cases) {
    INFO("args: " << b.args);
    const CliResult r = run_cli(b.args);
    INFO("stderr: " << r.err);
    CHECK(r.code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.rfind("kvkit: error: ", 0) == 0);
    for (const std::string& n : b.needles) CHECK(r.err.find(n) != std::string::npos);
    CHECK(r.err.find("bad_alloc") == std::string::npos);
    CHECK(r.err.find("runtime error") == std::string::npos);  // UBSan's report
  }
  {
    const CliResult r = run_cli("generate --model /nonexistent/model.bin");
    CHECK(r.code == 1);
    CHECK(r.err.find("/nonexistent/model.bin") != std::string::npos);
  }
  {
    const CliResult r = run_cli("generate --prompt-file /nonexistent/prompts.txt");
    CHECK(r.code == 1);
    CHECK(r.err.find("/nonexistent/prompts.txt") != std::string::npos);
  }
}

TEST_CASE("kvkit CLI --json errors print an error object on stdout too", "[cli][json][errors]") {
  struct Case {
    std::string args, needle;
    int code;
  };
  for (const Case& c : {Case{"generate --json --page-size 1000000000", "1280000000000", 2},
                        Case{"generate --json --bogus", "--bogus", 2},
                        Case{"generate --json --steps 99999999999", "99999999999", 2},
                        Case{"generate --json --contiguous --page-size 4", "--contiguous", 2},
                        Case{"trace --json --steps 4", "--out", 2},
                        Case{"generate --json --model /nonexistent/model.bin", "/nonexistent/model.bin", 1}}) {
    INFO("args: " << c.args);
    const CliResult r = run_cli(c.args);
    CHECK(r.code == c.code);
    const Json j = Json::parse(r.out);
    CHECK(j.size() == 2);
    CHECK(j.at("code") == c.code);
    const std::string msg = j.at("error");
    CHECK(msg.find(c.needle) != std::string::npos);
    CHECK(r.err.find(msg) != std::string::npos);  // the same message on stderr
  }
}

TEST_CASE("kvkit generate --policy none --compare-full: the comparison of equal runs is exact",
          "[cli][policy]") {
  // Both engines run the same arithmetic, so every compared step agrees with KL 0; the
  // tokens are the full run's (teacher-forced into the policy run), i.e. plain greedy.
  const Json j = run_json("generate --steps 40 --prompt '1 5 9' --prompt '1 7' --policy none --compare-full --json");
  CHECK(j.at("policy") == "none");
  CHECK(j.at("compare_full") == true);
  CHECK(j.at("top1_agreement") == 1.0);
  CHECK(j.at("mean_kl") == 0.0);
  CHECK(j.at("max_kl") == 0.0);
  CHECK(j.at("compare_steps") == (40 - 3 + 1) + (40 - 2 + 1));  // steps predicting a generated token
  CHECK(j.at("full_kv_bytes_final") == j.at("kv_bytes_final"));
  CHECK(all_tokens(j) == run_engine(synthetic(), EngineOptions{}, {{1, 5, 9}, {1, 7}}, 40));
  const Json plain = run_json("generate --steps 40 --prompt '1 5 9' --prompt '1 7' --policy none --json");
  CHECK(plain.at("compare_full") == false);
  CHECK(!plain.contains("top1_agreement"));
  CHECK(all_tokens(plain) == all_tokens(j));
}

TEST_CASE("kvkit CLI --version and --help exit 0", "[cli][help]") {
  {
    const CliResult r = run_cli("--version");
    CHECK(r.code == 0);
    CHECK(r.out == std::string("kvkit ") + KVKIT_VERSION + "\n");
  }
  struct Help {
    std::string args;
    std::vector<std::string> needles;
  };
  for (const Help& h : {Help{"--help", {"generate", "trace", "--version", "Exit codes"}},
                        Help{"-h", {"generate", "trace"}},
                        Help{"frobnicate --help", {"generate", "trace"}},
                        Help{"generate --help", {"--batch", "--prompt-file", "--num-pages", "--threads",
                                                 "--contiguous", "one prompt per line"}},
                        Help{"generate --steps 3 --help", {"--batch"}},
                        Help{"trace --help", {"--out", "--prompt"}},
                        Help{"generate --help", {"--chat", "--system", "--max-tokens", "--stop-at-eos", "GGUF"}},
                        Help{"chat --help", {"--model", "--system", "--max-tokens", "stdin"}}}) {
    INFO("args: " << h.args);
    const CliResult r = run_cli(h.args);
    CHECK(r.code == 0);
    CHECK(r.err.empty());
    CHECK(r.out.find("Usage: kvkit") != std::string::npos);
    for (const std::string& n : h.needles) CHECK(r.out.find(n) != std::string::npos);
  }
}

// checkpoint.hpp says greedy decoding of the synthetic model wanders over the vocabulary
// with runs of one repeated token; this keeps that comment true.
TEST_CASE("kvkit CLI synthetic model output wanders with repeated runs", "[cli][synthetic]") {
  const Json j = run_json("generate --json --steps 256");
  const Tokens t = tokens_of(j.at("sequences")[0]);
  std::size_t longest = 0;
  for (std::size_t i = 0, run = 0; i < t.size(); ++i) {
    run = i > 0 && t[i] == t[i - 1] ? run + 1 : 1;
    longest = std::max(longest, run);
  }
  CHECK(std::set<std::int32_t>(t.begin(), t.end()).size() >= 40);
  CHECK(longest >= 8);
}

TEST_CASE("kvkit CLI trace writes K/V/Q, tokens and logits as npy", "[cli][trace]") {
  TempDir tmp("trace");
  const int N = 12;
  const Tokens prompt = {1, 40, 41};
  const Json j = run_json("trace --json --steps 12 --page-size 5 --prompt '1 40 41' --out '" + tmp.file("t") + "'");
  CHECK(j.at("files").size() == 5 * 3 + 2);
  CHECK(j.at("prompt") == prompt);
  CHECK(j.at("page_size") == 5);
  const auto ck = synthetic();
  const ModelConfig& c = ck->config();
  EngineOptions o;
  o.page_size = 5;
  o.max_batch = 1;
  Engine eng(ck, o);
  const SeqId id = eng.add_sequence(prompt);
  std::vector<std::vector<float>> q(static_cast<std::size_t>(c.n_layers));
  eng.add_step_hook([&](Engine&, const StepInfo& info) {
    for (int l = 0; l < c.n_layers; ++l) q[l].insert(q[l].end(), info.queries[l], info.queries[l] + c.dim);
  });
  for (int s = 0; s < N; ++s) eng.step();
  CHECK(j.at("tokens").get<Tokens>() == eng.tokens(id));

  const NpyArray tokens = read_npy(tmp.file("t/tokens.npy"));
  CHECK(tokens.shape == std::vector<std::int64_t>{N});
  const auto tv = tokens.as<std::int64_t>();
  for (int t = 0; t < N; ++t) CHECK(tv[t] == eng.tokens(id)[t]);
  const NpyArray logits = read_npy(tmp.file("t/logits.npy"));
  CHECK(logits.shape == std::vector<std::int64_t>{N, c.vocab_size});
  const auto lv = logits.as<float>();
  for (int t = static_cast<int>(prompt.size()) - 1; t < N; ++t) {  // greedy after the prompt
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

// ---------------------------------------------------------------------------------------
// GGUF models: text prompts, ChatML, multi-turn chat (SmolLM2-135M-Instruct when present)

namespace {

std::string quoted(const std::string& s) { return "'" + s + "'"; }

}  // namespace

TEST_CASE("kvkit generate with a GGUF model: text in, chat answer out, JSON fields", "[cli][gguf][smollm2]") {
  if (!fs::exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath << " (run scripts/fetch-model.sh)");
    return;
  }
  const std::string model = "--model " + quoted(kSmolPath);
  const std::string question = "What is the capital of Germany?";
  const GgufFile g = GgufFile::open(kSmolPath);
  const Tokenizer tok = Tokenizer::from_gguf(g);
  const ChatTemplate tmpl = ChatTemplate::from_gguf(g);
  const std::int32_t im_end = tok.find_token("<|im_end|>");
  REQUIRE(im_end >= 0);
  {
    const CliResult r = run_cli("generate " + model + " --chat --prompt " + quoted(question) +
                                " --max-tokens 32 --stop-at-eos");
    INFO("stderr: " << r.err);
    REQUIRE(r.code == 0);
    CHECK(r.out.find("Berlin") != std::string::npos);
    CHECK(r.out.find("<|im_end|>") == std::string::npos);
    CHECK(r.err.find("tokens/s") != std::string::npos);
  }
  for (const std::string mode : {"batch", "tokens"}) {
    INFO("--prefill " << mode);
    const Json j = run_json("generate --json " + model + " --chat --prompt " + quoted(question) +
                            " --max-tokens 32 --stop-at-eos --prefill " + mode);
    const Tokens prompt = tmpl.encode(tok, {{"user", question}}, true);
    CHECK(j.at("prompt_tokens").get<Tokens>() == prompt);
    const Tokens gen = j.at("tokens").get<Tokens>();
    REQUIRE_FALSE(gen.empty());
    CHECK(j.at("text") == tok.decode(gen, false));
    // Both modes run the prompt on the quantized products (as llama.cpp does). (On "What is
    // the capital of France?" this file answers "L'Étoile..." then, llama.cpp's answer too.)
    CHECK(j.at("text").get<std::string>().find("Berlin") != std::string::npos);
    CHECK(j.at("stop") == "eos");
    // The sequence holds prompt + answer (+ the pending <|im_end|> after an end of turn).
    Tokens all = prompt;
    all.insert(all.end(), gen.begin(), gen.end());
    const Tokens seq = tokens_of(j.at("sequences")[0]);
    if (j.at("stop") == "eos") all.push_back(im_end);
    else CHECK(gen.size() == 32);
    REQUIRE(seq.size() >= all.size());
    CHECK(Tokens(seq.begin(), seq.begin() + static_cast<std::ptrdiff_t>(all.size())) == all);
    CHECK(j.at("tokens_per_s").get<double>() > 0);
    CHECK(j.at("prefill_tokens_per_s").get<double>() > 0);
    CHECK(j.at("prefill") == mode);
    for (const char* key : {"command", "version", "model", "synthetic", "steps", "batch", "page_size",
                            "num_pages", "threads", "layout", "table", "contiguous", "kv_bytes_peak",
                            "kv_bytes_final", "pages_in_use"})
      CHECK(j.contains(key));
    CHECK(j.at("model") == kSmolPath);
    CHECK(j.at("synthetic") == false);
  }
  for (const char* d : {"float16", "bfloat16"}) {
    // 16-bit K/V pages (half the bytes): the same answer on this question.
    INFO("--kv-dtype " << d);
    const Json j = run_json("generate --json " + model + " --chat --prompt " + quoted(question) +
                            " --max-tokens 32 --stop-at-eos --kv-dtype " + d);
    CHECK(j.at("kv_dtype") == d);
    CHECK(j.at("text").get<std::string>().find("Berlin") != std::string::npos);
  }
  {
    // Plain text (no template), cut by --max-tokens, with a system message refused.
    const std::string text = "The capital of France is";
    const Json j = run_json("generate --json " + model + " --prompt " + quoted(text) + " --max-tokens 5");
    CHECK(j.at("prompt_tokens").get<Tokens>() == tok.encode(text));
    CHECK(j.at("tokens").size() == 5);
    CHECK(j.at("stop") == "max_tokens");
    CHECK(j.at("chat") == false);
  }
  {
    const Json j = run_json("generate --json " + model + " --chat --system " + quoted("Answer in French.") +
                            " --prompt " + quoted(question) + " --max-tokens 3 --threads 2 --page-size 4");
    CHECK(j.at("prompt_tokens").get<Tokens>() ==
          tmpl.encode(tok, {{"system", "Answer in French."}, {"user", question}}, true));
    CHECK(j.at("threads") == 2);
    CHECK(j.at("page_size") == 4);
  }
  struct Bad {
    std::string args, needle;
  };
  for (const Bad& b : {Bad{"--steps 4 --prompt hi", "--max-tokens"},
                       Bad{"--prompt hi --prompt ho", "one prompt"},
                       Bad{"--batch 2 --prompt hi", "--batch 1"},
                       Bad{"--system x --prompt hi", "--system needs --chat"},
                       Bad{"", "needs --prompt"}}) {
    INFO("args: " << b.args);
    const CliResult r = run_cli("generate " + model + " " + b.args);
    CHECK(r.code == 2);
    CHECK(r.err.find(b.needle) != std::string::npos);
  }
}

TEST_CASE("kvkit chat --policy r1kv bounds the conversation's KV across turns", "[cli][gguf][chat][smollm2][r1kv]") {
  if (!fs::exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath << " (run scripts/fetch-model.sh)");
    return;
  }
  TempDir tmp("chat_policy");
  const std::string in = tmp.file("in.txt");
  std::ofstream(in) << "My name is Ada. Write two sentences about the sea.\nNow two sentences about mountains.\n"
                       "What is my name?\n";
  const std::string base = "chat --json --model " + quoted(kSmolPath) + " --max-tokens 40 ";
  const Json full = run_json(base + "< " + quoted(in));
  const Json j = run_json(base + "--policy r1kv+eps --budget 64 --buffer 16 --strict < " + quoted(in));
  REQUIRE(j.at("turns").size() == 3);
  CHECK(j.at("policy") == "r1kv+eps");
  CHECK(j.at("compressions").get<int>() >= 2);
  CHECK(j.at("certified_omitted_max").get<double>() <= 1e-3 * (1 + 1e-9));
  // The sequence never caches more than budget + buffer tokens, whatever the turns add
  // (the full run's last turn holds every token), and its pages are fewer.
  for (const Json& t : j.at("turns")) CHECK(t.at("kv_len").get<int>() <= 64 + 16);
  CHECK(full.at("turns").back().at("kv_len").get<int>() > 64 + 16);
  CHECK(j.at("pages_in_use").get<int>() < full.at("pages_in_use").get<int>());
  // Turn 1 (its prompt alone is below the budget) answers as without the policy.
  CHECK(j.at("turns")[0].at("text") == full.at("turns")[0].at("text"));
  const CliResult bad = run_cli("chat --model " + quoted(kSmolPath) + " --policy eps+kvchan < /dev/null");
  CHECK(bad.code == 2);
  CHECK(bad.err.find("both replace the attention call") != std::string::npos);
}

TEST_CASE("kvkit chat keeps the conversation's KV between turns", "[cli][gguf][chat][smollm2]") {
  if (!fs::exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath << " (run scripts/fetch-model.sh)");
    return;
  }
  TempDir tmp("chat");
  const std::string in = tmp.file("in.txt");
  std::ofstream(in) << "What is the capital of Germany?\n\nAnd what is the capital of Japan?\n";
  const std::string args = "chat --model " + quoted(kSmolPath) + " --max-tokens 48 < " + quoted(in);
  const Json j = run_json("chat --json --model " + quoted(kSmolPath) + " --max-tokens 48 < " + quoted(in));
  const Json& turns = j.at("turns");
  REQUIRE(turns.size() == 2);  // the blank line is not a turn
  const Json &t1 = turns[0], &t2 = turns[1];
  CHECK(t1.at("text").get<std::string>().find("Berlin") != std::string::npos);
  CHECK(t2.at("text").get<std::string>().find("Tokyo") != std::string::npos);
  CHECK(t1.at("reused_tokens") == 0);
  CHECK(t1.at("stop") == "eos");
  // Turn 2 reuses every cached token of turn 1 and processes only its own: the pending
  // <|im_end|> of turn 1 and the new user turn with the assistant prompt.
  CHECK(t2.at("reused_tokens") == t1.at("kv_len"));
  CHECK(t1.at("kv_len").get<int>() ==
        static_cast<int>(t1.at("prompt_tokens").size() + t1.at("tokens").size()));
  CHECK(t2.at("processed_prompt_tokens").get<std::size_t>() == t2.at("prompt_tokens").size() + 1);
  CHECK(t2.at("kv_len").get<int>() == t1.at("kv_len").get<int>() + 1 +
                                          static_cast<int>(t2.at("prompt_tokens").size() + t2.at("tokens").size()));
  // Turn 2's tokens are what the chat template renders for the whole conversation, and
  // the whole transcript as one fresh prompt (generate, nothing cached) gives the same
  // second answer.
  const GgufFile g = GgufFile::open(kSmolPath);
  const Tokenizer tok = Tokenizer::from_gguf(g);
  const ChatTemplate tmpl = ChatTemplate::from_gguf(g);
  const std::vector<ChatMessage> conversation = {{"user", "What is the capital of Germany?"},
                                                 {"assistant", t1.at("text").get<std::string>()},
                                                 {"user", "And what is the capital of Japan?"}};
  Tokens transcript = t1.at("prompt_tokens").get<Tokens>();
  for (std::int32_t t : tok.encode(t1.at("text").get<std::string>(), false)) transcript.push_back(t);
  transcript.push_back(tok.find_token("<|im_end|>"));
  for (std::int32_t t : t2.at("prompt_tokens").get<Tokens>()) transcript.push_back(t);
  CHECK(transcript == tmpl.encode(tok, conversation, true));
  {
    std::ofstream(tmp.file("transcript.txt"), std::ios::binary) << tmpl.render(conversation, true);
    const Json fresh = run_json("generate --json --model " + quoted(kSmolPath) + " --prompt-file " +
                                quoted(tmp.file("transcript.txt")) + " --max-tokens 48 --stop-at-eos");
    CHECK(fresh.at("text") == t2.at("text"));
  }
  {
    const CliResult r = run_cli(args);
    INFO("stderr: " << r.err);
    REQUIRE(r.code == 0);
    CHECK(r.out.find("Berlin") != std::string::npos);
    CHECK(r.out.find("Tokyo") != std::string::npos);
    CHECK(r.err.find("turn 2") != std::string::npos);
    CHECK(r.err.find("reused from the cache") != std::string::npos);
  }
  {
    const CliResult r = run_cli("chat --model " + quoted(kModelPath.empty() ? "x" : kModelPath) + " < /dev/null");
    if (fs::exists(kModelPath)) {
      CHECK(r.code == 2);
      CHECK(r.err.find("not a GGUF file") != std::string::npos);
    }
  }
}
