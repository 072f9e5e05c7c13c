"""A loopback server that speaks the Hugging Face Hub's download protocol, for the model-source
tests: `GET /api/models/ORG/REPO/revision/REV` (repo info with siblings, `?blobs=true` adds
sizes, blob ids and LFS sha256), `GET /api/models/ORG/REPO/tree/REV` (the listing
`snapshot_download` reads), `HEAD|GET /ORG/REPO/resolve/REV/FILE` with the Hub's headers
(X-Repo-Commit, ETag = git blob id, X-Linked-Etag = LFS sha256, X-Linked-Size), LFS files
redirected (302, absolute URL) to a "CDN" path that serves `Range` requests (206), and 401
with `X-Error-Code: GatedRepo` for a gated repo without the right token. The official
`huggingface_hub` client downloads from it (tests/python/test_fakehub.py), which keeps the
fake honest.

Faults for the tests: `cut_once[sha256] = n` drops the connection of the next CDN response
that covers file offset n, right there; `corrupt[sha256] = offset` flips one byte at that offset in everything
served. Every request is appended to `log` (method, path, Range header).
"""

import hashlib
import json
import os
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass
class HubFile:
    name: str
    path: Path  # content on disk (large files are not held in memory)
    size: int
    sha256: str
    git_oid: str  # sha1("blob {size}\0" + content), the git blob id

    @property
    def lfs(self) -> bool:
        return self.name.endswith(LFS_SUFFIXES)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


def hub_file(name: str, path: Path) -> HubFile:
    sha, git = hashlib.sha256(), hashlib.sha1()
    size = path.stat().st_size
    git.update(f"blob {size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            git.update(chunk)
    return HubFile(name, path, size, sha.hexdigest(), git.hexdigest())


@dataclass
class HubRepo:
    repo_id: str
    files: dict  # name -> HubFile
    commit: str
    gated_token: str | None = None  # when set, the repo answers 401 unless this token comes
    refs: dict = field(default_factory=dict)  # branch/tag -> commit


class FakeHub:
    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self.cut_once: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        # The Hub and its "CDN" on two ports: a redirect to the CDN leaves the Hub's origin,
        # as on huggingface.co, so clients read the file's metadata from the 302 itself.
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
        for s in self.servers:
            s.daemon_threads = True
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers)
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in self.servers]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        for s in self.servers:
            s.shutdown()
            s.server_close()

    def add_repo(self, repo_id: str, files: dict, gated_token: str | None = None) -> HubRepo:
        """`files`: name in the repo -> path on disk. The commit id is derived from the content."""
        hf = {n: hub_file(n, Path(p)) for n, p in files.items()}
        commit = hashlib.sha1(
            json.dumps(sorted((n, f.git_oid) for n, f in hf.items())).encode() + repo_id.encode()
        ).hexdigest()
        repo = HubRepo(repo_id, hf, commit, gated_token, {"main": commit})
        self.repos[repo_id] = repo
        return repo

    def requests(self, method: str | None = None, contains: str = ""):
        with self.lock:
            return [r for r in self.log if (method is None or r[0] == method) and contains in r[1]]

    # --- protocol -------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, head: bool):
        parsed = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(parsed.path)
        with self.lock:
            self.log.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        try:
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                return self._api(h, "/".join(parts[2:4]), parts[4], "/".join(parts[5:]))
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
            if parts[0] == "cdn" and len(parts) == 2:
                return self._cdn(h, parts[1], head)
        except BrokenPipeError:
            return
        self._error(h, 404, "RepoNotFound", "not found")

    def _error(self, h, code, error_code, message):
        body = json.dumps({"error": message}).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("X-Error-Code", error_code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _json(self, h, obj):
        body = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _repo(self, h, repo_id, rev):
        """The repo and the commit `rev` names, or None after answering the error."""
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound", f"Repository Not Found for url: {repo_id}")
            return None, None
        if repo.gated_token is not None:
            auth = h.headers.get("Authorization", "")
            if auth != f"Bearer {repo.gated_token}":
                self._error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in.")
                return None, None
        # A branch, the repo's commit, or a commit a branch was moved to (tests move `main`;
        # the files are the same at every commit).
        known = rev == repo.commit or rev in repo.refs.values()
        commit = repo.refs.get(rev) or (rev if known else None)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None, None
        return repo, commit

    def _api(self, h, repo_id, kind, rev):
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(h.path).query)
        repo, commit = self._repo(h, repo_id, rev)
        if repo is None:
            return
        if kind == "tree":
            return self._json(h, [
                {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.name,
                 **({"lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}} if f.lfs else {})}
                for f in repo.files.values()
            ])
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for f in repo.files.values():
            s = {"rfilename": f.name}
            if blobs:
                s.update({"size": f.size, "blobId": f.git_oid})
                if f.lfs:
                    s["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(s)
        self._json(h, {
            "_id": commit[:24], "id": repo_id, "modelId": repo_id, "sha": commit,
            "private": False, "disabled": False, "gated": "manual" if repo.gated_token else False,
            "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
            "lastModified": "2026-11-30T00:00:00.000Z", "createdAt": "2026-11-30T00:00:00.000Z",
        })

    def _resolve(self, h, repo_id, rev, name, head):
        repo, commit = self._repo(h, repo_id, rev)
        if repo is None:
            return
        f = repo.files.get(name)
        if f is None:
            self._error(h, 404, "EntryNotFound", f"{name} does not exist on {rev}")
            return
        common = {"X-Repo-Commit": commit, "ETag": f'"{f.git_oid}"', "Accept-Ranges": "bytes"}
        if f.lfs:
            h.send_response(302)
            for k, v in common.items():
                h.send_header(k, v)
            h.send_header("X-Linked-Etag", f'"{f.sha256}"')
            h.send_header("X-Linked-Size", str(f.size))
            h.send_header("Location", f"{self.cdn_url}/cdn/{f.sha256}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        self._serve(h, f, head, common)

    def _cdn(self, h, sha, head):
        for repo in self.repos.values():
            for f in repo.files.values():
                if f.sha256 == sha:
                    return self._serve(h, f, head, {"ETag": f'"{sha}"', "Accept-Ranges": "bytes"})
        self._error(h, 404, "EntryNotFound", "no such blob")

    def _serve(self, h, f: HubFile, head, headers):
        start, end = 0, f.size - 1
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else 0
            end = min(int(b), f.size - 1) if b else f.size - 1
            if start >= f.size:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{f.size}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        else:
            h.send_response(200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(end - start + 1))
        h.end_headers()
        if head:
            return
        with self.lock:
            cut = self.cut_once.get(f.sha256) if f.lfs else None
            if cut is not None and start <= cut <= end:
                del self.cut_once[f.sha256]
            else:
                cut = None
        corrupt = self.corrupt.get(f.sha256 if f.lfs else f.git_oid)
        with open(f.path, "rb") as src:
            src.seek(start)
            pos = start
            while pos <= end:
                chunk = bytearray(src.read(min(1 << 20, end - pos + 1)))
                if not chunk:
                    break
                if corrupt is not None and pos <= corrupt < pos + len(chunk):
                    chunk[corrupt - pos] ^= 0xFF
                if cut is not None and pos + len(chunk) > cut:
                    h.wfile.write(chunk[: cut - pos])
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(2)
                    return
                h.wfile.write(chunk)
                pos += len(chunk)


def write_tiny_hf_folder(dest: Path) -> Path:
    """A small Hugging Face model folder the engine serves: the Qwen3 layout (config.json,
    model.safetensors with random weights, a byte-level tokenizer.json and a chat template in
    tokenizer_config.json). Written with the standard library only."""
    import random
    import struct

    dest.mkdir(parents=True, exist_ok=True)
    vocab = 256 + 3
    hidden, inter, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "bos_token_id": 256, "eos_token_id": 257,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": [hidden], p + "post_attention_layernorm.weight": [hidden],
            p + "self_attn.q_proj.weight": [heads * head_dim, hidden],
            p + "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
            p + "self_attn.v_proj.weight": [kv_heads * head_dim, hidden],
            p + "self_attn.o_proj.weight": [hidden, heads * head_dim],
            p + "self_attn.q_norm.weight": [head_dim], p + "self_attn.k_norm.weight": [head_dim],
            p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
            p + "mlp.down_proj.weight": [hidden, inter],
        })
    rng = random.Random(0)
    header, blobs, offset = {}, [], 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        if name.endswith("norm.weight"):
            vals = [1.0] * n
        else:
            vals = [rng.gauss(0.0, 0.05) for _ in range(n)]
        blob = struct.pack(f"<{n}f", *vals)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * ((8 - len(head) % 8) % 8)
    with open(dest / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
    # Byte-level BPE without merges: one token per byte, plus the special tokens.
    byte_vocab = _bytes_to_unicode()
    vocab_map = {byte_vocab[b]: b for b in range(256)}
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [
            {"id": 256 + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True} for i, s in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {**vocab_map, **{s: 256 + i for i, s in enumerate(specials)}}, "merges": []},
    }
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }))
    return dest


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


if __name__ == "__main__":  # the e2e test's Hub: `fakehub.py [GGUF]` serves it as the REPOs below
    import sys
    import time

    default = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache/dspark")) / "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    with FakeHub() as hub:
        hub.add_repo("dspark-test/SmolLM2-135M-Instruct-GGUF", {gguf.name: gguf})
        # The same weights gated: only FAKEHUB_GATED_TOKEN opens it (the e2e's wrong-token check).
        hub.add_repo("dspark-test/gated-SmolLM2-135M-Instruct-GGUF", {gguf.name: gguf},
                     gated_token=os.environ.get("FAKEHUB_GATED_TOKEN", "hf_e2e_right_token"))
        print(hub.url, flush=True)
        while True:
            time.sleep(3600)
