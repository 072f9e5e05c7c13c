#!/usr/bin/env python3
"""HumanEval-shaped training prompts built from documented functions of the standard library.

The code benchmark of issue #50 asks the target to "Complete this Python function." given a
signature and a docstring (HumanEval, and data/prompts/code.jsonl which holds HumanEval
tasks). A drafter trained only on chat-style questions saw none of that shape: on generated
magpie code answers it accepts 0.49 of first positions, on HumanEval 0.26. This writes the
same shape from other functions: every public, undecorated free function (not a method) of
this interpreter's standard library (the files make_code_corpus.py reads) with a docstring
of a few lines and a body of 4-60 lines, as

    Complete this Python function.

    ```python
    <the module's plain `import` lines it uses, if any>
    def name(args):
        \"\"\"docstring\"\"\"
    ```

The target then writes its own answer (`dspark-train train --prompts FILE --generate-only`),
so the drafter learns what the target does with such a prompt (repeat the signature and the
docstring, then the body) without seeing any evaluation task. Functions whose name is a
HumanEval entry point are skipped, as is any whose docstring shares a line of 40+ characters
with a file given by `--exclude`.

With `--site-packages` the functions of this interpreter's installed packages join the pool
(the standard library alone has ~650 that qualify; tests and vendored copies are left out).

With `--raw` the prompt is the bare code block (imports, signature, docstring), as HumanEval's
own `prompt` field is and as bench/loadgen.py sends it.

Usage: python3 data/prompts/make_function_prompts.py --out PROMPTS.jsonl [--count 400]
       [--seed 0] [--raw] [--site-packages] [--skip EARLIER.jsonl] [--exclude ~/.cache/dspark/data/HumanEval.jsonl ...]
The file is written outside the repository (the docstrings are the interpreter's).
"""
import argparse
import ast
import json
import random
import site
from pathlib import Path

from make_code_corpus import SKIP_PARTS, long_lines, python_files, stdlib_files


def site_files():
    """The Python files of this interpreter's installed packages, minus tests, tooling and
    vendored copies, sorted."""
    skip = SKIP_PARTS | {"_vendor", "vendor", "testing"}
    return sorted(p for root in map(Path, site.getsitepackages()) for p in python_files(root, skip))


def entry_points(paths):
    """HumanEval's entry points (the `entry_point` field of its JSONL), when given."""
    names = set()
    for p in paths:
        for line in Path(p).expanduser().read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("entry_point"):
                names.add(rec["entry_point"])
    return names


def signature(src_lines, node):
    """The `def` line(s) of `node` exactly as written, dedented to column 0."""
    first = node.lineno - 1
    body_start = node.body[0].lineno - 1
    lines = src_lines[first:body_start]
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines).rstrip()


def prompts_of(path, skip_names, bad_lines, raw):
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    src_lines = text.splitlines()
    imports = [ast.get_source_segment(text, n) for n in tree.body
               if isinstance(n, ast.Import) and n.col_offset == 0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("_") or node.name in skip_names or node.decorator_list:
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or len(doc) < 80 or len(doc) > 1200 or doc.count("\n") < 2:
            continue
        if any(line.strip() in bad_lines for line in doc.splitlines()):
            continue
        body_lines = node.end_lineno - node.lineno
        if body_lines < 4 or body_lines > 60:
            continue
        sig = signature(src_lines, node)
        if not sig.startswith(("def ", "async def ")) or len(sig) > 300:
            continue
        if sig.split("(", 1)[1].startswith(("self", "cls")):
            continue  # methods need their class; keep free functions
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        used = [i for i in imports if i and any(
            a.strip().split(" as ")[-1].split(".")[0] in names
            for a in i.split(None, 1)[1].split(","))]
        doc_body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
        head = "\n".join(used) + "\n\n\n" if used else "\n"
        code = f'{head}{sig}\n    """\n{doc_body}\n    """\n'
        prompt = code.lstrip("\n") if raw else f"Complete this Python function.\n\n```python\n{code}```"
        out.append({"id": f"{path.stem}.{node.name}", "domain": "code-fn", "prompt": prompt})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude", action="append", default=[])
    ap.add_argument("--raw", action="store_true",
                    help="the bare code as HumanEval's `prompt` field has it (what bench/loadgen.py "
                         "sends for HumanEval), without the instruction and the fence")
    ap.add_argument("--site-packages", action="store_true",
                    help="also the functions of this interpreter's installed packages")
    ap.add_argument("--skip", action="append", default=[],
                    help="a prompts file written before: its functions are not picked again")
    args = ap.parse_args()
    root, files = stdlib_files()
    if args.site_packages:
        files = files + site_files()
    skip_names = entry_points(args.exclude)
    bad = set().union(*(long_lines(Path(f).expanduser()) for f in args.exclude))
    skip_ids = {json.loads(line)["id"] for f in args.skip for line in open(f) if line.strip()}
    pool, seen = [], set()
    for p in files:
        for rec in prompts_of(p, skip_names, bad, args.raw):
            if rec["id"] not in seen and rec["id"] not in skip_ids:
                seen.add(rec["id"])
                pool.append(rec)
    random.seed(args.seed)
    pick = random.sample(pool, min(args.count, len(pool)))
    with open(args.out, "w") as f:
        for rec in pick:
            f.write(json.dumps(rec) + "\n")
    print(f"{len(pick)} prompts of {len(pool)} documented functions under {root} -> {args.out}")


if __name__ == "__main__":
    main()
