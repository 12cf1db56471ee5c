#!/usr/bin/env python3
"""Writes examples/prompts/suite.json: the prompt suite of the KV-policy reports.

Three kinds of prompts, each with the user turns to send in order (a chat keeps the
conversation's KV between turns) and strings a correct answer contains:
  - code: the three prompts of the kvchan seed (merge sort, a BST API, a Sudoku grid);
  - long_doc: generated reports of about 2K, 3K, 4K, 5K and 6K SmolLM2 tokens with one
    fact (the "needle") at a chosen depth and a question about it at the end;
  - chat: multi-turn conversations whose later turns refer back to earlier ones.
The documents are generated from fixed word lists with a fixed seed, so the file is
reproducible: `python3 scripts/make-prompt-suite.py` rewrites it byte for byte. Token counts
(`tokens`) are those of the ChatML prompt of the first turn as kvkit tokenizes it; pass
`--kvkit build/examples/kvkit --model M.gguf` to recompute them (otherwise the counts
already in the file are kept).
"""
import argparse
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "examples", "prompts", "suite.json")

CODE = [
    {
        "id": "code-merge-sort",
        "turns": ["Write a Python function merge_sort(items) that returns a new sorted list using "
                  "merge sort. Explain how the merge step works and state the time complexity."],
        "answer_contains": ["def merge_sort"],
    },
    {
        "id": "code-bst-api",
        "turns": ["Design a small binary search tree API in Python: a class BST with insert(key), "
                  "contains(key), delete(key) and an in-order iterator. Write the code and explain "
                  "how delete handles a node with two children."],
        "answer_contains": ["class BST"],
    },
    {
        "id": "code-sudoku",
        "turns": ["Here is a Sudoku grid, with 0 for an empty cell:\n"
                  "5 3 0 0 7 0 0 0 0\n6 0 0 1 9 5 0 0 0\n0 9 8 0 0 0 0 6 0\n"
                  "8 0 0 0 6 0 0 0 3\n4 0 0 8 0 3 0 0 1\n7 0 0 0 2 0 0 0 6\n"
                  "0 6 0 0 0 0 2 8 0\n0 0 0 4 1 9 0 0 5\n0 0 0 0 8 0 0 7 9\n"
                  "Which digits are allowed in the empty cell of the first row, third column? "
                  "Then write a Python backtracking solver for such grids."],
        "answer_contains": ["def "],
    },
]

CHATS = [
    {
        "id": "chat-trip",
        "turns": ["I am planning a three-day trip to Lisbon in May. What should I see on the first day?",
                  "What about the second day? I would like to see something outside the city.",
                  "Which of the places you mentioned on the first day is best at sunset?",
                  "Summarize the whole plan in three short bullet points."],
        "answer_contains": [],
    },
    {
        "id": "chat-recipe",
        "turns": ["Give me a simple recipe for tomato soup for four people.",
                  "I have no fresh tomatoes, only canned ones. What changes?",
                  "How long does the soup keep in the fridge?"],
        "answer_contains": [],
    },
    {
        "id": "chat-names",
        "turns": ["My name is Ingrid and I keep bees on a farm near Uppsala.",
                  "What should I check in the hives before winter?",
                  "What is my name and where do I live?"],
        "answer_contains": ["Ingrid"],
    },
    {
        "id": "chat-math",
        "turns": ["What is 12 times 7?", "Add 16 to that.", "Now divide the result by 4."],
        "answer_contains": ["84"],
    },
]

FIRST = ["Amara", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Gustav", "Hana", "Ivo", "Jonas",
         "Keiko", "Lars", "Mirela", "Nikhil", "Olga", "Pavel", "Quinn", "Rosa", "Sanjay", "Tove"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Haddad", "Novak", "Castillo", "Brennan", "Ishikawa",
        "Petrov", "Adeyemi", "Kowalski", "Ferreira", "Nakamura", "Schmidt", "Delgado", "Rahman"]
PLACES = ["Millbrook", "Harbor Valley", "Eastfield", "the river bend", "Stonebridge", "Ashford",
          "the northern ridge", "Kestrel Bay", "Willow Creek", "the old quarry", "Redmoor"]
THINGS = ["the water pumps", "the grain silo", "the bakery", "the ferry", "the school library",
          "the wind turbine", "the weekly market", "the bicycle workshop", "the clinic",
          "the orchard", "the community kitchen", "the radio station", "the footbridge"]
ACTIONS = ["repaired", "expanded", "rebuilt", "inspected", "moved", "modernised", "painted",
           "reorganised", "insured", "measured", "cleaned", "reopened"]
REASONS = ["after a wet spring", "because demand had grown", "to cut energy costs",
           "after complaints from neighbours", "before the winter storms", "to meet new rules",
           "after a small fire", "because the old parts were worn out", "at the request of members"]
RESULTS = ["costs fell by {p} percent", "waiting times dropped to {n} minutes",
           "about {n} families now use it every week", "output rose by {p} percent",
           "the work took {n} days longer than planned", "the budget was exceeded by {p} percent",
           "volunteers gave {n} hours of work", "it now serves {n} people a day"]

NEEDLES = [
    ("The access code of the north storage room was changed to 4817.",
     "What is the access code of the north storage room?", "4817"),
    ("The new ferry was named Blue Heron after a vote of the members.",
     "What was the new ferry named?", "Blue Heron"),
    ("The treasurer, Marta Quist, discovered that the spare key was kept inside the red mailbox.",
     "Where was the spare key kept?", "red mailbox"),
    ("The cooperative's first tractor, bought in 1962, was painted bright orange.",
     "What colour was the cooperative's first tractor?", "orange"),
    ("The annual festival moved to the second Saturday of September after 2015.",
     "On which day is the annual festival held after 2015?", "second Saturday of September"),
]


def paragraph(rng, year):
    sents = []
    for _ in range(rng.randint(4, 6)):
        who = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        res = rng.choice(RESULTS).format(p=rng.randint(3, 40), n=rng.randint(5, 400))
        sents.append(rng.choice([
            f"In {year}, {who} {rng.choice(ACTIONS)} {rng.choice(THINGS)} in {rng.choice(PLACES)} {rng.choice(REASONS)}, and {res}.",
            f"{who} reported that {rng.choice(THINGS)} near {rng.choice(PLACES)} was {rng.choice(ACTIONS)} {rng.choice(REASONS)}.",
            f"The board asked {who} to review {rng.choice(THINGS)}; by the end of {year} {res}.",
            f"Members from {rng.choice(PLACES)} voted to have {rng.choice(THINGS)} {rng.choice(ACTIONS)}, and {res}.",
        ]))
        year += rng.randint(0, 1)
    return " ".join(sents), year


def long_doc(index, target_words, depth):
    rng = random.Random(1000 + index)
    needle, question, answer = NEEDLES[index]
    paras, words, year = [], 0, 1950 + 3 * index
    while words < target_words:
        p, year = paragraph(rng, year)
        paras.append(p)
        words += len(p.split())
    at = max(1, min(len(paras) - 1, round(depth * len(paras))))
    paras[at] = paras[at] + " " + needle
    text = ("Read the following history of the Harbor Valley cooperative and answer the question "
            "at the end.\n\n" + "\n\n".join(paras) + "\n\nQuestion: " + question)
    return {"id": f"doc-{index + 1}", "kind": "long_doc", "needle_depth": depth,
            "turns": [text], "answer_contains": [answer]}


def count_tokens(kvkit, model, turn):
    r = subprocess.run([kvkit, "generate", "--model", model, "--chat", "--prompt", turn,
                        "--max-tokens", "1", "--json"], capture_output=True, text=True, check=True)
    return len(json.loads(r.stdout)["prompt_tokens"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvkit", help="kvkit binary, to count tokens")
    ap.add_argument("--model", help="SmolLM2 .gguf, to count tokens")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    old = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            old = {p["id"]: p.get("tokens") for p in json.load(f)["prompts"]}
    prompts = [dict(p, kind="code") for p in CODE]
    # About 1.5 SmolLM2 tokens per word: 2K, 3K, 4K, 5K and 6K tokens.
    for i, (words, depth) in enumerate([(1300, 0.25), (1950, 0.5), (2650, 0.1), (3300, 0.75), (3950, 0.5)]):
        prompts.append(long_doc(i, words, depth))
    prompts += [dict(p, kind="chat") for p in CHATS]
    for p in prompts:
        if a.kvkit and a.model:
            p["tokens"] = count_tokens(a.kvkit, a.model, p["turns"][0])
        elif old.get(p["id"]) is not None:
            p["tokens"] = old[p["id"]]
    suite = {
        "description": "Prompt suite of the KV-policy reports (scripts/make-prompt-suite.py). Send "
                       "each prompt's turns in order as user messages of one ChatML conversation "
                       "(default system message); a correct final answer contains every string "
                       "of answer_contains. tokens: ChatML tokens of the first turn (SmolLM2).",
        "prompts": prompts,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(suite, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {len(prompts)} prompts to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
