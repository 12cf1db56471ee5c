#!/usr/bin/env python3
"""Quality of the Compressor policies (R1KV, SnapKV, StreamingLLM) at equal budgets.

Each workload prompt is one `kvkit sweep` run (examples/cli/cmd_sweep.hpp): the full-cache
engine runs once and its next tokens and logits are recorded; every policy x budget engine
is then teacher-forced with those tokens and compared with those logits (top-1 agreement,
KL), exactly what `kvkit generate --policy P --budget B --buffer U --compare-full --json`
gives for each run alone (tests/test_cli_sweep.cpp), at a fraction of the cost (one full
run and, for GGUF, one prompt prefill per prompt). Writes a markdown table (KV bytes saved
vs top-1 agreement and mean KL) and an SVG plot:

  smollm2     SmolLM2-135M-Instruct (GGUF), ChatML prompts: the long-document questions and
              code prompts of examples/prompts/suite.json (or text files); budgets
              256/512/1024, buffer 128, answers of up to --smol-max-tokens tokens ending at
              <|im_end|> (the full cache's greedy answer is the teacher-forced text). For
              prompts with an expected fact (answer_contains), --free-run lets each policy
              answer greedily on its own (no teacher forcing) and the fact is looked up in
              that answer.
  stories260K the llama2.c stories260K checkpoint, BOS prompt, 500 steps, budgets
              64/128/256, buffer 32.
  synthetic   the CLI's deterministic synthetic model (random weights, stories260K shape),
              511 steps (its seq_len is 512), budgets 32/64/128, buffer 32.

KV bytes saved = 1 - kv_bytes_final / full_kv_bytes_final (pages held at the end of the
run, policy engine vs full-cache engine). Every run gets --matvec (default float: the GGUF
projections in float32, so the numbers are the policy's own error, not int8 activation
rounding amplified by a changed summation order). A run whose cache never reaches budget + buffer
is the full cache exactly and is reported as such. Every sweep is cached under --cache (one
JSON per command line, --matvec included, so quantized and float results never mix), so an
interrupted report resumes where it stopped.

  /work/kvkit-venv/bin/python scripts/r1kv-quality-report.py --kvkit build/examples/kvkit \\
      [--smol-prompts doc-1,code-sudoku:256] [--smol-max-tokens 1024] [--matvec float] [--jobs 2]

Needs matplotlib (scripts/setup-venv.sh installs it) for the plot; the table is written
without it.
"""

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ["r1kv", "snapkv", "streaming"]
WINDOW = 8  # the policies' default query window (kvkit sweep --window)
LABELS = {"r1kv": "R1KV", "snapkv": "SnapKV", "streaming": "StreamingLLM", "full": "full cache"}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvkit", default=os.path.join(REPO, "build", "examples", "kvkit"),
                    help="the kvkit CLI binary")
    ap.add_argument("--models", default=os.path.join(REPO, "..", "shared", "models"),
                    help="folder with stories260K.bin and SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--workloads", default="synthetic,stories260K,smollm2",
                    help="comma-separated subset of synthetic,stories260K,smollm2")
    ap.add_argument("--smol-prompts", default="long_doc,code",
                    help="suite.json ids (first turn), suite kinds (long_doc, code: all its prompts) or "
                         "examples/prompts/<name>.txt, comma-separated; NAME:N answers N tokens instead "
                         "of --smol-max-tokens, NAME:N:F (or NAME::F) also F free-run tokens instead of "
                         "--fact-max-tokens")
    ap.add_argument("--smol-budgets", default="256,512,1024")
    ap.add_argument("--smol-buffer", type=int, default=128)
    ap.add_argument("--smol-max-tokens", type=int, default=1024,
                    help="answer tokens at most per run, ending at <|im_end|> (issue: up to 1K)")
    ap.add_argument("--fact-max-tokens", type=int, default=0,
                    help="tokens of the free-running answer checked for the expected fact "
                         "(default: the answer's --smol-max-tokens; -1: no free runs)")
    ap.add_argument("--stories-steps", type=int, default=500)
    ap.add_argument("--synthetic-steps", type=int, default=511)
    ap.add_argument("--matvec", choices=["quantized", "float"], default="float",
                    help="--matvec of each CLI run: float (default) measures the policies' own error; "
                         "quantized (int8 activations, the CLI's default) adds a rounding noise floor "
                         "once a policy changes the summation order (README, --matvec float). GGUF only: "
                         "stories260K and synthetic are float either way")
    ap.add_argument("--threads", type=int, default=1, help="--threads of each CLI run")
    ap.add_argument("--jobs", type=int, default=2, help="CLI runs at once")
    ap.add_argument("--cache", default="/tmp/kvkit-r1kv-quality", help="cached CLI results")
    ap.add_argument("--cached-only", action="store_true",
                    help="run nothing: report the configurations whose results are in --cache")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "r1kv_quality"),
                    help="output prefix: PREFIX.md, PREFIX.svg, PREFIX.json")
    return ap.parse_args()


class Runner:
    def __init__(self, kvkit, cache, cached_only=False):
        self.kvkit = kvkit
        self.cache = cache
        self.cached_only = cached_only
        os.makedirs(cache, exist_ok=True)

    def run(self, args):
        mode = args[args.index("--matvec") + 1] if "--matvec" in args else "quantized"
        key = mode + "-" + hashlib.sha1(json.dumps(args).encode()).hexdigest()[:20]
        path = os.path.join(self.cache, key + ".json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        if self.cached_only:
            raise RuntimeError("not run (--cached-only)")
        cmd = [self.kvkit] + args
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t0
        if p.returncode != 0:
            raise RuntimeError("failed (exit %d): %s\n%s" % (p.returncode, shlex.join(cmd), p.stderr[-2000:]))
        d = json.loads(p.stdout)
        if d.get("matvec", mode) != mode:
            raise RuntimeError("asked --matvec %s, the CLI ran %s: %s" % (mode, d.get("matvec"), shlex.join(cmd)))
        d["_command"] = shlex.join(["kvkit"] + args)
        d["_wall_s"] = wall
        with open(path, "w") as f:
            json.dump(d, f)
        print("  %6.1f s  %s" % (wall, d["_command"]), file=sys.stderr, flush=True)
        return d


def smol_prompts(names, cache):
    """(id, prompt file, expected strings, answer tokens or None, free-run tokens or None) for each
    name[:tokens[:free tokens]]."""
    with open(os.path.join(REPO, "examples", "prompts", "suite.json")) as f:
        suite = {p["id"]: p for p in json.load(f)["prompts"]}
    known_facts = {"report_770": ["2013"]}  # the reservoir question of report_770.txt
    items = []
    for item in [n for n in names.split(",") if n]:
        name, _, tokens = item.partition(":")
        kind = [p["id"] for p in suite.values() if p.get("kind") == name]
        items += [k + (":" + tokens if tokens else "") for k in kind] if kind else [item]
    out = []
    for item in items:
        name, _, tokens = item.partition(":")
        tokens, _, free = tokens.partition(":")
        tokens = int(tokens) if tokens else None
        free = int(free) if free else None
        if name in suite:
            text = suite[name]["turns"][0]
            facts = suite[name]["answer_contains"] if len(suite[name]["turns"]) == 1 else []
            path = os.path.join(cache, "prompt-%s.txt" % name)
            with open(path, "w") as f:
                f.write(text)
        else:
            path = os.path.join(REPO, "examples", "prompts", name + ".txt")
            if not os.path.exists(path):
                sys.exit("r1kv-quality-report: no prompt '%s' (suite id or examples/prompts/*.txt)" % name)
            facts = known_facts.get(name, [])
        out.append((name, path, facts, tokens, free))
    return out


def plan(a):
    """One sweep per workload prompt: dict(workload, prompt, budgets, facts, args)."""
    sweeps = []
    stories = os.path.join(a.models, "stories260K.bin")
    gguf = os.path.join(a.models, "SmolLM2-135M-Instruct.Q4_1.gguf")
    work = a.workloads.split(",")
    pols = ["--policies", ",".join(POLICIES)]
    common = ["--matvec", a.matvec, "--threads", str(a.threads), "--json"]
    if "synthetic" in work:
        sweeps.append(dict(workload="synthetic", prompt="BOS", budgets=[32, 64, 128], facts=[],
                           args=["sweep", "--prompt", "1", "--steps", str(a.synthetic_steps)] + pols +
                           ["--budgets", "32,64,128", "--buffer", "32"] + common))
    if "stories260K" in work:
        sweeps.append(dict(workload="stories260K", prompt="BOS", budgets=[64, 128, 256], facts=[],
                           args=["sweep", "--model", stories, "--prompt", "1", "--steps", str(a.stories_steps)] +
                           pols + ["--budgets", "64,128,256", "--buffer", "32"] + common))
    if "smollm2" in work:
        budgets = [int(x) for x in a.smol_budgets.split(",")]
        for name, path, facts, tokens, free in smol_prompts(a.smol_prompts, a.cache):
            answer = tokens or a.smol_max_tokens
            args = ["sweep", "--model", gguf, "--prompt-file", path, "--chat", "--stop-at-eos",
                    "--max-tokens", str(answer)] + pols + [
                        "--budgets", ",".join(map(str, budgets)), "--buffer", str(a.smol_buffer)]
            if facts and a.fact_max_tokens >= 0:
                args += ["--free-run", "--free-max-tokens", str(free or a.fact_max_tokens or answer)]
            sweeps.append(dict(workload="smollm2", prompt=name, budgets=budgets, facts=facts,
                               max_tokens=answer, args=args + common))
    return sweeps


def generate_command(sw, pol, budget):
    """The `kvkit generate --compare-full` command line one run of a sweep equals."""
    args, out, i = sw["args"], ["kvkit", "generate"], 1
    while i < len(args):
        k = args[i]
        if k in ("--policies", "--budgets"):
            i += 2
            continue
        if k in ("--free-run",):
            i += 1
            continue
        if k == "--free-max-tokens":
            i += 2
            continue
        out.append(k)
        i += 1
    return shlex.join(out + ["--policy", pol, "--budget", str(budget), "--compare-full"])


def execute(runner, sw):
    """The sweep's runs, one result dict per (policy, budget) plus the full cache's."""
    base = {k: sw[k] for k in ("workload", "prompt", "facts")}
    try:
        d = runner.run(sw["args"])
    except Exception as e:  # keep going: a failed sweep is reported in the table
        print("r1kv-quality-report: " + str(e), file=sys.stderr, flush=True)
        return [dict(base, policy=p, budget=b, error=str(e)) for p in POLICIES for b in sw["budgets"]]
    n_prompt = len(d.get("prompt_tokens") or [])
    sw["wall_s"] = d.get("_wall_s", 0)
    full = d["full"]
    out = []
    if sw["facts"]:
        text = full.get("text", "")
        out.append(dict(base, policy="full", budget=0, answer=text, prompt_tokens=n_prompt,
                        answer_tokens=len(full["tokens"]), stop=full["stop"],
                        fact_kept=all(f in text for f in sw["facts"])))
    for r in d["runs"]:
        res = dict(base, policy=r["policy"], budget=r["budget"], sweep_command=d["_command"],
                   command=generate_command(sw, r["policy"], r["budget"]))
        if "skipped" in r:
            res["skipped"] = "%d prompt + %d answer tokens < budget + buffer %d" % (
                n_prompt, len(full["tokens"]) if sw["workload"] == "smollm2" else 0, r["budget"] + r["buffer"]) \
                if sw["workload"] == "smollm2" else r["skipped"]
            if sw["facts"]:  # identical to the full cache, its answer included
                res["answer"] = full.get("text", "")
                res["fact_kept"] = all(f in res["answer"] for f in sw["facts"])
            out.append(res)
            continue
        res["result"] = dict(r, prompt_tokens=d.get("prompt_tokens"))
        # Until the first compression the policy engine is the full cache exactly (agreement
        # 1, KL 0): it compresses after the first step whose cache holds budget + buffer tokens
        # and whose query window (8 steps; prefilled prompt tokens feed none) is full. The
        # metrics over the steps after it are what the policy changed.
        n = r["compare_steps"]
        kv0 = n_prompt - 1 if sw["workload"] == "smollm2" else 0  # cached before step 1
        first = max(WINDOW, r["budget"] + r["buffer"] - kv0, 1)
        pre = min(first, n)
        post = n - pre
        res["result"]["post_steps"] = post
        if post > 0:
            res["result"]["post_top1_agreement"] = (round(r["top1_agreement"] * n) - pre) / post
            res["result"]["post_mean_kl"] = r["mean_kl"] * n / post
        if "free" in r:
            res["answer"] = r["free"].get("text", "")
            res["answer_stop"] = r["free"].get("stop")
            res["fact_kept"] = all(f in res["answer"] for f in sw["facts"])
        out.append(res)
    return out


def suite_kinds():
    """suite.json id -> kind (long_doc, code, chat)."""
    with open(os.path.join(REPO, "examples", "prompts", "suite.json")) as f:
        return {p["id"]: p.get("kind", "") for p in json.load(f)["prompts"]}


def summarize(results):
    """One row per (workload, prompt, policy, budget)."""
    groups = {}
    for r in results:
        groups.setdefault((r["workload"], r["prompt"], r["policy"], r["budget"]), []).append(r)
    rows = []
    for (w, _, pol, b), rs in groups.items():
        ok = [r for r in rs if "result" in r]
        row = dict(workload=w, policy=pol, budget=b, prompts=sorted({r["prompt"] for r in rs}),
                   errors=[r["error"] for r in rs if "error" in r],
                   skipped=[r["skipped"] for r in rs if "skipped" in r])
        if ok:
            steps = [max(1, r["result"].get("compare_steps", 1)) for r in ok]
            tot = float(sum(steps))
            row["steps"] = int(tot)
            post = [r["result"]["post_steps"] for r in ok]
            row["post_steps"] = sum(post)
            if sum(post):
                row["post_top1_agreement"] = sum(r["result"].get("post_top1_agreement", 0) * q
                                                 for r, q in zip(ok, post)) / sum(post)
                row["post_mean_kl"] = sum(r["result"].get("post_mean_kl", 0) * q for r, q in zip(ok, post)) / sum(post)
            row["n_run"] = len(ok)
            row["prompt_tokens"] = max(len(r["result"].get("prompt_tokens") or []) for r in ok)
            row["top1_agreement"] = sum(r["result"]["top1_agreement"] * s for r, s in zip(ok, steps)) / tot
            row["mean_kl"] = sum(r["result"]["mean_kl"] * s for r, s in zip(ok, steps)) / tot
            row["max_kl"] = max(r["result"]["max_kl"] for r in ok)
            row["kv_saved"] = sum(1.0 - r["result"]["kv_bytes_final"] / r["result"]["full_kv_bytes_final"]
                                  for r in ok) / len(ok)
            row["kv_bytes_final"] = sum(r["result"]["kv_bytes_final"] for r in ok)
            row["full_kv_bytes_final"] = sum(r["result"]["full_kv_bytes_final"] for r in ok)
            row["compressions"] = sum(r["result"].get("compressions", 0) for r in ok)
            row["pages_freed"] = sum(r["result"].get("pages_freed", 0) for r in ok)
        facts = [r for r in rs if "fact_kept" in r]
        if facts:
            row["facts_kept"] = sum(1 for r in facts if r["fact_kept"])
            row["facts_total"] = len(facts)
        rows.append(row)
    order = {"smollm2": 0, "stories260K": 1, "synthetic": 2}
    pol_order = {"full": -1, "r1kv": 0, "snapkv": 1, "streaming": 2}
    rows.sort(key=lambda x: (order.get(x["workload"], 9), x["prompts"], x["budget"], pol_order.get(x["policy"], 9)))
    return rows


def kl_str(x):
    """A KL for the table: 4 decimals, or 2 significant digits below 1e-3 (float runs get there)."""
    return "%.4f" % x if x == 0 or x >= 1e-3 else "%.1e" % x


def table(rows):
    lines = ["| workload | budget | policy | prompt (tokens) | compared steps (after 1st compression) | compressions | KV bytes saved | top-1 agreement | mean KL (nats) | top-1 after 1st compression | mean KL after | max KL | fact in greedy answer |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for x in rows:
        fact = "%d/%d" % (x["facts_kept"], x["facts_total"]) if "facts_total" in x else ""
        if "top1_agreement" not in x:
            if x["policy"] == "full" and fact:
                lines.append("| %s | - | full cache | %s | | | | | | | | | %s |" % (x["workload"], ", ".join(x["prompts"]), fact))
            elif x["skipped"] and not x["errors"] and x["policy"] == "r1kv":
                why = x["skipped"][0] if len(x["skipped"]) == 1 else "in no prompt do prompt + answer tokens reach budget + buffer"
                lines.append("| %s | %d | all | %s | no compression: %s, so identical to the full cache |||||||||" % (
                    x["workload"], x["budget"], ", ".join(x["prompts"]), why))
            elif x["skipped"] and not x["errors"]:
                continue
            elif x["errors"] and all("--cached-only" in e for e in x["errors"]):
                lines.append("| %s | %d | %s | %s | not run in time |||||||||" % (
                    x["workload"], x["budget"], LABELS[x["policy"]], ", ".join(x["prompts"])))
            elif x["errors"]:
                lines.append("| %s | %d | %s | %s | failed: %s |||||||||" % (
                    x["workload"], x["budget"], LABELS[x["policy"]], ", ".join(x["prompts"]),
                    x["errors"][0].splitlines()[0][:120]))
            continue
        name = ", ".join(x["prompts"])
        if name.startswith("all "):  # an aggregate over prompts
            name += " (%d compressed%s)" % (x["n_run"], ", %d never reach budget + buffer (= full cache)" %
                                            len(x["skipped"]) if x["skipped"] else "")
        elif x["workload"] == "smollm2":
            name += " (%d)" % x["prompt_tokens"]
        post = ("%.4f" % x["post_top1_agreement"], kl_str(x["post_mean_kl"])) if "post_top1_agreement" in x else ("-", "-")
        lines.append("| %s | %d | %s | %s | %d (%d) | %d | %.1f %% | %.4f | %s | %s | %s | %s | %s |" % (
            x["workload"], x["budget"], LABELS[x["policy"]], name, x["steps"], x["post_steps"],
            x["compressions"], 100 * x["kv_saved"], x["top1_agreement"], kl_str(x["mean_kl"]), post[0], post[1],
            "%.3f" % x["max_kl"] if x["max_kl"] >= 1e-3 else "%.1e" % x["max_kl"], fact))
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("r1kv-quality-report: no matplotlib, no plot (scripts/setup-venv.sh installs it)", file=sys.stderr)
        return False
    matplotlib.rcParams["svg.hashsalt"] = "kvkit"  # stable ids: the SVG diffs cleanly
    matplotlib.rcParams["svg.fonttype"] = "none"
    workloads = [w for w in ("smollm2", "stories260K", "synthetic") if any(r["workload"] == w and "kv_saved" in r for r in rows)]
    if not workloads:
        return False
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.2 * len(workloads), 7), squeeze=False)
    style = {"r1kv": ("o", "tab:red"), "snapkv": ("s", "tab:blue"), "streaming": ("^", "tab:green")}
    dashes = ["-", "--", ":", "-."]
    for c, w in enumerate(workloads):
        prompts = sorted({r["prompts"][0] for r in rows if r["workload"] == w and "kv_saved" in r})
        for pol in POLICIES:
            m, col = style[pol]
            for k, pr in enumerate(prompts):  # one line per (policy, prompt)
                pts = sorted((r["kv_saved"] * 100, r.get("post_top1_agreement", r["top1_agreement"]),
                              max(r.get("post_mean_kl", r["mean_kl"]), 1e-6), r["budget"])
                             for r in rows if r["workload"] == w and r["policy"] == pol and "kv_saved" in r
                             and r["prompts"][0] == pr)
                if not pts:
                    continue
                label = LABELS[pol] + ("" if len(prompts) == 1 else " " + pr)
                xs = [p[0] for p in pts]
                ls = dashes[k % len(dashes)]
                axes[0][c].plot(xs, [p[1] for p in pts], marker=m, color=col, linestyle=ls, label=label)
                axes[1][c].plot(xs, [p[2] for p in pts], marker=m, color=col, linestyle=ls, label=label)
                for p in pts:
                    axes[0][c].annotate(str(p[3]), (p[0], p[1]), textcoords="offset points", xytext=(3, 3), fontsize=7)
        axes[0][c].set_title(w)
        axes[0][c].set_ylabel("top-1 agreement with the full cache\n(steps after the 1st compression)")
        axes[1][c].set_ylabel("mean KL (nats, log; same steps)")
        axes[1][c].set_yscale("log")
        for r in (0, 1):
            axes[r][c].set_xlabel("KV bytes saved at the end (%)")
            axes[r][c].grid(True, alpha=0.3)
        axes[0][c].legend(fontsize=6 if len(prompts) > 1 else 8)
    fig.suptitle("Compressor policies at equal budgets (labels: budget)")
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None} if path.endswith(".svg") else None)
    return True


def main():
    a = parse_args()
    if not os.path.exists(a.kvkit):
        sys.exit("r1kv-quality-report: no kvkit binary at %s (--kvkit)" % a.kvkit)
    runner = Runner(os.path.abspath(a.kvkit), a.cache, a.cached_only)
    sweeps = plan(a)
    print("r1kv-quality-report: %d sweeps, %d jobs at once" % (len(sweeps), a.jobs), file=sys.stderr)
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        results = [r for rs in ex.map(lambda sw: execute(runner, sw), sweeps) for r in rs]
    kinds = suite_kinds()
    rows = summarize(results)
    # SmolLM2 over all prompts of a kind (step-weighted agreement and KL, facts summed).
    agg = summarize([dict(r, prompt="all %s prompts" % kinds[r["prompt"]]) for r in results
                     if r["workload"] == "smollm2" and r["prompt"] in kinds])
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"matvec": a.matvec, "command": "scripts/r1kv-quality-report.py " + shlex.join(sys.argv[1:]),
                   "aggregate": agg, "rows": rows,
                   "runs": [{k: v for k, v in r.items() if k != "result"} |
                            ({"result": {k: v for k, v in r["result"].items()
                                         if k not in ("tokens", "prompt_tokens", "sequences", "free")}}
                             if "result" in r else {})
                            for r in results]}, f, indent=1)
    have_plot = plot((agg or [r for r in rows if r["workload"] == "smollm2"]) +
                     [r for r in rows if r["workload"] != "smollm2"], a.out + ".svg")
    cmd = "scripts/r1kv-quality-report.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    ex_run = next((r for r in results if "result" in r and r["workload"] == "smollm2"),
                  next((r for r in results if "result" in r), None))
    wall = sum(r["result"].get("seconds", 0) for r in results if "result" in r)
    md = ["# Compressor policies: quality at equal budgets", "",
          "Produced by `%s` (sweeps cached in %s; their wall times sum to %.0f s, %d sweeps). Each prompt is one `kvkit sweep` "
          "(the full cache runs once; every policy x budget is teacher-forced with its greedy tokens "
          "and compared with its logits), which gives exactly the numbers of `kvkit generate --policy P "
          "--budget B --buffer U --compare-full --json` run alone (tests/test_cli_sweep.cpp)." % (
              cmd, a.cache, sum(sw.get("wall_s", 0) for sw in sweeps), len(sweeps)), ""]
    if ex_run:
        md += ["Example: `%s` = one run of `%s`." % (ex_run["command"], ex_run["sweep_command"]), ""]
    caps = {}  # (answer tokens, free-run tokens) -> prompts
    for sw in sweeps:
        if sw["workload"] == "smollm2":
            free = sw["args"][sw["args"].index("--free-max-tokens") + 1] if "--free-max-tokens" in sw["args"] else "-"
            caps.setdefault((sw["max_tokens"], free), []).append(sw["prompt"])
    md += ["SmolLM2: answers ending at <|im_end|> (the full cache's greedy answer, teacher-forced), buffer "
           "%d; the fact column is the policy's own greedy answer (no teacher forcing) containing the "
           "expected string(s) of suite.json's answer_contains. Answer / free-run tokens at most: %s. "
           "stories260K: %d steps, buffer 32. synthetic: %d steps, buffer 32. Projections: `--matvec %s`%s." % (
               a.smol_buffer, "; ".join("%s / %s (%s)" % (k[0], k[1], ", ".join(v)) for k, v in caps.items()),
               a.stories_steps, a.synthetic_steps, a.matvec,
               " (GGUF weights dequantized to float32 at load: no activation rounding, so KL and "
               "top-1 are the policy's own error)" if a.matvec == "float" else
               " (int8 activations: a rounding noise floor adds to every policy's KL once it changes "
               "the summation order)"), ""]
    if agg:
        md += ["## SmolLM2 over the prompts of each kind", "", table(agg), ""]
    md += ["## Every prompt", "", table(rows), ""]
    if have_plot:
        md += ["![KV bytes saved vs fidelity](%s)" % os.path.basename(a.out + ".svg"), ""]
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
