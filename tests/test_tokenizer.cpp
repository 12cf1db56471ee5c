// Tokenizer tests: the byte-level BPE core on a tiny hand-made vocabulary (always), and
// SmolLM2-135M-Instruct's tokenizer against ids recorded from llama.cpp
// (tests/fixtures/smollm2_tokens.json, made by scripts/record-tokenizer-fixtures.py) when
// the model file is in KVKIT_MODEL_DIR (skipped with a message otherwise).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/gguf.hpp"
#include "engine/tokenizer.hpp"
#include "reference.hpp"

using kvkit::engine::ChatMessage;
using kvkit::engine::ChatTemplate;
using kvkit::engine::GgufFile;
using kvkit::engine::PreTokenizer;
using kvkit::engine::Tokenizer;
using kvkit::engine::TokenType;

namespace {

// GPT-2 byte alphabet, written independently of the header: printable Latin-1 bytes are
// themselves, the rest U+0100 + k in byte order.
std::string byte_piece(int b) {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int next = 0;
    for (int i = 0; i < 256; ++i) {
      const bool printable = (i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE;
      const unsigned cp = printable ? static_cast<unsigned>(i) : 256u + next++;
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      t[static_cast<std::size_t>(i)] = s;
    }
    return t;
  }();
  return table[static_cast<std::size_t>(b)];
}

std::string pieces(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += byte_piece(c);
  return out;
}

// A tiny vocabulary: the 256 byte tokens, then merged tokens, then special tokens.
struct TinyVocab {
  std::vector<std::string> tokens;
  std::vector<std::string> merges;
  std::vector<std::int32_t> types;

  TinyVocab() {
    for (int b = 0; b < 256; ++b) add(byte_piece(b));
  }
  std::int32_t add(const std::string& piece, TokenType t = TokenType::kNormal) {
    tokens.push_back(piece);
    types.push_back(static_cast<std::int32_t>(t));
    return static_cast<std::int32_t>(tokens.size() - 1);
  }
  // Adds the merge "l r" (next rank) and its result token; l and r are raw bytes.
  std::int32_t merge(const std::string& l, const std::string& r) {
    merges.push_back(pieces(l) + " " + pieces(r));
    return add(pieces(l + r));
  }
  Tokenizer make(PreTokenizer pre = PreTokenizer::kSmollm) const {
    return Tokenizer(tokens, merges, types, -1, -1, pre);
  }
};

std::vector<std::int32_t> byte_ids(const std::string& s) {
  std::vector<std::int32_t> out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

std::string random_utf8(std::mt19937_64& rng, int n_codepoints) {
  // Mix ASCII (letters, digits, spaces, punctuation, controls) with 2-, 3- and 4-byte
  // codepoints, including CJK, emoji, combining marks and Unicode spaces.
  static const std::uint32_t picks[] = {' ', ' ', '\n', '\t', '\'', 'a', 'Z', '7', '.', '<',
                                        0xE9, 0x3000, 0x2003, 0x85, 0x301, 0x4E2D, 0x1F389, 0x200D};
  std::string s;
  for (int i = 0; i < n_codepoints; ++i) {
    std::uint32_t c;
    switch (rng() % 4) {
      case 0: c = picks[rng() % (sizeof(picks) / sizeof(picks[0]))]; break;
      case 1: c = static_cast<std::uint32_t>(rng() % 0x80); break;
      case 2: c = static_cast<std::uint32_t>(0x80 + rng() % (0x10000 - 0x80)); break;
      default: c = static_cast<std::uint32_t>(0x10000 + rng() % (0x110000 - 0x10000)); break;
    }
    if (c >= 0xD800 && c <= 0xDFFF) c = 0xFFFD;  // surrogates are not valid UTF-8
    kvkit::engine::detail::unicode::append_utf8(s, c);
  }
  return s;
}

std::string from_hex(const std::string& h) {
  std::string out;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2)
    out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

std::string show_ids(const std::vector<std::int32_t>& v) {
  std::string s;
  for (std::int32_t x : v) s += std::to_string(x) + " ";
  return s;
}

}  // namespace

TEST_CASE("tokenizer: Unicode classes", "[tokenizer]") {
  using namespace kvkit::engine::detail::unicode;
  for (std::uint32_t c : {0x41u, 0x7Au, 0xE9u, 0x4E2Du, 0xAC00u, 0x3042u, 0x5D0u, 0x1D400u, 0x20000u})
    CHECK(is_letter(c));
  for (std::uint32_t c : {0x30u, 0x39u, 0x663u, 0x2160u, 0xBDu, 0xB2u, 0x1D7D8u}) CHECK(is_number(c));
  for (std::uint32_t c : {0x20u, 0x2Du, 0x1F389u, 0x301u, 0x200Du, 0x3000u, 0xE000u, 0xD7u})
    CHECK_FALSE(is_letter(c));
  for (std::uint32_t c : {0x20u, 0x09u, 0x0Au, 0x0Du, 0x85u, 0xA0u, 0x2003u, 0x3000u, 0x2028u})
    CHECK(is_whitespace(c));
  for (std::uint32_t c : {0x1Cu, 0x200Bu, 0x180Eu, 0x41u}) CHECK_FALSE(is_whitespace(c));
}

TEST_CASE("tokenizer: lenient UTF-8 decoding matches llama.cpp", "[tokenizer]") {
  using kvkit::engine::detail::unicode::next_codepoint;
  const auto decode = [](const std::string& s) {
    std::vector<std::uint32_t> out;
    for (std::size_t p = 0; p < s.size();) out.push_back(next_codepoint(s, p));
    return out;
  };
  CHECK(decode("a\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x8E\x89") ==
        std::vector<std::uint32_t>{'a', 0xE9, 0x4E2D, 0x1F389});
  CHECK(decode("\xFF\x80" "a\xC3") == std::vector<std::uint32_t>{0xFFFD, 0xFFFD, 'a', 0xFFFD});
  CHECK(decode("\xE4\xB8" "a") == std::vector<std::uint32_t>{0xFFFD, 0xFFFD, 'a'});
  CHECK(decode("\xED\xA0\x80") == std::vector<std::uint32_t>{0xD800});  // accepted, as llama.cpp
}

TEST_CASE("tokenizer: smollm pre-tokenizer split", "[tokenizer]") {
  const Tokenizer tok = TinyVocab().make();
  using W = std::vector<std::string>;
  CHECK(tok.pre_tokenize("Hello world") == W{"Hello", " world"});
  CHECK(tok.pre_tokenize("it's we've I'M") == W{"it", "'s", " we", "'ve", " I", "'", "M"});
  // Digits are split one by one first; the space before a digit stays alone.
  CHECK(tok.pre_tokenize("x 123ab") == W{"x", " ", "1", "2", "3", "ab"});
  // \s+(?!\S): a whitespace run gives its last space to the next word.
  CHECK(tok.pre_tokenize("a   b") == W{"a", "  ", " b"});
  CHECK(tok.pre_tokenize("a \n\tb  ") == W{"a", " \n", "\t", "b", "  "});  // only a space joins
  CHECK(tok.pre_tokenize("caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87!?") ==
        W{"caf\xC3\xA9", " \xE4\xB8\xAD\xE6\x96\x87", "!?"});
  CHECK(tok.pre_tokenize(" ...x") == W{" ...", "x"});
  CHECK(tok.pre_tokenize("").empty());
  // The plain GPT-2 split keeps digit runs (and a leading space) together.
  const Tokenizer gpt2 = TinyVocab().make(PreTokenizer::kGpt2);
  CHECK(gpt2.pre_tokenize("x 123ab") == W{"x", " 123", "ab"});
}

TEST_CASE("tokenizer: BPE merges by rank, leftmost first", "[tokenizer]") {
  SECTION("rank decides") {
    TinyVocab v;
    const auto bc = v.merge("b", "c");  // rank 0
    v.merge("a", "b");                  // rank 1
    const Tokenizer tok = v.make();
    CHECK(tok.encode("abc") == std::vector<std::int32_t>{'a', bc});
  }
  SECTION("other order") {
    TinyVocab v;
    const auto ab = v.merge("a", "b");
    v.merge("b", "c");
    const Tokenizer tok = v.make();
    CHECK(tok.encode("abc") == std::vector<std::int32_t>{ab, 'c'});
  }
  SECTION("ties go to the leftmost pair") {
    TinyVocab v;
    const auto aa = v.merge("a", "a");
    const Tokenizer tok = v.make();
    CHECK(tok.encode("aaa") == std::vector<std::int32_t>{aa, 'a'});
    CHECK(tok.encode("aaaa") == std::vector<std::int32_t>{aa, aa});
  }
  SECTION("chains of merges, spaces and multi-byte characters") {
    TinyVocab v;
    v.merge("h", "e");
    v.merge("l", "l");
    v.merge("he", "ll");
    const auto hello = v.merge("hell", "o");
    v.merge(" ", "w");
    v.merge("o", "r");
    v.merge(" w", "or");
    v.merge("l", "d");
    const auto world = v.merge(" wor", "ld");
    const auto e_acute = v.merge("\xC3", "\xA9");
    const Tokenizer tok = v.make();
    CHECK(tok.encode("hello world") == std::vector<std::int32_t>{hello, world});
    CHECK(tok.encode("h\xC3\xA9") == std::vector<std::int32_t>{'h', e_acute});
    // Merges never cross word boundaries: "o w" would need the space word to join.
    CHECK(tok.encode("hello  world") == std::vector<std::int32_t>{hello, ' ', world});
    CHECK(tok.decode(tok.encode("hello  world")) == "hello  world");
  }
}

TEST_CASE("tokenizer: special tokens", "[tokenizer]") {
  TinyVocab v;
  const auto start = v.add("<|s|>", TokenType::kControl);
  const auto start_long = v.add("<|s|>>", TokenType::kControl);
  const auto user = v.add("<u>", TokenType::kUserDefined);
  const Tokenizer tok = v.make();
  using V = std::vector<std::int32_t>;
  CHECK(tok.encode("a<|s|>b", false, true) == V{'a', start, 'b'});
  CHECK(tok.encode("<|s|><|s|>", false, true) == V{start, start});
  CHECK(tok.encode("<|s|>>", false, true) == V{start_long});  // longest text first
  // Without parse_special control tokens are plain text; user-defined ones still match.
  CHECK(tok.encode("a<|s|>", false, false) == byte_ids("a<|s|>"));
  CHECK(tok.encode("x<u>y", false, false) == V{'x', user, 'y'});
  // Decoding renders control tokens only on request; user-defined ones always.
  CHECK(tok.decode({'a', start, user}) == "a<|s|><u>");
  CHECK(tok.decode({'a', start, user}, false) == "a<u>");
  CHECK(tok.decode(tok.encode("q <|s|> <u>\n", false, true)) == "q <|s|> <u>\n");
}

TEST_CASE("tokenizer: BOS/EOS and bad input", "[tokenizer]") {
  TinyVocab v;
  const auto bos = v.add("<s>", TokenType::kControl);
  const auto eos = v.add("</s>", TokenType::kControl);
  const Tokenizer tok(v.tokens, v.merges, v.types, bos, eos, PreTokenizer::kSmollm, true, true);
  CHECK(tok.encode("a") == std::vector<std::int32_t>{bos, 'a', eos});
  CHECK(tok.encode("a", false) == std::vector<std::int32_t>{'a'});
  CHECK(tok.encode("", true) == std::vector<std::int32_t>{bos, eos});
  CHECK(tok.is_end_of_generation(eos));
  CHECK_FALSE(tok.is_end_of_generation('a'));
  CHECK_THROWS_WITH(tok.decode({tok.vocab_size()}), Catch::Contains("outside the vocabulary"));
  CHECK_THROWS_WITH(tok.token_to_piece(-1), Catch::Contains("token id -1"));
  std::vector<std::int32_t> short_types(v.types.begin(), v.types.end() - 1);
  CHECK_THROWS_WITH(Tokenizer(v.tokens, v.merges, short_types, bos, eos),
                    Catch::Contains("token types for"));
  CHECK_THROWS_WITH(Tokenizer(v.tokens, v.merges, v.types, 99999, eos), Catch::Contains("bos id 99999"));
  // Invalid UTF-8 never crashes: bad bytes read as U+FFFD (EF BF BD).
  const auto ids = tok.encode("\xFF" "a\xC3", false);
  CHECK(tok.decode(ids) == "\xEF\xBF\xBD" "a\xEF\xBF\xBD");
}

TEST_CASE("tokenizer: round trip on random UTF-8 (byte vocabulary)", "[tokenizer]") {
  TinyVocab v;
  v.merge(" ", " ");
  v.merge("\xE4", "\xB8");
  const Tokenizer tok = v.make();
  KVKIT_TEST_RNG(rng);
  for (int trial = 0; trial < 200; ++trial) {
    const std::string s = random_utf8(rng, 1 + static_cast<int>(rng() % 64));
    INFO("trial " << trial);
    CHECK(tok.decode(tok.encode(s, false, true)) == s);
  }
}

TEST_CASE("tokenizer: ChatML template", "[tokenizer]") {
  // SmolLM2's template, as stored in the GGUF file.
  const std::string smol =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
      "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
      "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant\n' }}{% endif %}";
  const ChatTemplate ct = ChatTemplate::from_jinja(smol);
  CHECK(ct.default_system() == "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  CHECK(ct.render({{"user", "Hi"}}, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  CHECK(ct.render({{"system", "S"}, {"user", "U"}, {"assistant", "A"}}, false) ==
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n");
  CHECK(ct.render({}, true) == "<|im_start|>assistant\n");
  // An escaped-newline literal works too, and a template without a default system adds none.
  CHECK(ChatTemplate::from_jinja("'<|im_start|>system\\nBe brief.<|im_end|>'").default_system() ==
        "Be brief.");
  CHECK(ChatTemplate::from_jinja("{{'<|im_start|>' + role}}<|im_end|>").render({{"user", "x"}}, false) ==
        "<|im_start|>user\nx<|im_end|>\n");
  CHECK_THROWS_WITH(ChatTemplate::from_jinja("{{ bos_token }}[INST] {{ x }} [/INST]"),
                    Catch::Contains("not ChatML"));
}

// ---------------------------------------------------------------------------------------
// SmolLM2 against llama.cpp.

namespace {

const std::string kSmolPath = std::string(KVKIT_MODEL_DIR) + "/SmolLM2-135M-Instruct.Q4_1.gguf";

std::uint64_t fnv1a64(const std::string& bytes, std::uint64_t h) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

bool file_exists(const std::string& p) { return std::ifstream(p).good(); }

// `s` without the bytes that have no token in `tok`'s vocabulary: what decode(encode(s))
// gives back for valid UTF-8 (llama.cpp drops those bytes too).
std::string covered_bytes(const Tokenizer& tok, const std::string& s) {
  std::string out;
  for (unsigned char c : s)
    if (tok.has_byte_token(c)) out += static_cast<char>(c);
  return out;
}

}  // namespace

TEST_CASE("tokenizer: SmolLM2 matches llama.cpp", "[tokenizer][model]") {
  if (!file_exists(kSmolPath)) {
    WARN("skipped: no model file " << kSmolPath << " (scripts/fetch-model.sh fetches it)");
    return;
  }
  std::ifstream fin(KVKIT_TOKENIZER_FIXTURE);
  REQUIRE(fin.good());
  const nlohmann::json fx = nlohmann::json::parse(fin);

  const GgufFile f = GgufFile::open(kSmolPath);
  const Tokenizer tok = Tokenizer::from_gguf(f);
  const ChatTemplate ct = ChatTemplate::from_gguf(f);
  REQUIRE(tok.vocab_size() == fx.at("n_vocab").get<int>());
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  CHECK_FALSE(tok.add_bos());
  CHECK(tok.pre_tokenizer() == PreTokenizer::kSmollm);
  CHECK(tok.is_end_of_generation(2));
  CHECK(tok.is_end_of_generation(0));
  // SmolLM2's vocabulary has no token for 21 bytes (6 controls and 15 UTF-8 lead bytes, see
  // tokenizer.hpp); everything else round-trips.
  std::string uncovered;
  for (int b = 0; b < 256; ++b)
    if (!tok.has_byte_token(static_cast<std::uint8_t>(b))) uncovered += static_cast<char>(b);
  CHECK(uncovered == std::string("\x04\x06\x13\x14\x16\x1D\xC0\xC1\xF1\xF2\xF5\xF6\xF7\xF8\xF9"
                                 "\xFA\xFB\xFC\xFD\xFE\xFF"));

  SECTION("every token's piece") {
    std::uint64_t h = 0xCBF29CE484222325ull;
    for (std::int32_t id = 0; id < tok.vocab_size(); ++id) {
      const std::string p = tok.token_to_piece(id);
      const std::uint32_t n = static_cast<std::uint32_t>(p.size());
      const std::string len{static_cast<char>(n & 0xFF), static_cast<char>((n >> 8) & 0xFF),
                            static_cast<char>((n >> 16) & 0xFF), static_cast<char>(n >> 24)};
      h = fnv1a64(p, fnv1a64(len, h));
    }
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    CHECK(std::string(hex) == fx.at("vocab_pieces_fnv1a64").get<std::string>());
  }

  SECTION("token ids of every recorded string") {
    std::size_t n_cases = 0, n_match = 0, n_ids = 0;
    for (const char* group : {"cases", "sweep"}) {
      for (const auto& c : fx.at(group)) {
        const std::string text = from_hex(c.at("hex").get<std::string>());
        const bool add_special = c.at("add_special").get<bool>();
        const bool parse_special = c.at("parse_special").get<bool>();
        const auto want = c.at("ids").get<std::vector<std::int32_t>>();
        const auto got = tok.encode(text, add_special, parse_special);
        INFO(group << " case " << c.at("name").get<std::string>());
        ++n_cases;
        n_ids += want.size();
        if (got == want) ++n_match;
        else CHECK(show_ids(got) == show_ids(want));
        // Decoding matches llama.cpp's detokenization; for valid UTF-8 it is the input
        // (less the bytes without a token, which llama.cpp drops as well).
        CHECK(tok.decode(want) == from_hex(c.at("decoded_hex").get<std::string>()));
        if (c.contains("text")) CHECK(tok.decode(got) == covered_bytes(tok, text));
      }
    }
    WARN("llama.cpp fixtures: " << n_match << "/" << n_cases << " strings match exactly ("
                                << n_ids << " ids)");
    CHECK(n_match == n_cases);
    CHECK(n_cases >= 60);
  }

  SECTION("ChatML prompts") {
    std::size_t n = 0;
    for (const auto& c : fx.at("chats")) {
      INFO("chat " << c.at("name").get<std::string>());
      std::vector<ChatMessage> msgs;
      for (const auto& m : c.at("messages"))
        msgs.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
      const bool gen = c.at("add_generation_prompt").get<bool>();
      CHECK(ct.render(msgs, gen) == c.at("prompt").get<std::string>());
      CHECK(show_ids(ct.encode(tok, msgs, gen)) == show_ids(c.at("ids").get<std::vector<std::int32_t>>()));
      ++n;
    }
    CHECK(n >= 5);
  }

  SECTION("a conversation's tokens extend its earlier turns' tokens") {
    // Every message starts with the special <|im_start|>, which splits the text before BPE,
    // so tokens of the first k turns are a prefix of the tokens of the whole conversation:
    // a chat can keep its KV and encode only the new turns.
    const std::vector<ChatMessage> msgs = {{"user", "Hi there!"},
                                           {"assistant", "Hello! How can I help?"},
                                           {"user", "  Tell me  about 1999 \n\n"},
                                           {"assistant", "Sure."}};
    const auto all = ct.encode(tok, msgs, false);
    for (std::size_t k = 1; k < msgs.size(); ++k) {
      INFO("first " << k << " messages");
      const std::vector<ChatMessage> head(msgs.begin(), msgs.begin() + static_cast<std::ptrdiff_t>(k));
      const auto part = ct.encode(tok, head, false);
      REQUIRE(part.size() < all.size());
      CHECK(std::equal(part.begin(), part.end(), all.begin()));
      // The new turns alone, rendered without the default system message.
      std::string rest;
      for (std::size_t i = k; i < msgs.size(); ++i)
        rest += "<|im_start|>" + msgs[i].role + "\n" + msgs[i].content + "<|im_end|>\n";
      std::vector<std::int32_t> joined = part;
      const auto tail = tok.encode(rest, false, true);
      joined.insert(joined.end(), tail.begin(), tail.end());
      CHECK(joined == all);
    }
  }

  SECTION("round trip on random UTF-8") {
    KVKIT_TEST_RNG(rng);
    for (int trial = 0; trial < 300; ++trial) {
      const std::string s = random_utf8(rng, 1 + static_cast<int>(rng() % 200));
      INFO("trial " << trial);
      CHECK(tok.decode(tok.encode(s, false, false)) == covered_bytes(tok, s));
      CHECK(tok.decode(tok.encode(s, true, true)) == covered_bytes(tok, s));
    }
  }
}
