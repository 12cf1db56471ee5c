// kvkit: command-line front end of the example engine.
//
//   kvkit generate [--model M] [--steps N] [--page-size P] [--layout nhd|hnd] [--batch B]
//                  [--table csr|block] [--contiguous] [--json]
//   kvkit trace    [--model M] [--steps N] --out DIR [--page-size P] [--layout nhd|hnd] [--json]
//
// Without --model a deterministic synthetic checkpoint of the stories260K shape is used.
// With --json exactly one JSON object goes to stdout. Exit codes: 0 ok, 1 a kvkit::Error
// (bad checkpoint, I/O), 2 a usage error (unknown flag, missing or bad value).

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine/engine.hpp"
#include "engine/npy.hpp"

namespace {

using kvkit::engine::Checkpoint;
using kvkit::engine::Engine;
using kvkit::engine::EngineOptions;

const char* kUsage =
    "usage: kvkit <command> [options]\n"
    "\n"
    "commands:\n"
    "  generate   greedy decoding from BOS (token 1) through the paged engine\n"
    "  trace      run greedy decoding and write per-layer K/V/Q, tokens and logits as .npy\n"
    "\n"
    "common options:\n"
    "  --model PATH        llama2.c checkpoint (default: a deterministic synthetic model)\n"
    "  --steps N           positions to process (default 64, at most the model's seq_len)\n"
    "  --page-size P       tokens per KV page (default 16)\n"
    "  --layout nhd|hnd    page layout (default nhd)\n"
    "  --json              print exactly one JSON object on stdout\n"
    "generate options:\n"
    "  --batch B           sequences decoded together (default 1)\n"
    "  --table csr|block   page-table encoding (default csr)\n"
    "  --contiguous        one seq_len-token page per sequence (contiguous-cache baseline)\n"
    "trace options:\n"
    "  --out DIR           output folder (created if missing)\n"
    "\n"
    "exit codes: 0 ok, 1 library error (bad checkpoint, I/O), 2 usage error\n";

/// A command-line mistake: printed as "kvkit: error: ..." with exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  std::string command;
  std::string model;
  std::string out;
  std::int32_t steps = 64;
  std::int32_t page_size = 16;
  std::int32_t batch = 1;
  kvkit::KVLayout layout = kvkit::KVLayout::kNHD;
  kvkit::PageTableKind table = kvkit::PageTableKind::kCsr;
  bool contiguous = false;
  bool json = false;
  bool help = false;
};

std::int32_t parse_positive(const std::string& flag, const std::string& text) {
  std::size_t i = 0;
  bool neg = false;
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) neg = text[i++] == '-';
  long long v = 0;
  bool digits = false;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    digits = true;
    v = v * 10 + (text[i] - '0');
    if (v > std::numeric_limits<std::int32_t>::max()) {
      throw UsageError(flag + " value '" + text + "' is too large");
    }
  }
  if (!digits || i != text.size()) throw UsageError(flag + " value '" + text + "' is not an integer");
  if (neg) v = -v;
  if (v <= 0) throw UsageError(flag + " must be > 0, got " + text);
  return static_cast<std::int32_t>(v);
}

Args parse_args(int argc, char** argv) {
  Args a;
  std::vector<std::string> args(argv + 1, argv + argc);
  std::size_t i = 0;
  if (args.empty()) throw UsageError("missing command (try kvkit --help)");
  if (args[0] == "--help" || args[0] == "-h") {
    a.help = true;
    return a;
  }
  a.command = args[i++];
  if (a.command != "generate" && a.command != "trace")
    throw UsageError("unknown command '" + a.command + "' (expected generate or trace)");
  const bool gen = a.command == "generate";
  for (; i < args.size(); ++i) {
    std::string flag = args[i], value;
    bool inline_value = false;
    const std::size_t eq = flag.find('=');
    if (flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      inline_value = true;
    }
    auto take = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= args.size()) throw UsageError("option " + flag + " needs a value");
      return args[++i];
    };
    auto no_value = [&]() {
      if (inline_value) throw UsageError("option " + flag + " takes no value");
    };
    if (flag == "--help" || flag == "-h") {
      a.help = true;
    } else if (flag == "--json") {
      no_value();
      a.json = true;
    } else if (flag == "--model") {
      a.model = take();
      if (a.model.empty()) throw UsageError("--model needs a non-empty path");
    } else if (flag == "--steps") {
      a.steps = parse_positive(flag, take());
    } else if (flag == "--page-size") {
      a.page_size = parse_positive(flag, take());
    } else if (flag == "--layout") {
      const std::string v = take();
      if (v == "nhd") a.layout = kvkit::KVLayout::kNHD;
      else if (v == "hnd") a.layout = kvkit::KVLayout::kHND;
      else throw UsageError("--layout must be nhd or hnd, got '" + v + "'");
    } else if (gen && flag == "--batch") {
      a.batch = parse_positive(flag, take());
      if (a.batch > 4096) throw UsageError("--batch " + std::to_string(a.batch) + " exceeds 4096");
    } else if (gen && flag == "--table") {
      const std::string v = take();
      if (v == "csr") a.table = kvkit::PageTableKind::kCsr;
      else if (v == "block") a.table = kvkit::PageTableKind::kBlockTable;
      else throw UsageError("--table must be csr or block, got '" + v + "'");
    } else if (gen && flag == "--contiguous") {
      no_value();
      a.contiguous = true;
    } else if (!gen && flag == "--out") {
      a.out = take();
      if (a.out.empty()) throw UsageError("--out needs a non-empty path");
    } else {
      throw UsageError("unknown option '" + flag + "' for " + a.command);
    }
  }
  if (!a.help && !gen && a.out.empty()) throw UsageError("trace needs --out DIR");
  return a;
}

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      o += buf;
    } else {
      o += static_cast<char>(c);
    }
  }
  return o + "\"";
}

std::string json_ints(const std::vector<std::int32_t>& v) {
  std::string o = "[";
  for (std::size_t i = 0; i < v.size(); ++i) o += (i ? "," : "") + std::to_string(v[i]);
  return o + "]";
}

std::string join_ints(const std::vector<std::int32_t>& v) {
  std::string o;
  for (std::size_t i = 0; i < v.size(); ++i) o += (i ? " " : "") + std::to_string(v[i]);
  return o;
}

struct LoadedModel {
  std::shared_ptr<const Checkpoint> ckpt;
  std::string name;  // path, or "synthetic"
};

LoadedModel load_model(const Args& a) {
  if (a.model.empty()) {
    return {std::make_shared<const Checkpoint>(kvkit::engine::default_synthetic_checkpoint()),
            "synthetic"};
  }
  return {std::make_shared<const Checkpoint>(kvkit::engine::load_checkpoint(a.model)), a.model};
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

void check_steps(const Args& a, const LoadedModel& m) {
  const std::int32_t max = m.ckpt->config().seq_len;
  if (a.steps > max)
    throw UsageError("--steps " + std::to_string(a.steps) + " exceeds the model's seq_len " +
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

int cmd_generate(const Args& a) {
  const LoadedModel m = load_model(a);
  check_steps(a, m);
  EngineOptions o;
  o.page_size = a.page_size;
  o.layout = a.layout;
  o.table_kind = a.table;
  o.max_batch = a.batch;
  o.contiguous = a.contiguous;
  Engine eng(m.ckpt, o);
  for (std::int32_t b = 0; b < a.batch; ++b) eng.add_sequence({kvkit::engine::kBosToken});
  const double secs = run_steps(eng, a.steps);
  const double tps = static_cast<double>(a.steps) * a.batch / secs;
  const auto ids = eng.sequences();
  const char* layout = kvkit::to_string(a.layout);
  const char* table = a.table == kvkit::PageTableKind::kCsr ? "csr" : "block";
  if (a.json) {
    std::ostringstream os;
    os.precision(6);
    os << "{\"model\":" << json_string(m.name) << ",\"synthetic\":"
       << (m.name == "synthetic" ? "true" : "false") << ",\"steps\":" << a.steps
       << ",\"batch\":" << a.batch << ",\"page_size\":" << eng.options().page_size
       << ",\"layout\":\"" << layout << "\",\"table\":\"" << table << "\",\"contiguous\":"
       << (a.contiguous ? "true" : "false") << ",\"tokens\":" << json_ints(eng.tokens(ids[0]));
    if (a.batch > 1) {
      os << ",\"batch_tokens\":[";
      for (std::size_t b = 0; b < ids.size(); ++b) os << (b ? "," : "") << json_ints(eng.tokens(ids[b]));
      os << "]";
    }
    os << ",\"tokens_per_s\":" << tps << ",\"kv_bytes_peak\":" << eng.kv_bytes_peak()
       << ",\"kv_bytes_final\":" << eng.kv_bytes_in_use()
       << ",\"pages_in_use\":" << eng.pages_in_use() << "}\n";
    std::cout << os.str();
  } else {
    std::cout << describe(m) << "\n";
    for (std::size_t b = 0; b < ids.size(); ++b) {
      if (a.batch > 1) std::cout << "sequence " << b << ": ";
      std::cout << "tokens: " << join_ints(eng.tokens(ids[b])) << "\n";
    }
    std::cout << "steps " << a.steps << " x batch " << a.batch << ": " << tps << " tokens/s\n"
              << "KV cache: " << eng.kv_bytes_in_use() << " bytes in use (peak "
              << eng.kv_bytes_peak() << "), " << eng.pages_in_use() << " pages of "
              << eng.options().page_size << " tokens, layout " << layout << ", " << table
              << " page table\n";
  }
  return 0;
}

int cmd_trace(const Args& a) {
  const LoadedModel m = load_model(a);
  check_steps(a, m);
  const auto& c = m.ckpt->config();
  EngineOptions o;
  o.page_size = a.page_size;
  o.layout = a.layout;
  o.max_batch = 1;
  Engine eng(m.ckpt, o);
  const kvkit::engine::SeqId id = eng.add_sequence({kvkit::engine::kBosToken});
  const std::int64_t N = a.steps, hd = c.head_dim();
  std::vector<std::vector<float>> q(static_cast<std::size_t>(c.n_layers),
                                    std::vector<float>(static_cast<std::size_t>(c.n_heads * N * hd)));
  std::vector<float> logits(static_cast<std::size_t>(N * c.vocab_size));
  // Queries exist only during a step: collect them through the policy hook.
  eng.add_step_hook([&](Engine&, const kvkit::engine::StepInfo& info) {
    const std::int64_t t = info.step - 1;
    for (int l = 0; l < c.n_layers; ++l)
      for (std::int64_t h = 0; h < c.n_heads; ++h)
        for (std::int64_t d = 0; d < hd; ++d)
          q[static_cast<std::size_t>(l)][static_cast<std::size_t>((h * N + t) * hd + d)] =
              info.queries[l][h * hd + d];
    std::copy(info.logits, info.logits + c.vocab_size, logits.begin() + t * c.vocab_size);
  });
  run_steps(eng, a.steps);
  std::filesystem::create_directories(a.out);
  const std::filesystem::path dir(a.out);
  std::vector<std::string> files;
  auto path = [&](const std::string& name) {
    files.push_back(name);
    return (dir / name).string();
  };
  const auto& views = eng.layer_views();
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
  const auto& toks = eng.tokens(id);  // N processed inputs + the final greedy token
  std::vector<std::int64_t> inputs(toks.begin(), toks.begin() + N);
  kvkit::engine::write_npy(path("tokens.npy"), inputs.data(), {N});
  kvkit::engine::write_npy(path("logits.npy"), logits.data(), {N, c.vocab_size});
  if (a.json) {
    std::ostringstream os;
    os << "{\"model\":" << json_string(m.name) << ",\"synthetic\":"
       << (m.name == "synthetic" ? "true" : "false") << ",\"steps\":" << a.steps
       << ",\"positions\":" << N << ",\"out\":" << json_string(a.out) << ",\"files\":[";
    for (std::size_t i = 0; i < files.size(); ++i) os << (i ? "," : "") << json_string(files[i]);
    os << "],\"tokens\":" << json_ints(toks) << "}\n";
    std::cout << os.str();
  } else {
    std::cout << describe(m) << "\n"
              << "wrote " << files.size() << " files to " << a.out << " (" << N
              << " positions; k/v [" << c.n_kv_heads << ", " << N << ", " << hd << "], q ["
              << c.n_heads << ", " << N << ", " << hd << "], logits [" << N << ", "
              << c.vocab_size << "])\n"
              << "tokens: " << join_ints(toks) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    a = parse_args(argc, argv);
    if (a.help) {
      std::cout << kUsage;
      return 0;
    }
    return a.command == "generate" ? cmd_generate(a) : cmd_trace(a);
  } catch (const UsageError& e) {
    std::cerr << "kvkit: error: " << e.what() << "\n";
    return 2;
  } catch (const kvkit::Error& e) {
    const std::string msg = e.what();
    std::cerr << (msg.rfind("kvkit:", 0) == 0 ? "" : "kvkit: ") << msg << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kvkit: " << e.what() << "\n";
    return 1;
  }
}
