#!/usr/bin/env python3
"""SmolLM2-135M-Instruct decode and prefill speed: kvkit's example engine against llama.cpp.

Both run on the same GGUF file, the same prompt text (long documents of the prompt suite,
cut to about 1K and 4K tokens), the same thread counts and the same machine, in one run of
this script. kvkit runs through its CLI (`kvkit generate --model M.gguf --prompt-file F
--max-tokens N --json`), which reports decode and prefill tokens/s; llama.cpp runs through
llama-cpp-python (the project venv: scripts/setup-venv.sh), timed here: prefill = one
evaluation of the prompt (until the first token), decode = N further greedy tokens.

Usage: ../kvkit-venv/bin/python bench/smollm2_vs_llamacpp.py --cli build/examples/kvkit \
           [--baseline-cli OLD/kvkit] [--model PATH] [--threads 1 2] [--contexts 1024 4096]
           [--decode 64] [--repeat 1] [--kv-dtypes float32 float16 bfloat16]
--kv-dtypes runs kvkit once per element type of its K/V pages (`generate --kv-dtype`), a
row each beside the same llama.cpp run (llama.cpp's default KV cache is float16).
--baseline-cli adds the decode tokens/s of another kvkit build (e.g. main before a change)
to every row, run in the same loop. --repeat N runs every measurement N times and keeps the
best (highest tokens/s) of each, which filters out bursts of load from other processes.
Prints a Markdown table (the format of bench/RESULTS.md) and, with --json, the raw rows.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_model():
    return os.path.join(ROOT, "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def suite_text(min_tokens, tokenize):
    """The shortest long-document prompt of the suite with at least min_tokens tokens,
    cut (at a token boundary, re-encoded as text) to about min_tokens tokens."""
    with open(os.path.join(ROOT, "examples", "prompts", "suite.json")) as f:
        prompts = json.load(f)["prompts"]
    docs = sorted((p for p in prompts if p["kind"] == "long_doc"), key=lambda p: p["tokens"])
    for p in docs:
        text = p["turns"][0]
        if len(tokenize(text)) >= min_tokens:
            return text
    return docs[-1]["turns"][0]


def cut_text(text, n_tokens, tokenize, detokenize):
    ids = tokenize(text)[:n_tokens]
    return detokenize(ids)


def run_kvkit(cli, model, text, threads, decode, kv_dtype=None):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        out = subprocess.run(
            [cli, "generate", "--model", model, "--prompt-file", path, "--max-tokens", str(decode),
             "--threads", str(threads), "--json"] + (["--kv-dtype", kv_dtype] if kv_dtype else []),
            check=True, capture_output=True, text=True)
    finally:
        os.unlink(path)
    j = json.loads(out.stdout)
    return {"prompt_tokens": len(j["prompt_tokens"]) if isinstance(j["prompt_tokens"], list) else j["prompt_tokens"],
            "decode_tps": j["tokens_per_s"], "prefill_tps": j["prefill_tokens_per_s"]}


def run_llamacpp(llama_cls, model, ids, threads, decode):
    """Greedy generate(): the first token arrives after the prompt's evaluation (prefill),
    the rest one evaluation each (decode)."""
    llm = llama_cls(model_path=model, n_ctx=len(ids) + decode + 16, n_threads=threads,
                    n_threads_batch=threads, n_batch=512, verbose=False)
    t0 = time.perf_counter()
    t_first = None
    n = 0
    for _ in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                          reset=True):
        n += 1
        if t_first is None:
            t_first = time.perf_counter()
        if n == decode + 1:
            break
    t_end = time.perf_counter()
    return {"prompt_tokens": len(ids), "prefill_tps": len(ids) / (t_first - t0),
            "decode_tps": (n - 1) / (t_end - t_first)}


def best(runs):
    """Each figure's best (highest tokens/s) over repeated runs."""
    out = dict(runs[0])
    for key in ("decode_tps", "prefill_tps"):
        out[key] = max(r[key] for r in runs)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cli", required=True, help="path of the kvkit CLI binary")
    ap.add_argument("--baseline-cli", help="another kvkit CLI build to compare (before/after)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement; the best is kept")
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--kv-dtypes", nargs="+", default=None,
                    help="kvkit K/V page types (float32 float16 bfloat16); default: the CLI's default")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama_cpp not importable: run with the project venv (scripts/setup-venv.sh)")
    if not os.path.isfile(a.model):
        sys.exit(f"no model file {a.model} (scripts/fetch-model.sh)")

    vocab = Llama(model_path=a.model, vocab_only=True, verbose=False)
    tok = lambda s: vocab.tokenize(s.encode(), add_bos=False, special=True)
    detok = lambda ids: vocab.detokenize(ids).decode("utf-8", errors="ignore")
    rows = []
    for ctx in a.contexts:
        text = cut_text(suite_text(ctx, tok), ctx, tok, detok)
        ids = tok(text)
        dtypes = a.kv_dtypes or [None]
        for t in a.threads:
            ks, ls, bs = {d: [] for d in dtypes}, [], []
            for _ in range(a.repeat):
                for d in dtypes:
                    ks[d].append(run_kvkit(a.cli, a.model, text, t, a.decode, d))
                ls.append(run_llamacpp(Llama, a.model, ids, t, a.decode))
                if a.baseline_cli:
                    bs.append(run_kvkit(a.baseline_cli, a.model, text, t, a.decode))
            for d in dtypes:
                row = {"context": len(ids), "threads": t, "kv_dtype": d or "default", "kvkit": best(ks[d]),
                       "llama_cpp": best(ls)}
                if bs:
                    row["baseline"] = best(bs)
                rows.append(row)
                k, l = row["kvkit"], row["llama_cpp"]
                print(f"ctx {len(ids)} T{t} kv {row['kv_dtype']}: kvkit decode {k['decode_tps']:.1f} prefill "
                      f"{k['prefill_tps']:.1f} | llama.cpp decode {l['decode_tps']:.1f} prefill "
                      f"{l['prefill_tps']:.1f}" + (f" | baseline decode {row['baseline']['decode_tps']:.1f}"
                                                   if bs else ""), file=sys.stderr)
    base = bool(a.baseline_cli)
    print("| prompt tokens | threads | kvkit KV | kvkit decode tok/s | llama.cpp decode tok/s | ratio | " +
          ("baseline kvkit decode tok/s | after / before | " if base else "") +
          "kvkit prefill tok/s | llama.cpp prefill tok/s | ratio |")
    print("|---|---|---|---|---|---|" + ("---|---|" if base else "") + "---|---|---|")
    for r in rows:
        k, l = r["kvkit"], r["llama_cpp"]
        extra = ""
        if base:
            b = r["baseline"]
            extra = f"{b['decode_tps']:.1f} | {k['decode_tps'] / b['decode_tps']:.2f} | "
        print(f"| {r['context']} | {r['threads']} | {r['kv_dtype']} | {k['decode_tps']:.1f} | {l['decode_tps']:.1f} | "
              f"{k['decode_tps'] / l['decode_tps']:.2f} | {extra}{k['prefill_tps']:.1f} | "
              f"{l['prefill_tps']:.1f} | {k['prefill_tps'] / l['prefill_tps']:.2f} |")
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
