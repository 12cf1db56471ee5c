#!/usr/bin/env python3
"""Records llama.cpp's greedy continuations of SmolLM2-135M-Instruct as a test fixture.

Writes tests/fixtures/smollm2_greedy.json: for five ChatML prompts (default system message,
one user turn, the assistant turn opened), the prompt's token ids as llama.cpp tokenizes it
and the 128 tokens llama.cpp then picks greedily (argmax of its logits, EOS not treated
specially), with llama.cpp's margin (top-1 minus top-2 logit) at each of them. tests/test_llamacpp_agreement.cpp
teacher-forces kvkit's engine on prompt + continuation and compares kvkit's top-1 with
llama.cpp's at the 640 positions (the issue's goal: >= 98 %; near-ties may flip). llama.cpp runs
with its defaults here: f16 K/V cache, flash attention off, the prompt in one batch (n_batch 512).

It then teacher-forces llama.cpp itself on the same 640 positions run two other ways and stores
how often its top-1 still matches the recorded tokens ("llama_cpp_self_agreement"): with the prompt
fed one token at a time (n_batch 1), and with prompt + continuation in one batch. Same weights,
same file, same machine; only the order of float operations differs (batched matmuls take
llamafile's tinyBLAS kernels, single tokens ggml's vec_dot). That is the floor the test holds kvkit
to: agreeing with this run of llama.cpp as well as llama.cpp agrees with itself.

Needs llama-cpp-python 0.3.36 (scripts/setup-venv.sh makes a venv with it):
    /work/kvkit-venv/bin/python scripts/record-greedy-fixtures.py [--model M.gguf] [--out F.json]
"""
import argparse
import json
import os

import llama_cpp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.join(REPO, "tests", "fixtures", "smollm2_greedy.json")
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function merge_sort(items) that returns a new sorted list using merge sort.",
    "Design a small binary search tree API in Python with insert, contains and delete.",
    "I am planning a three-day trip to Lisbon in May. What should I see on the first day?",
    "Give me a simple recipe for tomato soup for four people.",
]
STEPS = 128


def chatml(user):
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args()
    # logits_all: llm.scores holds the logits of every evaluated position (else zeros).
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=1024, n_threads=1, n_batch=512, logits_all=True,
                          verbose=False)
    cases = []
    for text in PROMPTS:
        prompt = llm.tokenize(chatml(text).encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(prompt)
        cont, margins = [], []  # margins: llama.cpp's top-1 minus top-2 logit
        for _ in range(STEPS):
            logits = np.asarray(llm.scores[llm.n_tokens - 1])
            tok = int(np.argmax(logits))
            top2 = np.partition(logits, -2)[-2:]
            cont.append(tok)
            margins.append(round(float(top2[1] - top2[0]), 4))
            llm.eval([tok])
        cases.append({"user": text, "prompt": [int(t) for t in prompt], "continuation": cont,
                      "margins": margins,
                      "text": llm.detokenize(cont).decode("utf-8", errors="replace")})
    # llama.cpp against itself: the same positions, run two other ways.
    self_agree = {}
    for mode, n_batch in (("prompt_one_token_at_a_time", 1), ("prompt_and_continuation_in_one_batch", 512)):
        other = llama_cpp.Llama(model_path=a.model, n_ctx=1024, n_threads=1, n_batch=n_batch,
                                logits_all=True, verbose=False)
        counts = []
        for c in cases:
            p, cont = c["prompt"], c["continuation"]
            other.reset()
            other.eval(p + cont[:-1])
            top1 = np.asarray(other.scores[len(p) - 1:len(p) + STEPS - 1]).argmax(axis=1)
            counts.append(int((top1 == np.asarray(cont)).sum()))
        self_agree[mode] = counts
        print(f"llama.cpp, {mode}: {sum(counts)}/{STEPS * len(cases)} agree with the recorded tokens")
    fixture = {
        "description": "llama.cpp greedy continuations of SmolLM2-135M-Instruct.Q4_1.gguf "
                       "(scripts/record-greedy-fixtures.py)",
        "llama_cpp_python": llama_cpp.__version__,
        "steps": STEPS,
        "cases": cases,
        "llama_cpp_self_agreement": self_agree,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(fixture, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {a.out}")


if __name__ == "__main__":
    main()
