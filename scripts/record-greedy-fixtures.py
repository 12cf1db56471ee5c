#!/usr/bin/env python3
"""Records llama.cpp's greedy continuations of SmolLM2-135M-Instruct as a test fixture.

Writes tests/fixtures/smollm2_greedy.json: for five ChatML prompts (default system message,
one user turn, the assistant turn opened), the prompt's token ids as llama.cpp tokenizes it
and the 128 tokens llama.cpp then picks greedily (argmax of its logits, EOS not treated
specially), with llama.cpp's margin (top-1 minus top-2 logit) at each of them. tests/test_llamacpp_agreement.cpp
teacher-forces kvkit's engine on prompt + continuation and compares kvkit's top-1 with
llama.cpp's at the 640 positions (the issue's goal: >= 98 %; near-ties may flip). llama.cpp runs
with its defaults here: f16 K/V cache, flash attention off, the prompt in one batch (n_batch 512).

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
    fixture = {
        "description": "llama.cpp greedy continuations of SmolLM2-135M-Instruct.Q4_1.gguf "
                       "(scripts/record-greedy-fixtures.py)",
        "llama_cpp_python": llama_cpp.__version__,
        "steps": STEPS,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(fixture, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {a.out}")


if __name__ == "__main__":
    main()
