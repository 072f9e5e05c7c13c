"""The training-prompt makers keep evaluation tasks out and write the shapes they promise."""
import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKER = ROOT / "data" / "prompts" / "make_function_prompts.py"


def run_maker(tmp_path, name, *args):
    out = tmp_path / name
    subprocess.run([sys.executable, str(MAKER), "--out", str(out), *args], check=True,
                   capture_output=True)
    return [json.loads(line) for line in out.read_text().splitlines()]


def code_of(prompt):
    if prompt.startswith("Complete this Python function."):
        body = prompt.split("```python\n", 1)[1]
        assert body.endswith("```")
        return body[: -len("```")]
    return prompt


def test_function_prompts_are_valid_documented_functions_without_excluded_names(tmp_path):
    everything = run_maker(tmp_path, "all.jsonl", "--count", "100000")
    names = [r["id"].rsplit(".", 1)[1] for r in everything]
    assert len(everything) > 100
    # Exclude two picked functions the way HumanEval's file names its entry points.
    banned = sorted(set(names))[:2]
    fake_eval = tmp_path / "eval.jsonl"
    fake_eval.write_text("".join(json.dumps({"task_id": f"X/{i}", "entry_point": n}) + "\n"
                                 for i, n in enumerate(banned)))
    kept = run_maker(tmp_path, "kept.jsonl", "--count", "100000", "--exclude", str(fake_eval))
    assert not {r["id"].rsplit(".", 1)[1] for r in kept} & set(banned)
    assert len(kept) < len(everything)
    for r in kept[:200]:
        assert r["prompt"].startswith("Complete this Python function.\n\n```python\n")
        tree = ast.parse(code_of(r["prompt"]))
        fn = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert len(fn) == 1 and ast.get_docstring(fn[0])
        assert len(fn[0].body) == 1, "the body is left for the target to write"


def test_raw_prompts_are_bare_code_and_skip_an_earlier_file(tmp_path):
    first = run_maker(tmp_path, "first.jsonl", "--count", "50", "--seed", "3")
    raw = run_maker(tmp_path, "raw.jsonl", "--count", "50", "--seed", "4", "--raw",
                    "--skip", str(tmp_path / "first.jsonl"))
    assert len(first) == 50 and len(raw) == 50
    assert not {r["id"] for r in first} & {r["id"] for r in raw}
    for r in raw:
        assert not r["prompt"].startswith("Complete") and "```" not in r["prompt"]
        ast.parse(r["prompt"])
    # Seeded: the same arguments write the same file.
    again = run_maker(tmp_path, "again.jsonl", "--count", "50", "--seed", "3")
    assert again == first


def test_site_packages_widen_the_pool_with_valid_functions(tmp_path):
    stdlib = run_maker(tmp_path, "std.jsonl", "--count", "100000", "--raw")
    wide = run_maker(tmp_path, "wide.jsonl", "--count", "100000", "--raw", "--site-packages")
    assert len(wide) > len(stdlib)
    assert {r["id"] for r in stdlib} <= {r["id"] for r in wide}
    for r in wide[::max(1, len(wide) // 300)]:
        tree = ast.parse(r["prompt"])
        fn = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert len(fn) == 1 and ast.get_docstring(fn[0]) and len(fn[0].body) == 1
