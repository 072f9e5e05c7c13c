#!/usr/bin/env python3
"""The GPU check (scripts/gpu-check.sh runs this): what the CUDA build does on a real GPU.

On a machine with no network and no model files, it writes random-weight Llama models of real
shapes (SmolLM2-135M's and Llama-3-8B's; safetensors + config + a word-level tokenizer of the
model's vocabulary), then, with one dspark-engine binary built with `--features cuda`:
  1. CPU vs CUDA on the small shape: the same greedy completions with top-5 logprobs on both
     devices; top-1 agreement (positions until the first different token) and the largest
     |logprob difference| over those positions.
  2. `dspark-engine profile --device cuda` on the 8B shape: decode tok/s (SPS(1)) and SPS(B)
     for B = 1..128, against the memory-bandwidth limit (weight bytes read per step / the GPU's
     bandwidth), and verify-shaped steps (4 tokens per sequence) for B = 1..64.
  3. Greedy losslessness of speculation on CUDA: the small shape with `--speculation ngram`,
     and with `dspark-markov` (an untrained drafter: its forward and the verification run on
     the device), must give exactly the tokens of `--speculation none`.
Writes $OUT/gpu-check.md (and gpu-check.json). GPU_CHECK_DEVICE=cpu and GPU_CHECK_SHAPES=tiny
make a dry run of the whole path on a machine without a GPU (that run compares CPU with CPU).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

SHAPES = {
    # name: vocab, hidden, intermediate, layers, heads, kv heads, rope theta, tied embeddings
    "tiny": (512, 64, 128, 2, 4, 2, 10000.0, True),
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, 100000.0, True),
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, 500000.0, False),
}


def log(msg):
    print(f"[gpu-check] {msg}", flush=True)


def write_model(shape, out, seed):
    """A random-weight Llama folder of `shape`: config.json, model.safetensors (bf16 with
    torch, f16 with numpy only), tokenizer.json (word level: one token per id) and its config."""
    vocab, hidden, inter, layers, heads, kv_heads, theta, tied = SHAPES[shape]
    head_dim = hidden // heads
    os.makedirs(out, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "rope_theta": theta, "max_position_embeddings": 8192,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
    }
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [
            {"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True} for i, w in enumerate(words[:3])],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)},
                  "unk_token": "<unk>"},
    }
    json.dump(tok, open(os.path.join(out, "tokenizer.json"), "w"))
    json.dump({"bos_token": "<s>", "eos_token": "</s>"},
              open(os.path.join(out, "tokenizer_config.json"), "w"))
    # Scales that keep the residual stream bounded and the logits peaked (std ~3, or the tied
    # embedding's), so greedy choices are not ties that rounding decides.
    names = [("model.embed_tokens.weight", (vocab, hidden), 1.0)]
    if not tied:
        names.append(("lm_head.weight", (vocab, hidden), 3.0 / hidden ** 0.5))
    for i in range(layers):
        p = f"model.layers.{i}."
        q, kv = heads * head_dim, kv_heads * head_dim
        for n, s in [("self_attn.q_proj", (q, hidden)), ("self_attn.k_proj", (kv, hidden)),
                     ("self_attn.v_proj", (kv, hidden)), ("self_attn.o_proj", (hidden, q)),
                     ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                     ("mlp.down_proj", (hidden, inter))]:
            names.append((p + n + ".weight", s, 1.0 / s[1] ** 0.5))
    ones = [("model.norm.weight", hidden)] + [
        (f"model.layers.{i}.{n}.weight", hidden)
        for i in range(layers) for n in ("input_layernorm", "post_attention_layernorm")]
    t0 = time.time()
    try:
        import torch
        from safetensors.torch import save_file
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator(device=dev).manual_seed(seed)
        t = {n: (torch.randn(s, generator=g, device=dev, dtype=torch.bfloat16) * std).cpu()
             for n, s, std in names}
        t.update({n: torch.ones(h, dtype=torch.bfloat16) for n, h in ones})
        save_file(t, os.path.join(out, "model.safetensors"))
        dtype = "bf16"
    except ImportError:
        import numpy as np
        from safetensors.numpy import save_file
        rng = np.random.default_rng(seed)
        t = {n: (rng.standard_normal(s, dtype=np.float32) * std).astype(np.float16)
             for n, s, std in names}
        t.update({n: np.ones(h, dtype=np.float16) for n, h in ones})
        save_file(t, os.path.join(out, "model.safetensors"))
        dtype = "f16"
    params = sum(a * b for _, (a, b), _ in names) + sum(h for _, h in ones)
    log(f"wrote {shape} ({params / 1e9:.3f} B parameters, {dtype}) to {out} in {time.time() - t0:.1f}s")
    return params, dtype


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`dspark-engine serve` on loopback; stopped on exit."""

    def __init__(self, bin, model, device, speculation, logdir, tag):
        self.port = free_port()
        self.log = open(os.path.join(logdir, f"serve-{tag}.log"), "w")
        args = [bin, "serve", "--model", model, "--device", device, "--host", "127.0.0.1",
                "--port", str(self.port), "--speculation", speculation]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.tag = tag

    def __enter__(self):
        t0 = time.time()
        while time.time() - t0 < 300:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve {self.tag} exited {self.proc.returncode}; see {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=2).read()
                log(f"serve {self.tag} ready in {time.time() - t0:.1f}s")
                return self
            except Exception:
                time.sleep(0.5)
        raise RuntimeError(f"serve {self.tag} not ready after 300 s")

    def complete(self, prompt, max_tokens, logprobs=0):
        body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        if logprobs:
            body["logprobs"] = logprobs
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=300).read())["choices"][0]

    def counter(self, name):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        return sum(float(l.split()[-1]) for l in text.splitlines()
                   if l.startswith(name + " ") or l.startswith(name + "{"))

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def prompts(n, vocab):
    # Word-level ids; repeated phrases give the n-gram drafter something to propose.
    out = []
    for i in range(n):
        words = [f"w{3 + (i * 37 + j * 11) % (vocab - 3)}" for j in range(12)]
        out.append(" ".join(words + words[:6]))
    return out


def agreement(bin, model, gpu, logdir, n, tokens, vocab):
    with Server(bin, model, "cpu", "none", logdir, "cpu") as cpu, \
            Server(bin, model, gpu, "none", logdir, "dev-" + gpu.replace(":", "")) as dev:
        rows = []
        for p in prompts(n, vocab):
            a, b = cpu.complete(p, tokens, 5), dev.complete(p, tokens, 5)
            ta, tb = a["logprobs"]["tokens"], b["logprobs"]["tokens"]
            same = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
            diff = 0.0
            for k in range(same):
                la, lb = a["logprobs"]["top_logprobs"][k], b["logprobs"]["top_logprobs"][k]
                for t in set(la) & set(lb):
                    diff = max(diff, abs(la[t] - lb[t]))
            rows.append((same, len(ta), diff))
    return rows


def lossless(bin, model, gpu, logdir, n, tokens, vocab, spec="ngram"):
    """Greedy texts of `--speculation spec` against `none`: (identical, prompts, (drafted,
    accepted)). `dspark-markov` without --drafter runs an untrained drafter: its blocks are
    rarely accepted, but the drafter's forward and the verification run on the device."""
    ps = prompts(n, vocab)
    outs, drafted = {}, (0, 0)
    for sp in ("none", spec):
        with Server(bin, model, gpu, sp, logdir, f"{sp}-{gpu.replace(':', '')}") as s:
            outs[sp] = [s.complete(p, tokens)["text"] for p in ps]
            if sp == spec:
                drafted = (s.counter("dspark_spec_decode_num_draft_tokens_total"),
                           s.counter("dspark_spec_decode_num_accepted_tokens_total"))
    if drafted[0] == 0:
        raise RuntimeError(f"the {spec} drafter proposed nothing: the verify path did not run")
    return sum(a == b for a, b in zip(outs["none"], outs[spec])), len(ps), drafted


def profile(bin, model, gpu, logdir, batches, tokens_per_seq=1):
    tag = f"profile-8b-t{tokens_per_seq}"
    out = os.path.join(logdir, f"{tag}.json")
    args = [bin, "profile", "--model", model, "--device", gpu, "--batches", batches,
            "--tokens-per-seq", str(tokens_per_seq), "--context", "256", "--min-reps", "5",
            "--max-reps", "20", "--output", out]
    t0 = time.time()
    with open(os.path.join(logdir, f"{tag}.log"), "w") as f:
        subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=400)
    log(f"profiled in {time.time() - t0:.1f}s")
    return json.load(open(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default=os.environ.get("GPU_CHECK_DEVICE", "cuda"))
    ap.add_argument("--shapes", default=os.environ.get("GPU_CHECK_SHAPES", "smollm2-135m,llama3-8b"))
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="H200: 4.8 TB/s")
    a = ap.parse_args()
    small, big = (a.shapes.split(",") + [None])[:2]
    os.makedirs(a.out, exist_ok=True)
    report = {"device": a.device, "shapes": a.shapes}
    md = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M:%S')})", ""]
    try:
        md += ["```", subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout.strip(), "```", ""]
    except FileNotFoundError:
        md += ["(no nvidia-smi)", ""]
    failed = []

    def step(name, f):
        t0 = time.time()
        try:
            r = f()
            log(f"{name}: done in {time.time() - t0:.1f}s")
            return r
        except Exception as e:  # one failed step must not hide the others' results
            failed.append(f"{name}: {e}")
            log(f"{name}: FAILED: {e}")
            return None

    vocab_small = SHAPES[small][0]
    small_dir = os.path.join(a.work, small)
    if step(f"write {small}", lambda: write_model(small, small_dir, 1)) is not None:
        rows = step("CPU vs CUDA logits", lambda: agreement(a.bin, small_dir, a.device, a.out, 4, 32, vocab_small))
        if rows:
            same, total = sum(r[0] for r in rows), sum(r[1] for r in rows)
            report["agreement"] = {"positions_agreeing": same, "positions": total,
                                   "max_abs_logprob_diff": max(r[2] for r in rows), "per_prompt": rows}
            md += [f"## CPU vs {a.device}, {small} shape (random weights), greedy, top-5 logprobs", "",
                   "| prompt | tokens equal before the first difference | of | max abs logprob diff |",
                   "|---:|---:|---:|---:|"]
            md += [f"| {i} | {r[0]} | {r[1]} | {r[2]:.2e} |" for i, r in enumerate(rows)]
            md.append("")
        for key, spec, n, tokens, what in [("lossless", "ngram", 6, 48, "ngram"),
                                           ("lossless_dspark", "dspark-markov", 4, 32, "dspark-markov (untrained drafter)")]:
            r = step(f"{spec} lossless", lambda: lossless(a.bin, small_dir, a.device, a.out, n, tokens, vocab_small, spec))
            if r:
                report[key] = {"identical": r[0], "prompts": r[1], "draft_tokens": r[2][0],
                               "accepted_tokens": r[2][1]}
                md += [f"## Greedy losslessness on {a.device}: `--speculation {what}` vs `none`, {small} shape", "",
                       f"{r[0]} of {r[1]} completions ({tokens} tokens each) identical; the drafter proposed "
                       f"{r[2][0]:.0f} tokens, {r[2][1]:.0f} accepted.", ""]
        shutil.rmtree(small_dir, ignore_errors=True)
    if big:
        big_dir = os.path.join(a.work, big)
        w = step(f"write {big}", lambda: write_model(big, big_dir, 2))
        if w is not None:
            params, _ = w
            table = step(f"profile {big}", lambda: profile(a.bin, big_dir, a.device, a.out, "1,2,4,8,16,32,64,128"))
            # Verify-shaped steps (4 tokens per sequence): what a speculative step costs.
            verify = step(f"profile {big}, 4 tokens per sequence",
                          lambda: profile(a.bin, big_dir, a.device, a.out, "1,4,16,64", 4))
            if table:
                pts = {int(b): float(sps) for b, sps in table["points"]}
                # Bytes read per step: the layers' matrices in the table's dtype (bf16 stays
                # bf16 on a GPU, f32 on the CPU); embedding rows are few, the LM head is f32.
                vocab, hidden, tied = SHAPES[big][0], SHAPES[big][1], SHAPES[big][7]
                head = vocab * hidden
                per = 2 if table.get("dtype") in ("bf16", "f16") else 4
                nbytes = per * (params - (1 if tied else 2) * head) + 4 * head
                limit = a.bandwidth_tbs * 1e12 / nbytes
                report["profile"] = {"sps": pts, "bandwidth_limit_steps_per_s": limit,
                                     "dtype": table.get("dtype")}
                md += [f"## SPS(B) on {a.device}, {big} shape ({params / 1e9:.2f} B parameters, layer weights in {table.get('dtype')}, LM head f32)", "",
                       f"Memory-bandwidth limit for one step: {a.bandwidth_tbs} TB/s / {nbytes / 1e9:.1f} GB = {limit:.1f} steps/s.", "",
                       "| B | SPS(B) steps/s | tokens/s | SPS(B)/SPS(1) | SPS(B) / bandwidth limit |", "|---:|---:|---:|---:|---:|"]
                for b in sorted(pts):
                    md.append(f"| {b} | {pts[b]:.1f} | {pts[b] * b:.0f} | {pts[b] / pts[min(pts)]:.2f} | {pts[b] / limit:.2f} |")
                md.append("")
            if table and verify:
                vp = {int(b): float(sps) for b, sps in verify["points"]}
                report["profile_verify4"] = {"sps": vp}
                md += [f"## Verify-shaped steps on {a.device}, {big} shape: 4 tokens per sequence", "",
                       "| B | SPS(B) steps/s | tokens/s | / decode SPS(1) | / decode SPS(B) |", "|---:|---:|---:|---:|---:|"]
                for b in sorted(vp):
                    md.append(f"| {b} | {vp[b]:.1f} | {vp[b] * b * 4:.0f} | {vp[b] / pts[min(pts)]:.2f} | "
                              + (f"{vp[b] / pts[b]:.2f} |" if b in pts else "- |"))
                md.append("")
            shutil.rmtree(big_dir, ignore_errors=True)
    report["failed"] = failed
    md += ["## Result", "", "FAILED steps:" if failed else "Every step ran."] + [f"- {f}" for f in failed]
    open(os.path.join(a.out, "gpu-check.md"), "w").write("\n".join(md) + "\n")
    json.dump(report, open(os.path.join(a.out, "gpu-check.json"), "w"), indent=1)
    print("\n".join(md))
    ok = not failed and all(report.get(k, {}).get("identical") == report.get(k, {}).get("prompts")
                            for k in ("lossless", "lossless_dspark"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
