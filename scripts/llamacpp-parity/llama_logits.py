#!/usr/bin/env python3
"""llama.cpp's logits at the 640 teacher-forced positions of tests/fixtures/smollm2_greedy.json,
and the distance between two such logit files (issue 14's agreement criterion, diagnosed).

    PY=../kvkit-venv/bin/python   # llama-cpp-python 0.3.36 (scripts/setup-venv.sh)
    $PY scripts/llamacpp-parity/llama_logits.py dump OUT.npy [--n-batch 512|1] [--one-batch]
    $PY scripts/llamacpp-parity/llama_logits.py compare A.npy B.npy

dump: the prompt is evaluated in batches of --n-batch tokens (512: as the fixture was recorded;
1: one token at a time), then the continuation one token at a time, teacher-forced on the
fixture's tokens; --one-batch evaluates prompt + continuation in one call instead. Writes
[5, 128, vocab] float32 (about 126 MB). compare: each file's top-1 agreement with the
fixture's tokens, the rms and max |difference| of the logits, and every position where A's
top-1 differs from the fixture (A's lead, the fixture's recorded margin).
"""
import argparse
import json
import os

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "smollm2_greedy.json")
MODEL = os.path.join(REPO, "..", "shared", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def dump(a, fx):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=1024, n_threads=1, n_batch=a.n_batch, logits_all=True,
                          verbose=False)
    out = []
    for c in fx["cases"]:
        p, cont = c["prompt"], c["continuation"]
        llm.reset()
        if a.one_batch:
            llm.eval(p + cont[:-1])
            out.append(np.asarray(llm.scores[len(p) - 1:len(p) + len(cont) - 1], np.float32))
        else:
            llm.eval(p)
            rows = []
            for t in cont:
                rows.append(np.asarray(llm.scores[llm.n_tokens - 1], np.float32))
                llm.eval([t])
            out.append(np.stack(rows))
    out = np.stack(out)
    np.save(a.out, out)
    cont = np.array([c["continuation"] for c in fx["cases"]])
    print(f"wrote {a.out}: top-1 agrees with the fixture at {(out.argmax(-1) == cont).sum()}/{cont.size}")


def compare(a, fx):
    cont = np.array([c["continuation"] for c in fx["cases"]])
    margins = np.array([c["margins"] for c in fx["cases"]])
    A, B = np.load(a.a, mmap_mode="r"), np.load(a.b, mmap_mode="r")
    sq, mx = 0.0, 0.0
    for c in range(cont.shape[0]):
        d = np.asarray(A[c], np.float64) - np.asarray(B[c], np.float64)
        sq += float((d * d).sum())
        mx = max(mx, float(np.abs(d).max()))
    n = cont.size * A.shape[-1]
    ta, tb = np.asarray(A).argmax(-1), np.asarray(B).argmax(-1)
    print(f"{a.a}: {(ta == cont).sum()}/{cont.size} agree with the fixture; {a.b}: {(tb == cont).sum()}/{cont.size}")
    print(f"logits: rms difference {np.sqrt(sq / n):.4f}, max |difference| {mx:.4f}, "
          f"rms of B {float(np.sqrt(np.mean(np.square(np.asarray(B[0], np.float64))))):.3f} (case 0)")
    for c, i in zip(*np.nonzero(ta != cont)):
        lead = float(A[c, i, ta[c, i]] - A[c, i, cont[c, i]])
        print(f"  case {c} pos {i}: A picks {ta[c, i]} by {lead:.4f}; fixture margin {margins[c, i]:.4f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--n-batch", type=int, default=512)
    d.add_argument("--one-batch", action="store_true")
    d.add_argument("--model", default=MODEL)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    a = ap.parse_args()
    with open(FIXTURE) as f:
        fx = json.load(f)
    dump(a, fx) if a.cmd == "dump" else compare(a, fx)


if __name__ == "__main__":
    main()
