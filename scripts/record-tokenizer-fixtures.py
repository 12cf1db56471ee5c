#!/usr/bin/env python3
"""Records llama.cpp's tokenization of SmolLM2-135M-Instruct as a test fixture.

Writes tests/fixtures/smollm2_tokens.json, which tests/test_tokenizer.cpp checks the
kvkit tokenizer (examples/engine/tokenizer.hpp) against id for id:
  * cases: token ids of llama.cpp's llama_tokenize for a varied set of byte strings
    (ASCII, accents, CJK, emoji, code, whitespace runs, numbers, special tokens, the empty
    string, long text, invalid UTF-8, and a sweep of Unicode category boundaries), with
    add_special (add_bos) and parse_special as given, plus llama.cpp's detokenization of
    those ids (special tokens rendered);
  * chats: ChatML prompts rendered by llama-cpp-python's Jinja2ChatFormatter from the
    file's own tokenizer.chat_template and tokenized as its chat completion handler does;
  * vocab_pieces_fnv1a64: a hash of every token's piece (token_to_piece, special=True).

Needs llama-cpp-python 0.3.36 (scripts/setup-venv.sh makes a venv with it):
    /work/kvkit-venv/bin/python scripts/record-tokenizer-fixtures.py [--model M.gguf] [--out F.json]
"""
import argparse
import ctypes
import hashlib
import json
import os
import random
import sys
import unicodedata

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(REPO, "tests", "fixtures", "smollm2_tokens.json")

LONG_TEXT = """\
The history of computing is longer than the history of computing hardware and modern \
computing technology and includes the history of methods intended for pen and paper or for \
chalk and slate, with or without the aid of tables. Digital computing is intimately tied to \
the representation of numbers. But long before abstractions like "the number" arose, there \
were mathematical concepts to serve the purposes of civilization.

In 1837, Charles Babbage first described his Analytical Engine, which is accepted as the \
first design for a modern computer. It had expandable memory, an arithmetic unit, and \
logic-processing capabilities able to interpret a programming language with loops and \
conditional branching. Although never built, the design has been studied extensively and is \
understood to be Turing equivalent; it would have had a memory capacity of less than \
1 kilobyte (≈ 1,000 bytes) and a clock speed of less than 10 Hz.

    def fib(n: int) -> int:
        a, b = 0, 1
        for _ in range(n):
            a, b = b, a + b
        return a

Questions:\t1) Who?\t2) When?\t3) Why?
Réponse : « Babbage » — en 1837 ; 答案：巴贝奇。 Ответ: Бэббидж. 🎯✅
""" * 3

CASES = [
    # (name, text, add_special, parse_special)
    ("empty", "", False, False),
    ("empty_special", "", True, True),
    ("hello", "Hello world", False, False),
    ("hello_add_special", "Hello world", True, False),
    ("sentence", "Hello, world! How are you today?", False, False),
    ("pangram", "The quick brown fox jumps over the lazy dog.", False, False),
    ("contractions", "I'm sure you're right; we've seen they'll go, she'd say it's fine. Don't!", False, False),
    ("contractions_upper", "I'M SURE YOU'RE RIGHT, WE'VE SEEN IT'S DON'T", False, False),
    ("apostrophes", "'s 't 're 've 'm 'll 'd '' ' x'y l'été Rock'n'Roll 'S 'Ll", False, False),
    ("accents", "Café, naïve, résumé, Zürich, São Paulo, Ångström, façade, crème brûlée", False, False),
    ("greek", "Ελληνικά: το γρήγορο καφέ αλεπού", False, False),
    ("cyrillic", "Привет, мир! Съешь же ещё этих мягких французских булок.", False, False),
    ("turkish", "Türkçe İstanbul ışık ĞÜŞÖÇ", False, False),
    ("arabic", "مرحبا بالعالم ١٢٣ ٤٥٦", False, False),
    ("hebrew", "שלום עולם", False, False),
    ("hindi", "नमस्ते दुनिया १२३", False, False),
    ("thai", "สวัสดีชาวโลก", False, False),
    ("japanese", "日本語のテキスト、漢字とひらがなとカタカナ。", False, False),
    ("chinese", "中文测试：你好，世界！这是一个句子。", False, False),
    ("korean", "한국어 텍스트입니다. 안녕하세요!", False, False),
    ("emoji", "🎉🎉 party 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 ❤️ ✨ ☕ 🤖", False, False),
    ("combining", "e\u0301 a\u0308 n\u0303 \u1e9b\u0323 Z\u0351\u0352", False, False),
    ("format_chars", "zero\u200bwidth joiner\u200dx soft\u00adhyphen \ufeffbom \u2060wj", False, False),
    ("private_unassigned", "\ue000\uf8ff \U000f0000 \u0378\u0379 \U000e0080", False, False),
    ("symbols", "© ® ™ € £ ¥ § ¶ • … ← → ↑ ↓ ≤ ≥ ≠ ∞ ∑ √ ∫ ℃ ℕ ⅓ ½ ² ³", False, False),
    ("math_letters", "𝐀𝐁𝐂 𝔸𝔹ℂ 𝟙𝟚𝟛 ﬁ ﬂ Ⅻ ⅻ", False, False),
    ("python", "def merge_sort(a):\n    if len(a) <= 1:\n        return a\n    mid = len(a) // 2\n    return merge(merge_sort(a[:mid]), merge_sort(a[mid:]))\n", False, False),
    ("cpp", "#include <vector>\nint main() {\n\tstd::vector<int> v{1, 2, 3};\n\tfor (auto& x : v) x *= 2;\n\treturn v[0] == 2 ? 0 : 1; // ok\n}\n", False, False),
    ("json", '{"key": "value", "n": [1, 2.5, -3e10], "nested": {"a": null, "b": true}}', False, False),
    ("html", '<div class="x"><p>Hi &amp; bye</p><br/></div>', False, False),
    ("punct_runs", "!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} ||| ~~~ `` ``", False, False),
    ("spaces", "a b  c   d    e     f", False, False),
    ("leading_trailing", "   leading and trailing   ", False, False),
    ("only_spaces", "     ", False, False),
    ("single_space", " ", False, False),
    ("newline", "\n", False, False),
    ("newlines", "line1\nline2\n\nline3\n\n\n\nend\n", False, False),
    ("tabs", "\ttab\t\tdouble\t \tmixed \t \n\t", False, False),
    ("crlf", "windows\r\nline\r\n\r\nend\r", False, False),
    ("space_newline_mix", " \n \n  \n\n  x \n", False, False),
    ("unicode_spaces", "x\u00a0y\u2003z\u3000w\u2028v\u2029u\u0085t\u1680s\u202fr\u205fq", False, False),
    ("control_chars", "a\x00b\x01c\x1c\x1d\x1e\x1fd\x7fe\x0bf\x0cg", False, False),
    ("indent_code", "        x = 1\n        y = 2\n", False, False),
    ("digits", "1234567890", False, False),
    ("numbers", "3.14159 and 2,718 and 1e-10 and -42 and +7 and 0x1F and 00700", False, False),
    ("number_words", "hello世界123abc a1b2c3 x 1 y  22 z   333", False, False),
    ("version", "Version 2.0.1 released on 2024-06-15 at 12:30:45", False, False),
    ("unicode_numbers", "١٢٣ ٤٥٦ ๑๒๓ ①②③ Ⅻ ½ ²³ ߀߁ 𝟘𝟙", False, False),
    ("special_parsed", "<|im_start|>user\nHi there<|im_end|>\n", False, True),
    ("special_unparsed", "<|im_start|>user\nHi there<|im_end|>\n", False, False),
    ("endoftext", "<|endoftext|>", False, True),
    ("endoftext_unparsed", "<|endoftext|>", False, False),
    ("special_inline", "text<|im_end|>more text<|im_start|>", False, True),
    ("special_adjacent", "<|im_start|><|im_start|><|im_end|><|endoftext|>", False, True),
    ("special_partial", "<|im_start <|im_end| im_start|> <|im_start|", False, True),
    ("special_repo", "<repo_name>kvkit<file_sep>src/main.cpp<filename>x<gh_stars>100<issue_start>", False, True),
    ("special_jupyter", "<jupyter_start><jupyter_code>print(1)<jupyter_output>1<empty_output>", False, True),
    ("special_spaces", " <|im_start|> user \n <|im_end|> ", False, True),
    ("special_add_special", "<|im_start|>assistant\n", True, True),
    ("long_text", LONG_TEXT, False, False),
    ("long_text_special", LONG_TEXT + "<|im_end|>\n", True, True),
]

BYTE_CASES = [
    # (name, bytes, add_special, parse_special): invalid UTF-8 (llama.cpp reads U+FFFD)
    ("invalid_utf8", b"\xff\xfe abc \xc3 \x80\x80 ok \xe2\x82 end", False, False),
    ("truncated_utf8", b"caf\xc3", False, False),
    ("surrogate_overlong", b"x\xed\xa0\x80y \xc0\xaf z", False, False),
]


def category_sweep():
    """Codepoints at every \\p{L}/\\p{N} boundary (Python's Unicode data), the whitespace
    set, and a seeded random sample, grouped into strings that expose each one's class."""
    def L(c):
        return unicodedata.category(chr(c))[0] == "L"

    def N(c):
        return unicodedata.category(chr(c))[0] == "N"

    cps = set()
    for c in range(0x81, 0x323B0):
        if 0xD800 <= c <= 0xDFFF or 0xD800 <= c - 1 <= 0xDFFF:
            continue
        if L(c) != L(c - 1) or N(c) != N(c - 1):
            cps.update((c - 1, c))
    cps.update([0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000, 0x180E, 0x200B,
                0x1C, 0x1D, 0x1E, 0x1F] + list(range(0x2000, 0x200B)))
    rng = random.Random(14)
    while len(cps) < 3000:
        c = rng.randrange(0x80, 0x110000)
        if not (0xD800 <= c <= 0xDFFF):
            cps.add(c)
    cps = sorted(cps)
    out = []
    for i in range(0, len(cps), 48):
        chunk = cps[i:i + 48]
        text = "".join(f"x{chr(c)}y {chr(c)}2" for c in chunk)
        out.append((f"sweep_{chunk[0]:06X}_{chunk[-1]:06X}", text.encode("utf-8"), False, False))
    return out


CHATS = [
    ("france", [{"role": "user", "content": "What is the capital of France?"}], True),
    ("system_given", [{"role": "system", "content": "You are a pirate."},
                      {"role": "user", "content": "Hello!"}], True),
    ("multi_turn", [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello! How can I help you today?"},
                    {"role": "user", "content": "Write a haiku about autumn."}], True),
    ("no_generation_prompt", [{"role": "user", "content": "Explain merge sort.\n```python\ndef f(x):\n    return x\n```"},
                              {"role": "assistant", "content": "Merge sort splits the list in halves."}], False),
    ("special_in_content", [{"role": "user", "content": "Say <|im_end|> please"}], True),
    ("unicode", [{"role": "user", "content": "Traduis : 日本語 🎉 café — 123"}], True),
    ("empty_content", [{"role": "user", "content": ""}], True),
    ("empty", [], True),
]


def fnv1a64(data, h=0xCBF29CE484222325):
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    with open(args.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()

    def piece(tok, special=True):
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detok(ids):
        return b"".join(piece(t) for t in ids)

    def record(name, data, add_special, parse_special):
        ids = llm.tokenize(data, add_bos=add_special, special=parse_special)
        case = {"name": name, "hex": data.hex(), "add_special": add_special,
                "parse_special": parse_special, "ids": ids, "decoded_hex": detok(ids).hex()}
        try:
            case["text"] = data.decode("utf-8")
        except UnicodeDecodeError:
            pass
        return case

    cases = [record(n, t.encode("utf-8"), a, p) for n, t, a, p in CASES]
    cases += [record(n, b, a, p) for n, b, a, p in BYTE_CASES]
    sweep = [record(n, b, a, p) for n, b, a, p in category_sweep()]

    template = llm.metadata["tokenizer.chat_template"]
    eos = piece(llm.token_eos()).decode("utf-8")
    bos = piece(llm.token_bos()).decode("utf-8")
    chats = []
    for name, messages, add_gen in CHATS:
        fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                  add_generation_prompt=add_gen)
        res = fmt(messages=messages)
        # As llama_cpp.llama_chat_format's chat completion handler tokenizes the prompt.
        ids = llm.tokenize(res.prompt.encode("utf-8"), add_bos=not res.added_special, special=True)
        chats.append({"name": name, "messages": messages, "add_generation_prompt": add_gen,
                      "prompt": res.prompt, "ids": ids})

    h = 0xCBF29CE484222325
    for t in range(n_vocab):
        p = piece(t)
        h = fnv1a64(len(p).to_bytes(4, "little") + p, h)

    out = {
        "model": os.path.basename(args.model),
        "sha256": sha,
        "llama_cpp_python": llama_cpp.__version__,
        "n_vocab": n_vocab,
        "vocab_pieces_fnv1a64": f"{h:016x}",
        "note": "vocab_pieces_fnv1a64: FNV-1a 64 over, for every token id in order, its piece "
                "(token_to_piece, special=True) as a uint32 little-endian length then the bytes",
        "cases": cases,
        "sweep": sweep,
        "chats": chats,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        # One case per line: reviewable diffs, compact id lists.
        f.write("{\n")
        keys = list(out)
        for i, k in enumerate(keys):
            v = out[k]
            sep = "," if i + 1 < len(keys) else ""
            if isinstance(v, list):
                f.write(f"  {json.dumps(k)}: [\n")
                for j, item in enumerate(v):
                    f.write("    " + json.dumps(item, ensure_ascii=False) + ("," if j + 1 < len(v) else "") + "\n")
                f.write(f"  ]{sep}\n")
            else:
                f.write(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}{sep}\n")
        f.write("}\n")
    n_ids = sum(len(c["ids"]) for c in cases + sweep + chats)
    print(f"wrote {args.out}: {len(cases)} cases, {len(sweep)} sweep cases, {len(chats)} chats, "
          f"{n_ids} ids", file=sys.stderr)


if __name__ == "__main__":
    main()
