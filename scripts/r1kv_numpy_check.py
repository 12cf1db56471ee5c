#!/usr/bin/env python3
"""Cross-check `kvkit r1kv` against a small float64 NumPy implementation of the R1KV
spec (../shared/specs/r1kv.md, summarised at the top of include/kvkit/compressor/r1kv.hpp).

Not part of the test suite (the suite stays C++: tests/test_cli_r1kv.cpp). Usage, with
NumPy installed (e.g. scripts/setup-venv.sh):

    python3 scripts/r1kv_numpy_check.py --kvkit build/examples/kvkit [--trials 20]

For random [1, Hkv, S, D] keys (with planted near-duplicates) and [1, Hq, Lq, D] queries it
writes .npy files, runs `kvkit r1kv` in reference and positional order, and compares the
kept slots with this implementation: exact equality, except where two scores are within
1e-6 relative (float32 vs float64 near-ties), which are reported separately.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np


def r1kv_keep(k, q, budget, window=8, kernel=7, lam=0.07, thr=0.5, positional=False):
    """k: [Hkv, S, D], q: [Hq, Lq, D] (float64). Returns ([Hkv, n] kept slots, scores)."""
    hkv, s, d = k.shape
    hq, lq, _ = q.shape
    if s < budget:
        return np.tile(np.arange(s), (hkv, 1)), None
    g = hq // hkv
    nc = s - window
    rows = min(window, lq)
    out, scores = [], []
    for h in range(hkv):
        kh = k[h]
        qh = q[h * g:(h + 1) * g, lq - rows:, :]                     # [G, R, D]
        logits = np.einsum("grd,jd->grj", qh, kh[:nc]).max(axis=0) / np.sqrt(d)  # [R, nc]
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        a = p.mean(axis=0)
        half = kernel // 2
        imp = np.array([a[max(0, j - half):min(nc, j + half + 1)].max() for j in range(nc)])
        n = kh / (np.linalg.norm(kh, axis=1, keepdims=True) + 1e-8)
        c = n @ n.T
        np.fill_diagonal(c, 0.0)
        for i in range(s):
            above = np.nonzero(c[i] > thr)[0]
            c[i, above.max() if above.size else 0] = 0.0
        m = c.sum(axis=0) / s
        rd = np.exp(m - m.max())
        rd /= rd.sum()
        z = lam * imp - (1 - lam) * rd[:nc]
        order = sorted(range(nc), key=lambda j: (-z[j], j))[:budget - window]
        if positional:
            order = sorted(order)
        keep = list(order) + list(range(nc, s))
        if positional:
            keep = sorted(keep)
        out.append(keep)
        scores.append(z)
    return np.array(out), scores


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvkit", required=True, help="path of the built kvkit binary")
    ap.add_argument("--trials", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(2026)
    exact = near = bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        f = lambda name: os.path.join(tmp, name)
        for trial in range(args.trials):
            hkv, g, d = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4])), int(rng.choice([8, 16, 32]))
            s, lq = int(rng.integers(24, 200)), int(rng.integers(1, 12))
            budget = int(rng.integers(9, s + 1))
            k = rng.standard_normal((1, hkv, s, d)).astype(np.float32)
            for j in range(5, s, 5):  # planted near-duplicates
                k[0, :, j] = k[0, :, j - 1] + 0.01 * rng.standard_normal((hkv, d))
            q = rng.standard_normal((1, hkv * g, lq, d)).astype(np.float32)
            np.save(f("k.npy"), k)
            np.save(f("v.npy"), k)
            np.save(f("q.npy"), q)
            for positional in (False, True):
                cmd = [args.kvkit, "r1kv", "--keys", f("k.npy"), "--queries", f("q.npy"),
                       "--values", f("v.npy"), "--budget", str(budget), "--out", f("kept.npy"),
                       "--order", "positional" if positional else "reference"]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                got = np.load(f("kept.npy"))[0]
                want, z = r1kv_keep(k[0].astype(np.float64), q[0].astype(np.float64), budget,
                                    positional=positional)
                if np.array_equal(got, want):
                    exact += 1
                    continue
                # Differences only between near-tied scores count as near-ties.
                tie = z is not None and all(
                    np.allclose(np.sort(z[h][[j for j in set(got[h]) ^ set(want[h]) if j < s - 8]])[:1],
                                np.sort(z[h][[j for j in set(got[h]) ^ set(want[h]) if j < s - 8]])[-1:],
                                rtol=1e-6, atol=1e-12)
                    for h in range(hkv))
                if tie:
                    near += 1
                else:
                    bad += 1
                    print(f"trial {trial} positional={positional}: mismatch (Hkv {hkv} S {s} "
                          f"budget {budget})", file=sys.stderr)
    print(f"{exact} exact, {near} near-tie differences, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
