// kvkit: command-line front end of the example engine (arguments by CLI11, JSON by
// nlohmann/json; the library headers stay dependency-free).
//
//   kvkit generate [engine options] [--batch B] [--table csr|block] [--contiguous] [--json]
//   kvkit trace    [engine options] --out DIR [--json]
//   kvkit --version | --help;  kvkit <command> --help
//
// Without --model a deterministic synthetic checkpoint of the stories260K shape is used.
// Exit codes: 0 ok, 1 a library or I/O error (bad checkpoint, unreadable file), 2 a usage
// error (unknown option, bad value, a KV pool the machine cannot hold). With --json exactly
// one JSON object goes to stdout, also on error: {"error": "...", "code": <exit code>}.

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/engine.hpp"
#include "engine/npy.hpp"
#include "kvkit/version.hpp"

namespace {

using kvkit::engine::Checkpoint;
using kvkit::engine::Engine;
using kvkit::engine::EngineOptions;
using Json = nlohmann::json;

constexpr std::int32_t kMaxBatch = 4096;
constexpr std::int32_t kMaxThreads = 64;  // kvkit::kMaxHostThreads

const char* kFooter =
    "Prompts: --prompt \"1 2 3\" gives token ids (whitespace or commas between them; include\n"
    "  1 = BOS yourself); repeat --prompt for several prompts. --prompt-file F holds one prompt\n"
    "  per line in the same format (blank lines and lines starting with # are skipped).\n"
    "  Sequence b of the batch decodes prompt b mod (number of prompts): fewer prompts than\n"
    "  --batch cycle, more are cut. --batch defaults to the number of prompts. Without a\n"
    "  prompt every sequence starts from BOS. --steps counts positions processed per sequence,\n"
    "  prompt tokens included (they are teacher-forced, then decoding is greedy).\n"
    "Exit codes: 0 ok, 1 library or I/O error (bad checkpoint, unreadable file), 2 usage error\n"
    "  (unknown option, bad value, a KV pool larger than this machine's memory). With --json\n"
    "  errors also print {\"error\": \"...\", \"code\": N} on stdout.";

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
  bool contiguous = false;
  bool json = false;
  bool page_size_given = false;
  bool batch_given = false;
  bool num_pages_given = false;
};

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

// Options shared by generate and trace.
void add_engine_options(CLI::App& cmd, Options& o) {
  cmd.add_option("--model", o.model, "llama2.c checkpoint (default: a deterministic synthetic model)")
      ->type_name("PATH")
      ->check([](const std::string& s) { return s.empty() ? std::string("needs a non-empty path") : ""; });
  const std::int64_t int_max = std::numeric_limits<std::int32_t>::max();
  cmd.add_option("--steps", o.steps, "positions processed per sequence, prompt included (default 64, at most the model's seq_len)")
      ->type_name("N")
      ->check(int_in(1, int_max));
  cmd.add_option("--page-size", o.page_size, "tokens per KV page (default 16); the pool must fit in memory")
      ->type_name("P")
      ->check(int_in(1, int_max));
  cmd.add_option("--num-pages", o.num_pages, "pages in the KV pool (default: batch x ceil(seq_len / page size))")
      ->type_name("N")
      ->check(int_in(1, int_max));
  cmd.add_option("--threads", o.threads, "threads of the KV kernels, 1 to " + std::to_string(kMaxThreads) + " (default 1)")
      ->type_name("T")
      ->check(int_in(1, kMaxThreads));
  cmd.add_option("--layout", o.layout, "page layout: nhd or hnd (default nhd)")
      ->type_name("L")
      ->check(CLI::IsMember({"nhd", "hnd"}));
  cmd.add_option("--prompt", o.prompt_texts, "prompt token ids, e.g. \"1 2 3\" (repeatable; see below)")
      ->type_name("IDS")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd.add_option("--prompt-file", o.prompt_file, "file with one prompt per line (see below)")
      ->type_name("FILE")
      ->excludes("--prompt");
  cmd.add_flag("--json", o.json, "print exactly one JSON object on stdout");
  cmd.footer(kFooter);
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
  gen->add_option("--batch", o.batch, "sequences decoded together, 1 to 4096 (default: the number of prompts, else 1)")
      ->type_name("B")
      ->check(int_in(1, kMaxBatch));
  gen->add_option("--table", o.table, "page-table encoding: csr or block (default csr)")
      ->type_name("T")
      ->check(CLI::IsMember({"csr", "block"}));
  gen->add_flag("--contiguous", o.contiguous,
                "one seq_len-token page per sequence (the contiguous-cache baseline); excludes --page-size")
      ->excludes("--page-size");
  CLI::App* trace = app.add_subcommand("trace", "greedy decoding of one sequence; writes per-layer K/V/Q, tokens and logits as .npy");
  add_engine_options(*trace, o);
  trace->add_option("--out", o.out, "output folder (created if missing)")
      ->type_name("DIR")
      ->required()
      ->check([](const std::string& s) { return s.empty() ? std::string("needs a non-empty path") : ""; });

  // Handled before CLI11 so `kvkit foo --help` prints help and a stray word names itself.
  const std::vector<std::string> args(argv + 1, argv + argc);
  bool help = false;
  for (const std::string& a : args) help = help || a == "--help" || a == "-h";
  if (args.empty()) throw UsageError("missing command (try kvkit --help)");
  if (args[0].empty() || (args[0][0] != '-' && args[0] != "generate" && args[0] != "trace")) {
    if (help) {
      std::cout << app.help();
      return false;
    }
    throw UsageError("unknown command '" + args[0] + "' (expected generate or trace)");
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return false;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return false;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return false;
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  o.command = gen->parsed() ? "generate" : "trace";
  CLI::App* cmd = gen->parsed() ? gen : trace;
  o.page_size_given = cmd->count("--page-size") > 0;
  o.num_pages_given = cmd->count("--num-pages") > 0;
  o.batch_given = o.command == "generate" && gen->count("--batch") > 0;
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

LoadedModel load_model(const Options& o) {
  if (o.model.empty()) {
    return {std::make_shared<const Checkpoint>(kvkit::engine::default_synthetic_checkpoint()),
            "synthetic"};
  }
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
  // K and V pools of every layer: num_pages x page tokens x kv heads x head_dim floats.
  const std::uint64_t bytes =
      sat_mul(sat_mul(sat_mul(static_cast<std::uint64_t>(num_pages), static_cast<std::uint64_t>(page)),
                      static_cast<std::uint64_t>(c.kv_dim())),
              sizeof(float) * 2 * static_cast<std::uint64_t>(c.n_layers));
  const std::uint64_t limit = physical_memory_bytes();
  if (bytes > limit) {
    const std::string need = bytes == std::numeric_limits<std::uint64_t>::max()
                                 ? "more than 2^64 bytes"
                                 : std::to_string(bytes) + " bytes (" + human_bytes(bytes) + ")";
    throw UsageError(given + ": the KV pool would need " + need + " = " + std::to_string(num_pages) +
                     " pages x " + std::to_string(page) + " tokens x " + std::to_string(c.kv_dim()) +
                     " floats x " + std::to_string(c.n_layers) + " layers x K,V x 4 bytes, more than "
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
  return e;
}

std::string strip_kvkit_prefix(const std::string& msg) {
  return msg.rfind("kvkit: ", 0) == 0 ? msg.substr(7) : msg;
}

// Builds the engine and adds one sequence per prompt. The options and prompts were checked
// above, so a kvkit::Error here is still a configuration problem: a usage error (exit 2).
std::unique_ptr<Engine> make_engine(const LoadedModel& m, const EngineOptions& e,
                                    const std::vector<std::vector<std::int32_t>>& prompts) {
  try {
    auto eng = std::make_unique<Engine>(m.ckpt, e);
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

// Runs `steps` engine steps, showing progress only when stderr is a terminal.
double run_steps(Engine& eng, std::int32_t steps) {
  const bool tty = isatty(STDERR_FILENO) != 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int32_t s = 0; s < steps; ++s) {
    eng.step();
    if (tty && ((s + 1) % 16 == 0 || s + 1 == steps))
      std::fprintf(stderr, "\rkvkit: step %d/%d", s + 1, steps);
  }
  if (tty) std::fprintf(stderr, "\n");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return secs > 0 ? secs : 1e-9;
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

int cmd_generate(const Options& o) {
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
  const auto eng = make_engine(m, eo, seq_prompts);
  const double secs = run_steps(*eng, o.steps);
  const double tps = static_cast<double>(o.steps) * batch / secs;
  const auto ids = eng->sequences();
  const EngineOptions& eff = eng->options();
  if (o.json) {
    // The same fields at every batch size: per-sequence results live in `sequences`.
    Json seqs = Json::array();
    for (std::size_t b = 0; b < ids.size(); ++b)
      seqs.push_back({{"index", b}, {"prompt", seq_prompts[b]}, {"tokens", eng->tokens(ids[b])}});
    const Json j = {{"command", "generate"},
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
                    {"contiguous", o.contiguous},
                    {"sequences", seqs},
                    {"tokens_per_s", tps},
                    {"kv_bytes_peak", eng->kv_bytes_peak()},
                    {"kv_bytes_final", eng->kv_bytes_in_use()},
                    {"pages_in_use", eng->pages_in_use()}};
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
              << " pages of " << eff.page_size << " tokens, layout " << o.layout << ", " << o.table
              << " page table\n";
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
  run_steps(*eng, o.steps);
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

// Prints an error: "kvkit: ..." on stderr and, with --json, the error object on stdout.
int fail(bool json, int code, const std::string& msg) {
  std::cerr << "kvkit: " << (code == 2 ? "error: " : "") << msg << "\n";
  if (json) std::cout << dump(Json{{"error", msg}, {"code", code}});
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // --json is known before parsing, so even a parse error can answer in JSON.
  bool json = false;
  for (int i = 1; i < argc; ++i) json = json || std::string(argv[i]) == "--json";
  try {
    Options o;
    if (!parse_args(argc, argv, o)) return 0;
    return o.command == "generate" ? cmd_generate(o) : cmd_trace(o);
  } catch (const UsageError& e) {
    return fail(json, 2, e.what());
  } catch (const kvkit::Error& e) {
    return fail(json, 1, strip_kvkit_prefix(e.what()));
  } catch (const std::exception& e) {
    return fail(json, 1, e.what());
  }
}
