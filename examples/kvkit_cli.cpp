// kvkit: command-line front end of the example engine (arguments by CLI11, JSON by
// nlohmann/json; the library headers stay dependency-free).
//
//   kvkit generate [engine options] [--batch B] [--table csr|block] [--contiguous] [--json]
//   kvkit generate --model M.gguf --prompt "text" [--chat] [--system S] [--max-tokens N]
//                  [--stop-at-eos] [--prefill batch|tokens] [--json]
//   kvkit generate ... --policy NAME [policy options] [--compare-full]
//   kvkit chat     --model M.gguf [--system S] [--max-tokens N] [--json]   (turns on stdin)
//   kvkit trace    [engine options] --out DIR [--json]
//   kvkit r1kv     --keys K.npy --queries Q.npy --values V.npy --budget B ... --out KEPT.npy
//                  (one R1KV compression from .npy files; see cli/cmd_r1kv.hpp)
//   kvkit --version | --help;  kvkit <command> --help
//
// Without --model a deterministic synthetic checkpoint of the stories260K shape is used. A
// GGUF model (file starting with "GGUF") brings its tokenizer: --prompt is then text.
// Exit codes: 0 ok, 1 a library or I/O error (bad checkpoint, unreadable file), 2 a usage
// error (unknown option, bad value, a KV pool the machine cannot hold). With --json exactly
// one JSON object goes to stdout, also on error: {"error": "...", "code": <exit code>}.

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/cmd_probe.hpp"
#include "cli/parse_subcommand.hpp"
#include "cli/policies.hpp"
#include "cli/cmd_r1kv.hpp"
#include "cli/cmd_chat_demo.hpp"  // kvkit chat-demo
#include "engine/checkpoint.hpp"
#include "engine/composite_policy.hpp"
#include "engine/engine.hpp"
#include "engine/fidelity.hpp"
#include "engine/gguf.hpp"
#include "engine/gguf_checkpoint.hpp"
#include "engine/npy.hpp"
#include "engine/tokenizer.hpp"
#include "kvkit/version.hpp"
#include "cli/cmd_store_demo.hpp"  // kvkit store-demo
#include "cli/cmd_sweep.hpp"  // kvkit sweep

namespace {

using kvkit::engine::Checkpoint;
using kvkit::engine::Engine;
using kvkit::engine::EngineOptions;
using kvkit::engine::EnginePolicy;
using kvkit::engine::FidelityMeter;
using Json = nlohmann::json;

constexpr std::int32_t kMaxBatch = 4096;
constexpr std::int32_t kMaxThreads = 64;  // kvkit::kMaxHostThreads

const char* kFooter =
    "GGUF models (SmolLM2, scripts/fetch-model.sh): --prompt is text, tokenized with the file's\n"
    "  tokenizer (--prompt-file: the whole file is the prompt); --chat wraps it in the file's\n"
    "  ChatML template (default system message, or --system) with the assistant turn opened.\n"
    "  Generates --max-tokens tokens (default 128; --stop-at-eos ends at <|im_end|> / EOS) and\n"
    "  prints the text; the prompt is prefilled in batched passes (--prefill tokens: one step per\n"
    "  token). --json adds prompt_tokens, tokens, text, tokens_per_s (decode) and\n"
    "  prefill_tokens_per_s. `kvkit chat --model M.gguf` reads one user turn per stdin line.\n"
    "llama2.c models (.bin) and the synthetic model: --prompt \"1 2 3\" gives token ids\n"
    "  (whitespace or commas between them; include 1 = BOS yourself); repeat --prompt for\n"
    "  several prompts. --prompt-file F holds one prompt per line in the same format (blank\n"
    "  lines and lines starting with # are skipped).\n"
    "  Sequence b of the batch decodes prompt b mod (number of prompts): fewer prompts than\n"
    "  --batch cycle, more are cut. --batch defaults to the number of prompts. Without a\n"
    "  prompt every sequence starts from BOS. --steps counts positions processed per sequence,\n"
    "  prompt tokens included (they are teacher-forced, then decoding is greedy).\n"
    "Exit codes: 0 ok, 1 library or I/O error (bad checkpoint, unreadable file), 2 usage error\n"
    "  (unknown option, bad value, a KV pool larger than this machine's memory). With --json\n"
    "  errors also print {\"error\": \"...\", \"code\": N} on stdout.\n"
    "Also: kvkit r1kv --help (one R1KV compression of .npy K/Q/V), kvkit sweep --help (many\n"
    "  policy x budget runs against one full-cache run), kvkit chat-demo --help\n"
    "  (multi-turn conversation caching under a page budget).";

/// A command-line mistake: "kvkit: error: ..." on stderr, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// An unreadable input file named on the command line: exit code 1, like a bad checkpoint.
struct IoError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string command;
  std::string model;
  std::string out;
  std::string prompt_file;
  std::vector<std::string> prompt_texts;  // one per --prompt
  std::int32_t steps = 64;
  std::int32_t page_size = 16;
  std::int32_t batch = 1;
  std::int32_t num_pages = 0;  // 0: the engine's default (batch * pages per sequence)
  std::int32_t threads = 1;
  std::string layout = "nhd";
  std::string table = "csr";
  std::string kv_dtype = "float32";  // element type of the K/V pages
  bool contiguous = false;
  bool json = false;
  bool page_size_given = false;
  bool batch_given = false;
  bool num_pages_given = false;
  // GGUF text generation and chat.
  std::string system;
  std::string prefill = "batch";
  std::string matvec = "quantized";  // GGUF projections: quantized (int8 activations) or float
  std::int32_t max_tokens = 128;
  bool chat = false;
  bool stop_at_eos = false;
  bool system_given = false;
  bool max_tokens_given = false;
  bool steps_given = false;
  kvkit::cli::ProbeOptions probe;  // `kvkit probe` (cli/cmd_probe.hpp)
  // --policy (examples/cli/policies.hpp) and --compare-full.
  std::string policy;
  bool compare_full = false;
  std::shared_ptr<std::vector<kvkit::cli::PolicyEntry>> policies;  // owns the policies' option storage
  kvkit::cli::StoreDemoOptions store_demo;  // kvkit store-demo
};

// --policy NAME or NAME+NAME+...: the policies hosted together in one engine.
std::vector<std::string> split_policy(const std::string& s) {
  std::vector<std::string> parts;
  std::string::size_type from = 0;
  for (;;) {
    const std::string::size_type plus = s.find('+', from);
    parts.push_back(s.substr(from, plus == std::string::npos ? std::string::npos : plus - from));
    if (plus == std::string::npos) return parts;
    from = plus + 1;
  }
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string o;
  for (std::size_t i = 0; i < v.size(); ++i) o += (i ? sep : "") + v[i];
  return o;
}

// Validator: an integer in [lo, hi], message naming the value (CLI11 prefixes the option).
CLI::Validator int_in(std::int64_t lo, std::int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        std::size_t i = 0;
        if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
        const bool digits = i < s.size();
        for (; i < s.size(); ++i)
          if (s[i] < '0' || s[i] > '9') return "'" + s + "' is not an integer";
        if (!digits) return "'" + s + "' is not an integer";
        long long v = 0;
        try {
          v = std::stoll(s);
        } catch (const std::out_of_range&) {
          return "value " + s + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
        }
        if (v < lo || v > hi)
          return "value " + s + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
        return "";
      },
      "");  // the range is in each option's help text
}

// Options of GGUF text generation, shared by generate and chat.
void add_text_options(CLI::App& cmd, Options& o, bool chat) {
  cmd.add_option("--system", o.system, "system message (default: the chat template's)")
      ->type_name("TEXT");
  cmd.add_option("--max-tokens", o.max_tokens,
                 std::string("tokens generated at most") + (chat ? " per turn" : "") + " (default 128)")
      ->type_name("N")
      ->check(int_in(1, std::numeric_limits<std::int32_t>::max()));
  cmd.add_option("--prefill", o.prefill, "prompt processing: batch (batched passes) or tokens (one step per token)")
      ->type_name("MODE")
      ->check(CLI::IsMember({"batch", "tokens"}));
}

// Options shared by generate, trace and (without --steps and the prompts) chat.
void add_engine_options(CLI::App& cmd, Options& o, bool prompts = true) {
  CLI::Option* model =
      cmd.add_option("--model", o.model,
                     prompts ? "GGUF model or llama2.c checkpoint (default: a deterministic synthetic model)"
                             : "GGUF model (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)")
          ->type_name("PATH")
          ->check([](const std::string& s) { return s.empty() ? std::string("needs a non-empty path") : ""; });
  if (!prompts) model->required();
  const std::int64_t int_max = std::numeric_limits<std::int32_t>::max();
  if (prompts)
    cmd.add_option("--steps", o.steps, "positions processed per sequence, prompt included (default 64, at most the model's seq_len; not with a GGUF model)")
        ->type_name("N")
        ->check(int_in(1, int_max));
  cmd.add_option("--page-size", o.page_size, "tokens per KV page (default 16); the pool must fit in memory")
      ->type_name("P")
      ->check(int_in(1, int_max));
  cmd.add_option("--num-pages", o.num_pages, "pages in the KV pool (default: batch x ceil(seq_len / page size))")
      ->type_name("N")
      ->check(int_in(1, int_max));
  cmd.add_option("--threads", o.threads, "threads of the projections, the KV kernels and batched prefill (a thread pool), 1 to " + std::to_string(kMaxThreads) + " (default 1)")
      ->type_name("T")
      ->check(int_in(1, kMaxThreads));
  cmd.add_option("--layout", o.layout, "page layout: nhd or hnd (default nhd)")
      ->type_name("L")
      ->check(CLI::IsMember({"nhd", "hnd"}));
  cmd.add_option("--matvec", o.matvec,
                 "GGUF projections: quantized (the file's blocks against int8 activations, as llama.cpp; "
                 "default) or float (weights dequantized at load, float32 activations: no activation "
                 "rounding, so --compare-full measures only the policy; about 5x the weight memory)")
      ->type_name("MODE")
      ->check(CLI::IsMember({"quantized", "float"}));
  cmd.add_flag("--json", o.json, "print exactly one JSON object on stdout");
  if (!prompts) return;
  cmd.add_option("--prompt", o.prompt_texts, "prompt: text with a GGUF model, else token ids, e.g. \"1 2 3\" (repeatable; see below)")
      ->type_name("TEXT|IDS")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd.add_option("--prompt-file", o.prompt_file, "file with one prompt per line (GGUF: the whole file; see below)")
      ->type_name("FILE")
      ->excludes("--prompt");
  cmd.footer(kFooter);
}

// --kv-dtype on generate and chat: the pages' element type (EngineOptions::kv_dtype).
void add_kv_dtype_option(CLI::App& cmd, Options& o) {
  cmd.add_option("--kv-dtype", o.kv_dtype,
                 "element type of the K/V pages: float32 (default), float16 or bfloat16 (half the KV "
                 "bytes; write_kv rounds each new row to nearest even, attention reads it widened "
                 "exactly); with 16-bit pages --policy takes r1kv, snapkv, streaming or none (the others read "
                 "float32 pages)")
      ->type_name("T")
      ->check(CLI::IsMember({"float32", "float16", "bfloat16"}));
}

kvkit::DType parse_kv_dtype(const std::string& s) {
  kvkit::DType d = kvkit::DType::kFloat32;
  if (!kvkit::dtype_from_string(s.c_str(), &d))
    throw UsageError("unsupported --kv-dtype " + s + " (float32, float16 or bfloat16)");
  return d;
}

// Parses argv into `o`. Help and --version print and return false (exit 0); mistakes
// throw UsageError.
bool parse_args(int argc, char** argv, Options& o) {
  CLI::App app("kvkit: decode with the kvkit example paged engine", "kvkit");
  app.set_version_flag("--version", std::string("kvkit ") + KVKIT_VERSION);
  app.require_subcommand(1);
  app.footer(kFooter);
  CLI::App* gen = app.add_subcommand("generate", "greedy decoding of a batch of prompts through the paged engine");
  add_engine_options(*gen, o);
  add_kv_dtype_option(*gen, o);
  gen->add_option("--batch", o.batch, "sequences decoded together, 1 to 4096 (default: the number of prompts, else 1)")
      ->type_name("B")
      ->check(int_in(1, kMaxBatch));
  gen->add_option("--table", o.table, "page-table encoding: csr or block (default csr)")
      ->type_name("T")
      ->check(CLI::IsMember({"csr", "block"}));
  gen->add_flag("--contiguous", o.contiguous,
                "one seq_len-token page per sequence (the contiguous-cache baseline); excludes --page-size")
      ->excludes("--page-size");
  gen->add_flag("--chat", o.chat, "GGUF: wrap --prompt in the ChatML template as a user turn");
  gen->add_flag("--stop-at-eos", o.stop_at_eos, "GGUF: stop at the end-of-turn token (<|im_end|>, EOS)");
  add_text_options(*gen, o, false);
  o.policies = std::make_shared<std::vector<kvkit::cli::PolicyEntry>>(kvkit::cli::all_policies());
  std::vector<std::string> policy_names;
  for (const kvkit::cli::PolicyEntry& e : *o.policies)
    policy_names.insert(policy_names.end(), e.names.begin(), e.names.end());
  // --policy and every family's options, on generate and on chat (one storage: only one
  // subcommand is parsed per run).
  auto add_policy_options = [&](CLI::App& cmd) {
    for (const kvkit::cli::PolicyEntry& e : *o.policies) e.add_options(cmd);
    cmd.add_option("--policy", o.policy,
                   "KV-cache policy hosted during the run: " + join(policy_names, ", ") +
                       ", or several joined by '+' in one engine (r1kv+eps: at most one that replaces attention, "
                       "one that moves tokens) (default: no policy; none hosts nothing, the full cache, to check "
                       "--compare-full); its options are listed here too")
        ->type_name("NAME[+NAME]")
        ->check([policy_names](const std::string& s) -> std::string {
          const std::vector<std::string> parts = split_policy(s);
          for (const std::string& part : parts) {
            if (std::find(policy_names.begin(), policy_names.end(), part) == policy_names.end())
              return "'" + part + "' is not a policy (" + join(policy_names, ", ") + ")";
            if (part == "none" && parts.size() > 1) return "none hosts nothing and cannot be combined with '" + s + "'";
          }
          return "";
        });
  };
  add_policy_options(*gen);
  gen->add_flag("--compare-full", o.compare_full,
                "also run the full cache in lockstep, its greedy tokens teacher-forced into the policy "
                "run, and report top1_agreement, mean_kl, median_kl, max_kl (nats) over the generated steps");
  CLI::App* chat = app.add_subcommand("chat", "interactive multi-turn chat with a GGUF model: one user turn per stdin line, the conversation's KV kept between turns");
  add_engine_options(*chat, o, false);
  add_kv_dtype_option(*chat, o);
  add_text_options(*chat, o, true);
  add_policy_options(*chat);
  CLI::App* probe = kvkit::cli::add_probe_command(app, o.probe);
  CLI::App* trace = app.add_subcommand("trace", "greedy decoding of one sequence; writes per-layer K/V/Q, tokens and logits as .npy");
  add_engine_options(*trace, o);
  trace->add_option("--out", o.out, "output folder (created if missing)")
      ->type_name("DIR")
      ->required()
      ->check([](const std::string& s) { return s.empty() ? std::string("needs a non-empty path") : ""; });
  CLI::App* store_demo = app.add_subcommand("store-demo", "BlockStore demo: a shared-prefix workload saved to a store, then loaded by a fresh engine");
  kvkit::cli::add_store_demo_options(*store_demo, o.store_demo);

  // Handled before CLI11 so `kvkit foo --help` prints help and a stray word names itself.
  const std::vector<std::string> args(argv + 1, argv + argc);
  bool help = false;
  for (const std::string& a : args) help = help || a == "--help" || a == "-h";
  if (args.empty()) throw UsageError("missing command (try kvkit --help)");
  // r1kv, sweep and chat-demo are dispatched by main() before this parser.
  static const std::vector<std::string> kCommands = {"generate", "chat", "trace", "probe",
                                                     "store-demo", "chat-demo", "r1kv", "sweep"};
  if (args[0].empty() ||
      (args[0][0] != '-' &&
       std::find(kCommands.begin(), kCommands.end(), args[0]) == kCommands.end())) {
    if (help) {
      std::cout << app.help();
      return false;
    }
    throw UsageError("unknown command '" + args[0] + "' (expected " + join(kCommands, ", ") + ")");
  }
  if (kvkit::cli::parse_subcommand(app, argc, argv, [](int, const std::string& m) -> int { throw UsageError(m); }) !=
      kvkit::cli::kParsed)
    return false;
  if (probe->parsed()) return o.command = "probe", true;
  if (store_demo->parsed()) return o.command = "store-demo", true;
  o.command = gen->parsed() ? "generate" : chat->parsed() ? "chat" : "trace";
  CLI::App* cmd = gen->parsed() ? gen : chat->parsed() ? chat : trace;
  o.page_size_given = cmd->count("--page-size") > 0;
  o.num_pages_given = cmd->count("--num-pages") > 0;
  o.batch_given = o.command == "generate" && gen->count("--batch") > 0;
  o.steps_given = o.command != "chat" && cmd->count("--steps") > 0;
  o.system_given = o.command != "trace" && cmd->count("--system") > 0;
  o.max_tokens_given = o.command != "trace" && cmd->count("--max-tokens") > 0;
  if (o.command == "chat") o.stop_at_eos = true;
  if (o.command == "generate" || o.command == "chat") {
    // A family's options without one of its policies would be silently ignored.
    const std::vector<std::string> parts = split_policy(o.policy);
    for (const kvkit::cli::PolicyEntry& e : *o.policies)
      for (const std::string& opt : e.option_names)
        if (cmd->count(opt) > 0 && std::none_of(e.names.begin(), e.names.end(), [&](const std::string& n) {
              return std::find(parts.begin(), parts.end(), n) != parts.end();
            }))
          throw UsageError(opt + " needs --policy " + join(e.names, "|"));
    if (o.command == "generate" && o.compare_full && o.policy.empty())
      throw UsageError("--compare-full needs --policy NAME");
  }
  return true;
}

// ---------------------------------------------------------------------------------------
// Prompts

struct Prompt {
  std::vector<std::int64_t> ids;     // as written
  std::vector<std::int32_t> tokens;  // ids once check_prompts range-checked them
  std::string where;  // "--prompt '1 2'" or "--prompt-file F line 3", for messages
};

// Token ids separated by whitespace or commas; range-checked later against the model.
std::vector<std::int64_t> parse_token_ids(const std::string& text, const std::string& where) {
  std::vector<std::int64_t> ids;
  std::string word;
  auto flush = [&]() {
    if (word.empty()) return;
    std::size_t used = 0;
    long long v = 0;
    bool ok = word.find_first_not_of("+-0123456789") == std::string::npos;
    try {
      if (ok) v = std::stoll(word, &used);
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok || used != word.size())
      throw UsageError(where + ": '" + word + "' is not a token id (an integer)");
    ids.push_back(v);
    word.clear();
  };
  for (char c : text) {
    if (c == ',' || std::isspace(static_cast<unsigned char>(c))) flush();
    else word += c;
  }
  flush();
  return ids;
}

std::vector<Prompt> read_prompts(const Options& o) {
  std::vector<std::pair<std::string, std::string>> texts;  // (text, where)
  for (const std::string& t : o.prompt_texts) texts.push_back({t, "--prompt '" + t + "'"});
  if (!o.prompt_file.empty()) {
    std::ifstream in(o.prompt_file);
    if (!in) throw IoError("cannot read prompt file '" + o.prompt_file + "'");
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      const std::size_t first = line.find_first_not_of(" \t\r");
      if (first == std::string::npos || line[first] == '#') continue;
      texts.push_back({line, "--prompt-file " + o.prompt_file + " line " + std::to_string(n)});
    }
    if (in.bad()) throw IoError("error reading prompt file '" + o.prompt_file + "'");
    if (texts.empty()) throw UsageError("--prompt-file " + o.prompt_file + " holds no prompt");
  }
  std::vector<Prompt> prompts;
  for (const auto& t : texts) {
    const auto ids = parse_token_ids(t.first, t.second);
    if (ids.empty()) throw UsageError(t.second + ": no token ids");
    prompts.push_back(Prompt{ids, {}, t.second});
  }
  return prompts;
}

// Range-checks every prompt against the model and fills Prompt::tokens.
void check_prompts(std::vector<Prompt>& prompts, const kvkit::engine::ModelConfig& c) {
  for (Prompt& p : prompts) {
    if (static_cast<std::int64_t>(p.ids.size()) > c.seq_len)
      throw UsageError(p.where + ": " + std::to_string(p.ids.size()) +
                       " tokens exceed the model's seq_len " + std::to_string(c.seq_len));
    for (std::int64_t t : p.ids) {
      if (t < 0 || t >= c.vocab_size)
        throw UsageError(p.where + ": token " + std::to_string(t) + " outside the vocabulary [0, " +
                         std::to_string(c.vocab_size) + ")");
      p.tokens.push_back(static_cast<std::int32_t>(t));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Model, pool size, engine

struct LoadedModel {
  std::shared_ptr<const Checkpoint> ckpt;
  std::string name;  // path, or "synthetic"
};

// True when `path` starts with the GGUF magic (a file that cannot be read is left to the
// llama2.c loader, whose error names it).
bool is_gguf(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::string(magic, 4) == "GGUF";
}

LoadedModel load_model(const Options& o) {
  if (o.model.empty()) {
    return {std::make_shared<const Checkpoint>(kvkit::engine::default_synthetic_checkpoint()),
            "synthetic"};
  }
  if (is_gguf(o.model))
    return {std::make_shared<const Checkpoint>(
                kvkit::engine::load_gguf_checkpoint(o.model, /*float_projections=*/o.matvec == "float")),
            o.model};
  return {std::make_shared<const Checkpoint>(kvkit::engine::load_checkpoint(o.model)), o.model};
}

std::string describe(const LoadedModel& m) {
  if (m.name == "synthetic") return "model: synthetic (no --model given)";
  const auto& c = m.ckpt->config();
  std::ostringstream os;
  os << "model: " << m.name << " (dim " << c.dim << ", hidden " << c.hidden_dim << ", layers "
     << c.n_layers << ", heads " << c.n_heads << ", kv heads " << c.n_kv_heads << ", vocab "
     << c.vocab_size << ", seq_len " << c.seq_len << ")";
  return os.str();
}

std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}

std::string human_bytes(std::uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 6) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
  return buf;
}

std::uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::uint64_t{1} << 40;  // unknown: assume 1 TiB
  return sat_mul(static_cast<std::uint64_t>(pages), static_cast<std::uint64_t>(page));
}

// The engine options for `o`, after checking in 64-bit arithmetic (before any Engine
// exists) that the K/V pools fit in this machine's memory and hold every sequence's
// steps: a pool that cannot be built is a usage error naming the values, not bad_alloc.
EngineOptions engine_options(const Options& o, const kvkit::engine::ModelConfig& c, std::int32_t batch) {
  const std::int64_t page = o.contiguous ? c.seq_len : o.page_size;
  const std::int64_t pages_per_seq = (c.seq_len + page - 1) / page;
  const std::int64_t num_pages = o.num_pages_given ? o.num_pages : batch * pages_per_seq;
  std::string given = o.contiguous ? "--contiguous (pages of seq_len " + std::to_string(c.seq_len) + ")"
                                   : "--page-size " + std::to_string(o.page_size);
  if (o.num_pages_given) given += " --num-pages " + std::to_string(o.num_pages);
  else if (batch > 1) given += " --batch " + std::to_string(batch);
  // K and V pools of every layer: num_pages x page tokens x kv heads x head_dim elements.
  const kvkit::DType dtype = parse_kv_dtype(o.kv_dtype);
  const std::uint64_t elem = static_cast<std::uint64_t>(kvkit::dtype_size(dtype));
  const std::uint64_t bytes =
      sat_mul(sat_mul(sat_mul(static_cast<std::uint64_t>(num_pages), static_cast<std::uint64_t>(page)),
                      static_cast<std::uint64_t>(c.kv_dim())),
              elem * 2 * static_cast<std::uint64_t>(c.n_layers));
  const std::uint64_t limit = physical_memory_bytes();
  if (bytes > limit) {
    const std::string need = bytes == std::numeric_limits<std::uint64_t>::max()
                                 ? "more than 2^64 bytes"
                                 : std::to_string(bytes) + " bytes (" + human_bytes(bytes) + ")";
    throw UsageError(given + ": the KV pool would need " + need + " = " + std::to_string(num_pages) +
                     " pages x " + std::to_string(page) + " tokens x " + std::to_string(c.kv_dim()) +
                     " elements x " + std::to_string(c.n_layers) + " layers x K,V x " +
                     std::to_string(elem) + " bytes, more than "
                     "this machine's " + human_bytes(limit) + " of memory");
  }
  // The engine counts tokens and pages in int32 (seq_len + page_size - 1 included).
  if (page > std::numeric_limits<std::int32_t>::max() - c.seq_len || num_pages > (1 << 30))
    throw UsageError(given + ": the pool of " + std::to_string(num_pages) + " pages of " +
                     std::to_string(page) + " tokens is too large for the engine's 32-bit counts");
  const std::int64_t need_pages = batch * ((std::int64_t{o.steps} + page - 1) / page);
  if (num_pages < need_pages)
    throw UsageError("--num-pages " + std::to_string(num_pages) + " is too small: " +
                     std::to_string(batch) + " sequence(s) x " + std::to_string(o.steps) +
                     " steps in pages of " + std::to_string(page) + " tokens need " +
                     std::to_string(need_pages) + " pages");
  EngineOptions e;
  e.page_size = o.page_size;
  e.layout = o.layout == "hnd" ? kvkit::KVLayout::kHND : kvkit::KVLayout::kNHD;
  e.table_kind = o.table == "block" ? kvkit::PageTableKind::kBlockTable : kvkit::PageTableKind::kCsr;
  e.max_batch = batch;
  e.num_pages = o.num_pages_given ? o.num_pages : 0;
  e.contiguous = o.contiguous;
  e.threads = o.threads;
  e.quantized_matvec = o.matvec != "float";
  e.kv_dtype = dtype;
  return e;
}

std::string strip_kvkit_prefix(const std::string& msg) {
  return msg.rfind("kvkit: ", 0) == 0 ? msg.substr(7) : msg;
}

// Builds the engine and adds one sequence per prompt. The options and prompts were checked
// above, so a kvkit::Error here is still a configuration problem: a usage error (exit 2).
// A policy attaches before the sequences exist (policy.hpp).
std::unique_ptr<Engine> make_engine(const LoadedModel& m, const EngineOptions& e,
                                    const std::vector<std::vector<std::int32_t>>& prompts,
                                    EnginePolicy* policy = nullptr) {
  try {
    auto eng = std::make_unique<Engine>(m.ckpt, e);
    if (policy) policy->attach(*eng);
    for (const auto& p : prompts) eng->add_sequence(p);
    return eng;
  } catch (const kvkit::Error& err) {
    throw UsageError(strip_kvkit_prefix(err.what()));
  } catch (const std::bad_alloc&) {
    throw UsageError("could not allocate the KV pool (page size " + std::to_string(e.page_size) +
                     ", batch " + std::to_string(e.max_batch) + "): not enough free memory");
  }
}

void check_steps(const Options& o, const LoadedModel& m) {
  const std::int32_t max = m.ckpt->config().seq_len;
  if (o.steps > max)
    throw UsageError("--steps " + std::to_string(o.steps) + " exceeds the model's seq_len " +
                     std::to_string(max));
}

// The policy's engine, built from --policy (nullptr without one); bad values are usage errors.
std::unique_ptr<EnginePolicy> make_policy(const Options& o, const kvkit::engine::ModelConfig& c,
                                          const EngineOptions& eo) {
  if (o.policy.empty()) return nullptr;
  std::vector<std::unique_ptr<EnginePolicy>> parts;
  for (const std::string& name : split_policy(o.policy)) {
    const auto e = std::find_if(o.policies->begin(), o.policies->end(), [&](const kvkit::cli::PolicyEntry& x) {
      return std::find(x.names.begin(), x.names.end(), name) != x.names.end();
    });
    if (e == o.policies->end()) throw UsageError("unknown --policy " + name);
    try {
      parts.push_back(e->make(name, c, eo));
    } catch (const kvkit::Error& err) {
      throw UsageError("--policy " + name + ": " + strip_kvkit_prefix(err.what()));
    }
    if (!parts.back()->supports_kv_dtype(eo.kv_dtype))
      throw UsageError("--policy " + name + " needs --kv-dtype float32 (it reads float32 pages); got --kv-dtype " +
                       o.kv_dtype);
  }
  if (parts.size() == 1) return std::move(parts[0]);
  try {
    return std::make_unique<kvkit::engine::CompositePolicy>(std::move(parts));
  } catch (const kvkit::Error& err) {
    throw UsageError("--policy " + o.policy + ": " + strip_kvkit_prefix(err.what()));
  }
}

// Steps the engine of a run and, with --compare-full, a full-cache engine in lockstep: the
// full engine steps first and its next token (greedy, or the prompt's) is forced into the
// policy engine, so both see the same tokens; steps whose logits predict a token past the
// prompt are compared (fidelity.hpp). Sequences pair up in the engines' id order.
struct Lockstep {
  Engine* eng = nullptr;                 // the run (with the policy, if any)
  Engine* full = nullptr;                // the full-cache engine, or nullptr
  std::vector<std::size_t> prompt_len;   // per sequence (id order): steps before it are not compared
  FidelityMeter meter;
  double eng_seconds = 0;                // time in eng's steps alone

  void prefill(kvkit::engine::SeqId id) {
    eng->prefill(id);
    if (full) full->prefill(id);
  }
  void step() {
    if (!full) {
      eng->step();
      return;
    }
    full->step();
    const auto ids = full->sequences();
    const auto own = eng->sequences();
    std::vector<std::int32_t> forced;
    for (kvkit::engine::SeqId id : ids) forced.push_back(full->pending_token(id));
    const auto t0 = std::chrono::steady_clock::now();
    eng->forward_tokens(forced);
    eng_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::int32_t vocab = full->config().vocab_size;
    for (std::size_t i = 0; i < ids.size(); ++i)
      if (static_cast<std::size_t>(full->position(ids[i])) >= prompt_len.at(i))
        meter.add(full->last_logits(ids[i]).data(), eng->last_logits(own.at(i)).data(), vocab);
  }
  // Seconds per policy-engine step over `wall` seconds of lockstep running.
  double run_seconds(double wall) const { return full ? std::max(eng_seconds, 1e-9) : wall; }
};

Lockstep make_lockstep(Engine& eng, Engine* full) {
  Lockstep ls;
  ls.eng = &eng;
  ls.full = full;
  for (kvkit::engine::SeqId id : eng.sequences()) ls.prompt_len.push_back(eng.tokens(id).size());
  return ls;
}

// Adds the policy's name and counters to `j`.
void add_policy_stats(Json& j, const EnginePolicy* policy) {
  if (!policy) return;
  j["policy"] = policy->name();
  for (const auto& kv : policy->stats()) {
    KVKIT_CHECK(!j.contains(kv.first), "kvkit: policy ", policy->name(), " reports '", kv.first,
                "', a key the CLI already writes");
    const double v = kv.second;
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15) j[kv.first] = static_cast<std::int64_t>(v);
    else j[kv.first] = v;
  }
}

// Adds the policy's counters and, with --compare-full, the fidelity fields to `j`.
void add_policy_json(Json& j, const EnginePolicy* policy, const Lockstep& ls) {
  if (!policy) return;
  add_policy_stats(j, policy);
  j["compare_full"] = ls.full != nullptr;
  if (!ls.full) return;
  j["top1_agreement"] = ls.meter.top1_agreement();
  j["mean_kl"] = ls.meter.mean_kl();
  j["median_kl"] = ls.meter.median_kl();
  j["max_kl"] = ls.meter.max_kl();
  j["compare_steps"] = ls.meter.steps();
  j["full_kv_bytes_final"] = ls.full->kv_bytes_in_use();
}

// One line for humans: the policy's counters and the fidelity.
std::string policy_line(const EnginePolicy* policy, const Lockstep& ls) {
  if (!policy) return "";
  std::ostringstream os;
  os << "policy " << policy->name() << ":";
  const auto stats = policy->stats();
  for (std::size_t i = 0; i < stats.size(); ++i) os << (i ? "," : "") << " " << stats[i].first << " " << stats[i].second;
  if (ls.full)
    os << (stats.empty() ? "" : ";") << " vs the full cache over " << ls.meter.steps() << " steps: top-1 agreement "
       << ls.meter.top1_agreement() << ", mean KL " << ls.meter.mean_kl() << ", max KL " << ls.meter.max_kl()
       << " nats; KV bytes " << ls.eng->kv_bytes_in_use() << " vs " << ls.full->kv_bytes_in_use() << " full";
  return os.str();
}

// Runs `steps` steps, showing progress only when stderr is a terminal.
double run_steps(Lockstep& ls, std::int32_t steps) {
  const bool tty = isatty(STDERR_FILENO) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int32_t s = 0; s < steps; ++s) {
    ls.step();
    if (tty && ((s + 1) % 16 == 0 || s + 1 == steps))
      std::fprintf(stderr, "\rkvkit: step %d/%d", s + 1, steps);
  }
  if (tty) std::fprintf(stderr, "\n");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ls.run_seconds(secs > 0 ? secs : 1e-9);
}

std::string join_ints(const std::vector<std::int32_t>& v) {
  std::string o;
  for (std::size_t i = 0; i < v.size(); ++i) o += (i ? " " : "") + std::to_string(v[i]);
  return o;
}

// Invalid UTF-8 (a path, a user's value) is replaced rather than thrown on.
std::string dump(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

// ---------------------------------------------------------------------------------------
// Commands

int cmd_generate_gguf(const Options& o);

int cmd_generate(const Options& o) {
  if (!o.model.empty() && is_gguf(o.model)) return cmd_generate_gguf(o);
  if (o.chat || o.stop_at_eos || o.system_given || o.max_tokens_given)
    throw UsageError(std::string(o.chat ? "--chat" : o.stop_at_eos ? "--stop-at-eos" : o.system_given ? "--system" : "--max-tokens") +
                     " needs a GGUF model with a tokenizer (--model M.gguf); " +
                     (o.model.empty() ? "no --model was given" : o.model + " is not a GGUF file"));
  const LoadedModel m = load_model(o);
  const auto& c = m.ckpt->config();
  check_steps(o, m);
  std::vector<Prompt> prompts = read_prompts(o);
  check_prompts(prompts, c);
  const std::int32_t batch = o.batch_given || prompts.empty() ? o.batch
                                                              : static_cast<std::int32_t>(prompts.size());
  if (batch > kMaxBatch)
    throw UsageError(std::to_string(batch) + " prompts exceed the batch limit " + std::to_string(kMaxBatch) +
                     " (pass --batch to decode fewer)");
  std::vector<std::vector<std::int32_t>> seq_prompts;
  for (std::int32_t b = 0; b < batch; ++b)
    seq_prompts.push_back(prompts.empty() ? std::vector<std::int32_t>{kvkit::engine::kBosToken}
                                          : prompts[static_cast<std::size_t>(b) % prompts.size()].tokens);
  const EngineOptions eo = engine_options(o, c, batch);
  const auto policy = make_policy(o, c, eo);
  const auto eng = make_engine(m, eo, seq_prompts, policy.get());
  const auto full = o.compare_full ? make_engine(m, eo, seq_prompts) : nullptr;
  Lockstep ls = make_lockstep(*eng, full.get());
  const double secs = run_steps(ls, o.steps);
  const double tps = static_cast<double>(o.steps) * batch / secs;
  const auto ids = eng->sequences();
  const EngineOptions& eff = eng->options();
  if (o.json) {
    // The same fields at every batch size: per-sequence results live in `sequences`.
    Json seqs = Json::array();
    for (std::size_t b = 0; b < ids.size(); ++b)
      seqs.push_back({{"index", b}, {"prompt", seq_prompts[b]}, {"tokens", eng->tokens(ids[b])}});
    Json j = {{"command", "generate"},
                    {"version", KVKIT_VERSION},
                    {"model", m.name},
                    {"synthetic", m.name == "synthetic"},
                    {"steps", o.steps},
                    {"batch", batch},
                    {"page_size", eff.page_size},
                    {"num_pages", eff.num_pages},
                    {"threads", eff.threads},
                    {"layout", o.layout},
                    {"table", o.table},
                    {"kv_dtype", o.kv_dtype},
                    {"contiguous", o.contiguous},
                    {"sequences", seqs},
                    {"tokens_per_s", tps},
                    {"kv_bytes_peak", eng->kv_bytes_peak()},
                    {"kv_bytes_final", eng->kv_bytes_in_use()},
                    {"pages_in_use", eng->pages_in_use()}};
    add_policy_json(j, policy.get(), ls);
    std::cout << dump(j);
  } else {
    std::cout << describe(m) << "\n";
    for (std::size_t b = 0; b < ids.size(); ++b) {
      if (batch > 1) std::cout << "sequence " << b << ": ";
      std::cout << "tokens: " << join_ints(eng->tokens(ids[b])) << "\n";
    }
    std::cout << "steps " << o.steps << " x batch " << batch << ": " << tps << " tokens/s ("
              << eff.threads << " thread" << (eff.threads == 1 ? "" : "s") << ")\n"
              << "KV cache: " << eng->kv_bytes_in_use() << " bytes in use (peak "
              << eng->kv_bytes_peak() << "), " << eng->pages_in_use() << " of " << eff.num_pages
              << " pages of " << eff.page_size << " tokens, layout " << o.layout << ", " << o.kv_dtype
              << ", " << o.table << " page table\n";
    if (policy) std::cout << policy_line(policy.get(), ls) << "\n";
  }
  return 0;
}

int cmd_trace(const Options& o) {
  const LoadedModel m = load_model(o);
  check_steps(o, m);
  const auto& c = m.ckpt->config();
  std::vector<Prompt> prompts = read_prompts(o);
  check_prompts(prompts, c);
  if (prompts.size() > 1)
    throw UsageError("trace runs one sequence; got " + std::to_string(prompts.size()) + " prompts");
  const std::vector<std::int32_t> prompt =
      prompts.empty() ? std::vector<std::int32_t>{kvkit::engine::kBosToken} : prompts[0].tokens;
  const auto eng = make_engine(m, engine_options(o, c, 1), {prompt});
  const kvkit::engine::SeqId id = eng->sequences().at(0);
  const std::int64_t N = o.steps, hd = c.head_dim();
  std::vector<std::vector<float>> q(static_cast<std::size_t>(c.n_layers),
                                    std::vector<float>(static_cast<std::size_t>(c.n_heads * N * hd)));
  std::vector<float> logits(static_cast<std::size_t>(N * c.vocab_size));
  // Queries exist only during a step: collect them through the policy hook.
  eng->add_step_hook([&](Engine&, const kvkit::engine::StepInfo& info) {
    const std::int64_t t = info.step - 1;
    for (int l = 0; l < c.n_layers; ++l)
      for (std::int64_t h = 0; h < c.n_heads; ++h)
        for (std::int64_t d = 0; d < hd; ++d)
          q[static_cast<std::size_t>(l)][static_cast<std::size_t>((h * N + t) * hd + d)] =
              info.queries[l][h * hd + d];
    std::copy(info.logits, info.logits + c.vocab_size, logits.begin() + t * c.vocab_size);
  });
  Lockstep ls = make_lockstep(*eng, nullptr);
  run_steps(ls, o.steps);
  std::filesystem::create_directories(o.out);
  const std::filesystem::path dir(o.out);
  std::vector<std::string> files;
  auto path = [&](const std::string& name) {
    files.push_back(name);
    return (dir / name).string();
  };
  const auto& views = eng->layer_views();
  std::vector<float> k(static_cast<std::size_t>(c.n_kv_heads * N * hd)), v(k.size());
  for (int l = 0; l < c.n_layers; ++l) {
    for (std::int32_t h = 0; h < c.n_kv_heads; ++h)
      for (std::int32_t t = 0; t < N; ++t) {
        const std::size_t off = static_cast<std::size_t>((h * N + t) * hd);
        std::copy_n(views[static_cast<std::size_t>(l)].k_ptr(0, t, h), hd, k.begin() + off);
        std::copy_n(views[static_cast<std::size_t>(l)].v_ptr(0, t, h), hd, v.begin() + off);
      }
    const std::string L = std::to_string(l);
    kvkit::engine::write_npy(path("k_L" + L + ".npy"), k.data(), {c.n_kv_heads, N, hd});
    kvkit::engine::write_npy(path("v_L" + L + ".npy"), v.data(), {c.n_kv_heads, N, hd});
    kvkit::engine::write_npy(path("q_L" + L + ".npy"), q[static_cast<std::size_t>(l)].data(),
                             {c.n_heads, N, hd});
  }
  const auto& toks = eng->tokens(id);  // N processed inputs (+ the pending greedy token)
  std::vector<std::int64_t> inputs(toks.begin(), toks.begin() + N);
  kvkit::engine::write_npy(path("tokens.npy"), inputs.data(), {N});
  kvkit::engine::write_npy(path("logits.npy"), logits.data(), {N, c.vocab_size});
  if (o.json) {
    const Json j = {{"command", "trace"},      {"version", KVKIT_VERSION},
                    {"model", m.name},         {"synthetic", m.name == "synthetic"},
                    {"steps", o.steps},        {"positions", N},
                    {"page_size", eng->options().page_size},
                    {"out", o.out},            {"files", files},
                    {"prompt", prompt},        {"tokens", toks}};
    std::cout << dump(j);
  } else {
    std::cout << describe(m) << "\n"
              << "wrote " << files.size() << " files to " << o.out << " (" << N
              << " positions; k/v [" << c.n_kv_heads << ", " << N << ", " << hd << "], q ["
              << c.n_heads << ", " << N << ", " << hd << "], logits [" << N << ", "
              << c.vocab_size << "])\n"
              << "tokens: " << join_ints(toks) << "\n";
  }
  return 0;
}

// ---------------------------------------------------------------------------------------
// GGUF models: text in, text out

using kvkit::engine::ChatMessage;
using kvkit::engine::ChatTemplate;
using kvkit::engine::SeqId;
using kvkit::engine::Tokenizer;

struct TextModel {
  LoadedModel model;
  std::shared_ptr<const Tokenizer> tok;
  ChatTemplate tmpl;  // ChatML; no default system message when the file has no template
  std::int32_t end_of_turn = -1;  // <|im_end|> (or EOS): closes an assistant turn in chat
};

TextModel load_text_model(const std::string& path, bool float_projections) {
  const kvkit::engine::GgufFile g = kvkit::engine::GgufFile::open(path);
  TextModel t;
  t.model = {std::make_shared<const Checkpoint>(kvkit::engine::load_gguf_checkpoint(g, float_projections)), path};
  t.tok = std::make_shared<const Tokenizer>(Tokenizer::from_gguf(g));
  if (g.has("tokenizer.chat_template")) t.tmpl = ChatTemplate::from_gguf(g);
  t.end_of_turn = t.tok->find_token("<|im_end|>");
  if (t.end_of_turn < 0) t.end_of_turn = t.tok->eos_id();
  KVKIT_CHECK(t.tok->vocab_size() == t.model.ckpt->config().vocab_size, "kvkit: ", path, ": tokenizer of ",
              t.tok->vocab_size(), " tokens, model vocabulary of ", t.model.ckpt->config().vocab_size);
  return t;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One prompt-then-generate run of a sequence (a generate call or a chat turn).
struct TurnStats {
  std::int32_t reused = 0;          // tokens whose K/V were cached before the turn
  std::int32_t prompt = 0;          // prompt tokens processed in this turn
  std::vector<std::int32_t> generated;  // generated tokens, the stop token excluded
  std::string stop;                 // "eos", "max_tokens" or "seq_len"
  double prefill_s = 0;             // until the first generated token (prompt + its step)
  double decode_s = 0;              // the steps after it
  std::int32_t decode_steps = 0;
  double prefill_tps() const { return prefill_s > 0 ? prompt / prefill_s : 0; }
  double decode_tps() const { return decode_s > 0 ? decode_steps / decode_s : 0; }
};

// Processes the pending prompt of sequence `id` (batched, or one step per token) and
// generates up to max_tokens tokens, calling on_token for each kept one. Leaves the stop
// token pending.
template <class OnToken>
TurnStats run_turn(Lockstep& ls, SeqId id, bool batched, std::int32_t max_tokens,
                   bool stop_at_eos, const Tokenizer& tok, OnToken on_token) {
  Engine& eng = *ls.eng;
  TurnStats t;
  t.reused = eng.kv_len(id);
  const std::size_t prompt_end = eng.tokens(id).size();
  t.prompt = static_cast<std::int32_t>(prompt_end) - eng.position(id);
  const std::int32_t seq_len = eng.config().seq_len;
  auto t0 = std::chrono::steady_clock::now();
  if (batched) ls.prefill(id);
  while (eng.tokens(id).size() == prompt_end) {  // the rest of the prompt, then its first token
    if (eng.position(id) >= seq_len) {
      t.stop = "seq_len";
      t.prefill_s = seconds_since(t0);
      return t;
    }
    ls.step();
  }
  t.prefill_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  const double eng_before = ls.eng_seconds;
  for (;;) {
    const std::int32_t next = eng.tokens(id).back();
    if (stop_at_eos && tok.is_end_of_generation(next)) {
      t.stop = "eos";
      break;
    }
    t.generated.push_back(next);
    on_token(next);
    if (static_cast<std::int32_t>(t.generated.size()) >= max_tokens) {
      t.stop = "max_tokens";
      break;
    }
    if (eng.position(id) >= seq_len) {
      t.stop = "seq_len";
      break;
    }
    ls.step();
    ++t.decode_steps;
  }
  // With --compare-full only the policy engine's steps count (the prefill time covers both).
  t.decode_s = ls.full ? ls.eng_seconds - eng_before : seconds_since(t0);
  return t;
}

// Writes a token's bytes as they come (pieces may split a UTF-8 character; the
// concatenation is exact).
struct TokenPrinter {
  const Tokenizer& tok;
  bool enabled;
  void operator()(std::int32_t id) const {
    if (!enabled) return;
    std::cout << tok.token_to_piece(id, /*render_special=*/false) << std::flush;
  }
};

// Engine options for a GGUF run of one sequence over `positions` positions: the pool holds
// just those (unless --num-pages / --contiguous say otherwise).
EngineOptions text_engine_options(const Options& o, const kvkit::engine::ModelConfig& c,
                                  std::int32_t positions) {
  Options sized = o;
  sized.steps = positions;
  EngineOptions e = engine_options(sized, c, 1);
  if (!o.num_pages_given && !o.contiguous)
    e.num_pages = static_cast<std::int32_t>((static_cast<std::int64_t>(positions) + o.page_size - 1) / o.page_size);
  return e;
}

std::string stats_line(const TurnStats& t) {
  std::ostringstream os;
  os << t.prompt << " prompt tokens";
  if (t.reused > 0) os << " (+" << t.reused << " reused from the cache)";
  os << std::fixed << std::setprecision(1) << " at " << t.prefill_tps() << " tokens/s, " << t.generated.size()
     << " generated at " << t.decode_tps() << " tokens/s, stop: " << t.stop;
  return os.str();
}

int cmd_generate_gguf(const Options& o) {
  if (o.steps_given) throw UsageError("--steps is for token-id models; with a GGUF model use --max-tokens");
  if (o.batch_given && o.batch != 1) throw UsageError("a GGUF model generates one prompt (--batch 1)");
  std::string text;
  if (!o.prompt_file.empty()) {
    std::ifstream in(o.prompt_file, std::ios::binary);
    if (!in) throw IoError("cannot read prompt file '" + o.prompt_file + "'");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  } else if (o.prompt_texts.size() == 1) {
    text = o.prompt_texts[0];
  } else if (o.prompt_texts.size() > 1) {
    throw UsageError("a GGUF model generates one prompt; got " + std::to_string(o.prompt_texts.size()) +
                     " --prompt options");
  } else {
    throw UsageError("generate with a GGUF model needs --prompt TEXT or --prompt-file FILE");
  }
  if (o.system_given && !o.chat) throw UsageError("--system needs --chat");
  const TextModel tm = load_text_model(o.model, o.matvec == "float");
  const auto& c = tm.model.ckpt->config();
  std::vector<std::int32_t> prompt;
  if (o.chat) {
    std::vector<ChatMessage> msgs;
    if (o.system_given) msgs.push_back({"system", o.system});
    msgs.push_back({"user", text});
    prompt = tm.tmpl.encode(*tm.tok, msgs, /*add_generation_prompt=*/true);
  } else {
    prompt = tm.tok->encode(text, /*add_special=*/true, /*parse_special=*/true);
  }
  if (prompt.empty()) throw UsageError("the prompt is empty (no tokens)");
  if (static_cast<std::int64_t>(prompt.size()) > c.seq_len)
    throw UsageError("the prompt has " + std::to_string(prompt.size()) + " tokens, more than the model's seq_len " +
                     std::to_string(c.seq_len));
  // T prompt tokens and N generated need T + N - 1 processed positions.
  const std::int32_t positions = static_cast<std::int32_t>(
      std::min<std::int64_t>(c.seq_len, static_cast<std::int64_t>(prompt.size()) + o.max_tokens - 1));
  const EngineOptions eo = text_engine_options(o, c, positions);
  const auto policy = make_policy(o, c, eo);
  const auto eng = make_engine(tm.model, eo, {prompt}, policy.get());
  const auto full = o.compare_full ? make_engine(tm.model, eo, {prompt}) : nullptr;
  Lockstep ls = make_lockstep(*eng, full.get());
  const SeqId id = eng->sequences().at(0);
  const TurnStats t = run_turn(ls, id, o.prefill == "batch", o.max_tokens, o.stop_at_eos, *tm.tok,
                               TokenPrinter{*tm.tok, !o.json});
  const std::string answer = tm.tok->decode(t.generated, /*render_special=*/false);
  const EngineOptions& eff = eng->options();
  if (o.json) {
    Json j = {{"command", "generate"},
                    {"version", KVKIT_VERSION},
                    {"model", tm.model.name},
                    {"synthetic", false},
                    {"chat", o.chat},
                    {"steps", eng->position(id)},
                    {"batch", 1},
                    {"page_size", eff.page_size},
                    {"num_pages", eff.num_pages},
                    {"threads", eff.threads},
                    {"layout", o.layout},
                    {"table", o.table},
                    {"kv_dtype", o.kv_dtype},
                    {"contiguous", o.contiguous},
                    {"prefill", o.prefill},
                    {"matvec", o.matvec},
                    {"sequences", Json::array({{{"index", 0}, {"prompt", prompt}, {"tokens", eng->tokens(id)}}})},
                    {"prompt_tokens", prompt},
                    {"tokens", t.generated},
                    {"text", answer},
                    {"stop", t.stop},
                    {"tokens_per_s", t.decode_tps()},
                    {"prefill_tokens_per_s", t.prefill_tps()},
                    {"prefill_seconds", t.prefill_s},
                    {"decode_seconds", t.decode_s},
                    {"kv_bytes_peak", eng->kv_bytes_peak()},
                    {"kv_bytes_final", eng->kv_bytes_in_use()},
                    {"pages_in_use", eng->pages_in_use()}};
    add_policy_json(j, policy.get(), ls);
    std::cout << dump(j);
  } else {
    std::cout << "\n" << std::flush;  // the text was printed token by token
    if (policy) std::cerr << "kvkit: " << policy_line(policy.get(), ls) << "\n";
    std::cerr << "kvkit: " << stats_line(t) << " (" << eff.threads << " thread"
              << (eff.threads == 1 ? "" : "s") << ", prefill " << o.prefill << ")\n";
  }
  return 0;
}

// Interactive chat: each stdin line is a user turn; the answer streams to stdout. The
// conversation stays one engine sequence, so a turn processes only its new tokens.
int cmd_chat(const Options& o) {
  if (!is_gguf(o.model))
    throw UsageError("chat needs a GGUF model with a tokenizer and chat template; " + o.model +
                     " is not a GGUF file");
  const TextModel tm = load_text_model(o.model, o.matvec == "float");
  const auto& c = tm.model.ckpt->config();
  const EngineOptions eo = text_engine_options(o, c, c.seq_len);
  const auto policy = make_policy(o, c, eo);  // kept for the whole conversation
  std::unique_ptr<Engine> eng;
  SeqId id = -1;
  const bool tty = isatty(STDIN_FILENO) != 0;
  Json turns = Json::array();
  std::string line;
  std::int32_t n = 0;
  for (;;) {
    if (tty) std::cerr << "> " << std::flush;
    if (!std::getline(std::cin, line)) break;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    ++n;
    std::vector<std::int32_t> new_tokens;
    if (!eng) {
      std::vector<ChatMessage> msgs;
      if (o.system_given) msgs.push_back({"system", o.system});
      msgs.push_back({"user", line});
      new_tokens = tm.tmpl.encode(*tm.tok, msgs, true);
      eng = make_engine(tm.model, eo, {new_tokens}, policy.get());
      id = eng->sequences().at(0);
    } else {
      // The previous turn left its last token pending: <|im_end|>, or (cut by --max-tokens)
      // a reply token, then closed here. What the template puts between turns follows.
      if (!tm.tok->is_end_of_generation(eng->pending_token(id))) new_tokens.push_back(tm.end_of_turn);
      const auto more = tm.tok->encode("\n<|im_start|>user\n" + line + "<|im_end|>\n<|im_start|>assistant\n",
                                       /*add_special=*/false, /*parse_special=*/true);
      new_tokens.insert(new_tokens.end(), more.begin(), more.end());
      if (static_cast<std::int64_t>(eng->tokens(id).size() + new_tokens.size()) > c.seq_len) {
        std::cerr << "kvkit: the conversation would exceed the model's seq_len " << c.seq_len << "; ending\n";
        break;
      }
      eng->append_tokens(id, new_tokens);
    }
    Lockstep ls = make_lockstep(*eng, nullptr);
    const TurnStats t = run_turn(ls, id, o.prefill == "batch", o.max_tokens, true, *tm.tok,
                                 TokenPrinter{*tm.tok, !o.json});
    const std::string answer = tm.tok->decode(t.generated, false);
    if (o.json) {
      turns.push_back({{"turn", n},
                       {"user", line},
                       {"text", answer},
                       {"prompt_tokens", new_tokens},
                       {"tokens", t.generated},
                       {"reused_tokens", t.reused},
                       {"processed_prompt_tokens", t.prompt},
                       {"stop", t.stop},
                       {"kv_len", eng->kv_len(id)},
                       {"kv_bytes", eng->kv_bytes_in_use()},
                       {"tokens_per_s", t.decode_tps()},
                       {"prefill_tokens_per_s", t.prefill_tps()}});
    } else {
      std::cout << "\n" << std::flush;
      std::cerr << "kvkit: turn " << n << ": " << stats_line(t) << "\n";
    }
    if (t.stop == "seq_len") {
      std::cerr << "kvkit: the conversation reached the model's seq_len " << c.seq_len << "; ending\n";
      break;
    }
  }
  if (o.json) {
    Json j = {{"command", "chat"},
                    {"version", KVKIT_VERSION},
                    {"model", tm.model.name},
                    {"page_size", eo.page_size},
                    {"threads", eo.threads},
                    {"prefill", o.prefill},
                    {"matvec", o.matvec},
                    {"turns", turns},
                    {"kv_bytes_peak", eng ? eng->kv_bytes_peak() : 0},
                    {"pages_in_use", eng ? eng->pages_in_use() : 0}};
    if (eng) add_policy_stats(j, policy.get());
    std::cout << dump(j);
  } else if (eng && policy) {
    std::cerr << "kvkit: " << policy_line(policy.get(), make_lockstep(*eng, nullptr)) << "\n";
  }
  return 0;
}

// Prints an error: "kvkit: ..." on stderr and, with --json, the error object on stdout.
int fail(bool json, int code, const std::string& msg) {
  std::cerr << "kvkit: " << (code == 2 ? "error: " : "") << msg << "\n";
  if (json) std::cout << dump(Json{{"error", msg}, {"code", code}});
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "r1kv") return kvkit::cli::run_r1kv(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "sweep") return kvkit::cli::run_sweep(argc - 1, argv + 1);
  // --json is known before parsing, so even a parse error can answer in JSON.
  bool json = false;
  for (int i = 1; i < argc; ++i) json = json || std::string(argv[i]) == "--json";
  if (argc > 1 && std::string(argv[1]) == "chat-demo") return kvkit::cli::run_chat_demo(argc - 1, argv + 1);
  try {
    Options o;
    if (!parse_args(argc, argv, o)) return 0;
    if (o.command == "probe") return kvkit::cli::run_probe(o.probe);
    if (o.command == "chat") return cmd_chat(o);
    if (o.command == "store-demo")
      return kvkit::cli::run_store_demo(o.store_demo, [&](int code, const std::string& m) { return fail(json, code, m); });
    return o.command == "generate" ? cmd_generate(o) : cmd_trace(o);
  } catch (const UsageError& e) {
    return fail(json, 2, e.what());
  } catch (const kvkit::Error& e) {
    return fail(json, 1, strip_kvkit_prefix(e.what()));
  } catch (const std::exception& e) {
    return fail(json, 1, e.what());
  }
}
