"""Model sources: `dspark-engine fetch` and `serve --model hf://... | s3://...` against servers
on loopback: the fake Hub (tests/python/fakehub.py, checked with the official `huggingface_hub`
client here too) serving the real SmolLM2 GGUF and a small Qwen3 folder, and moto's
S3-compatible server. Resume, integrity, one download for two engines, gated repos."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engine_proc import default_model, engine_bin, launch_engine, start_engine, wait_ready
from fakehub import FakeHub, write_tiny_hf_folder

GGUF_REPO = "dspark-test/SmolLM2-135M-Instruct-GGUF"
FOLDER_REPO = "dspark-test/tiny-qwen3"
GATED_REPO = "dspark-test/gated-qwen3"
GATED_TOKEN = "hf_test_right_token"
CHUNK = 10_000_000  # hf-hub's download chunk (the resume granularity)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def gguf():
    return default_model()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def hub(gguf, folder, tmp_path_factory):
    readme = tmp_path_factory.mktemp("readme") / "README.md"
    readme.write_text("# SmolLM2 135M Instruct, GGUF Q4_1\n")
    files = {p.name: p for p in sorted(folder.iterdir())}
    with FakeHub() as h:
        h.add_repo(GGUF_REPO, {gguf.name: gguf, "README.md": readme})
        h.add_repo(FOLDER_REPO, files)
        h.add_repo(GATED_REPO, files, gated_token=GATED_TOKEN)
        yield h


def env_for(hub, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "AWS_"))}
    env.update({"HF_ENDPOINT": hub.url if hub else "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1"})
    env.update(extra)
    return env


def fetch(source, cache, env):
    r = subprocess.run([str(engine_bin()), "fetch", source, "--cache", str(cache)], env=env,
                       capture_output=True, text=True, timeout=300)
    out = json.loads(r.stdout) if r.returncode == 0 else None
    return r.returncode, out, r.stderr


def chat(url, text="Say hello."):
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({"model": "default", "messages": [{"role": "user", "content": text}],
                         "max_tokens": 8, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()


def chunk_gets(hub, sha):
    """CDN GETs that carried weight bytes (not the 0-0 metadata probes)."""
    return [r for r in hub.requests("GET", f"/cdn/{sha}") if r[2] != "bytes=0-0"]


# --- the fake Hub, checked with the official client -------------------------------------------

def test_huggingface_hub_client_downloads_from_the_fake(hub, gguf, folder, tmp_path):
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import GatedRepoError, EntryNotFoundError

    p = hf_hub_download(GGUF_REPO, gguf.name, cache_dir=tmp_path, endpoint=hub.url)
    assert sha256(Path(p)) == sha256(gguf)
    snap = Path(snapshot_download(FOLDER_REPO, cache_dir=tmp_path, endpoint=hub.url))
    for f in folder.iterdir():
        assert (snap / f.name).read_bytes() == f.read_bytes()
    assert snap.name == hub.repos[FOLDER_REPO].commit
    with pytest.raises(GatedRepoError):
        hf_hub_download(GATED_REPO, "config.json", cache_dir=tmp_path, endpoint=hub.url, token=False)
    p = hf_hub_download(GATED_REPO, "config.json", cache_dir=tmp_path, endpoint=hub.url, token=GATED_TOKEN)
    assert Path(p).read_bytes() == (folder / "config.json").read_bytes()
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(GGUF_REPO, "missing.gguf", cache_dir=tmp_path, endpoint=hub.url)


# --- the engine's fetch ------------------------------------------------------------------------

def test_fetch_gguf_into_the_hub_cache_layout(hub, gguf, tmp_path):
    rc, out, err = fetch(f"hf://{GGUF_REPO}/{gguf.name}", tmp_path, env_for(hub))
    assert rc == 0, err
    commit = hub.repos[GGUF_REPO].commit
    assert out["revision"] == commit
    assert out["model_id"] == f"{gguf.stem}@{commit[:12]}"
    assert sha256(Path(out["path"])) == sha256(gguf)
    # The same cache serves the official client offline: one layout for both.
    from huggingface_hub import hf_hub_download
    p = hf_hub_download(GGUF_REPO, gguf.name, cache_dir=tmp_path, local_files_only=True)
    assert Path(p).resolve() == Path(out["path"]).resolve()
    # A whole repo with one GGUF resolves to that file; a second fetch downloads nothing.
    before = len(hub.requests("GET", "/cdn/"))
    rc, again, err = fetch(f"hf://{GGUF_REPO}@main", tmp_path, env_for(hub))
    assert rc == 0, err
    assert again["path"] == out["path"]
    assert len(chunk_gets(hub, sha256(gguf))) == len(chunk_gets(hub, sha256(gguf)))
    assert len(hub.requests("GET", "/cdn/")) - before <= 1  # at most the metadata probe
    # Pinned to the commit and complete in the cache: no Hub needed at all.
    rc, pinned, err = fetch(f"hf://{GGUF_REPO}@{commit}/{gguf.name}", tmp_path, env_for(None))
    assert rc == 0, err
    assert pinned["path"] == out["path"]


def test_a_pinned_commit_holds_when_the_branch_moves(hub, gguf, tmp_path):
    """The operator pins the commit a deployment's first fetch resolved (a `SOURCE REVISION`
    line in the revision pins file): after the branch moved, a fetch of the same source string
    still gets that commit, while an unpinned one follows the branch. The success report (the
    JSON on stdout) is the termination message the operator reads the revision from."""
    source = f"hf://{GGUF_REPO}@main/{gguf.name}"
    repo = hub.repos[GGUF_REPO]
    commit, moved = repo.commit, "f" * 40
    pins = tmp_path / "revision-pins"
    pins.write_text(f"hf://{GGUF_REPO}/other.gguf {moved}\n{source} {commit}\n")
    repo.refs["main"] = moved
    try:
        rc, unpinned, err = fetch(source, tmp_path / "c1", env_for(hub))
        assert rc == 0, err
        assert unpinned["revision"] == moved

        def pinned_fetch(cache):
            term = tmp_path / f"{cache}.termination-log"
            r = subprocess.run([str(engine_bin()), "fetch", source, "--cache", str(tmp_path / cache),
                                "--revision-pins", str(pins), "--termination-log", str(term)],
                               env=env_for(hub), capture_output=True, text=True, timeout=300)
            return r, (term.read_text() if term.exists() else "")

        r, term = pinned_fetch("c2")
        assert r.returncode == 0, r.stderr
        report = json.loads(term)
        assert report == json.loads(r.stdout)
        assert (report["source"], report["revision"]) == (source, commit)
        assert report["model_id"] == f"{gguf.stem}@{commit[:12]}"
        # The engine's own resolution honours the pins the same way (DSPARK_REVISION_PINS).
        env = env_for(hub, DSPARK_REVISION_PINS=str(pins))
        rc, viaenv, err = fetch(source, tmp_path / "c3", env)
        assert rc == 0, err
        assert viaenv["revision"] == commit
        # A pin the Hub does not know fails, naming it, and the error is the message.
        pins.write_text(f"{source} {'0' * 40}\n")
        r, term = pinned_fetch("c4")
        assert r.returncode != 0
        assert "0" * 40 in term, term
    finally:
        repo.refs["main"] = commit


def test_interrupted_download_resumes_where_it_stopped(hub, gguf, tmp_path):
    sha = sha256(gguf)
    start = len(hub.log)
    hub.cut_once[sha] = 3 * CHUNK + 4_000_000  # the connection drops inside the 4th chunk
    rc, out, err = fetch(f"hf://{GGUF_REPO}/{gguf.name}", tmp_path, env_for(hub))
    assert rc == 0, err
    assert "resuming" in err
    assert sha256(Path(out["path"])) == sha
    ranges = [r[2] for r in hub.log[start:] if r[0] == "GET" and r[1] == f"/cdn/{sha}" and r[2] != "bytes=0-0"]
    starts = [int(r.split("=")[1].split("-")[0]) for r in ranges]
    # Chunks 0..3 once each, then (after the drop) from chunk 3 on, never from 0 again.
    assert starts.count(0) == 1, starts
    assert starts.count(3 * CHUNK) == 2, starts
    assert starts == sorted(starts[:4]) + sorted(starts[4:]) and starts[4] == 3 * CHUNK, starts


def test_a_corrupted_byte_is_caught_and_nothing_is_left(hub, gguf, tmp_path):
    sha = sha256(gguf)
    hub.corrupt[sha] = 12_345_678
    try:
        rc, _, err = fetch(f"hf://{GGUF_REPO}/{gguf.name}", tmp_path, env_for(hub))
    finally:
        del hub.corrupt[sha]
    assert rc != 0
    assert "checksum mismatch" in err and sha in err, err
    assert not list(tmp_path.glob("models--*/snapshots/*/*.gguf"))
    assert not list(tmp_path.glob("models--*/blobs/" + sha))
    rc, out, err = fetch(f"hf://{GGUF_REPO}/{gguf.name}", tmp_path, env_for(hub))
    assert rc == 0, err
    assert sha256(Path(out["path"])) == sha


def test_gated_repo_needs_a_token(hub, folder, tmp_path):
    rc, _, err = fetch(f"hf://{GATED_REPO}", tmp_path, env_for(hub))
    assert rc != 0
    assert GATED_REPO in err and "HF_TOKEN" in err and "401" in err, err
    rc, _, err = fetch(f"hf://{GATED_REPO}", tmp_path, env_for(hub, HF_TOKEN="hf_wrong"))
    assert rc != 0 and "refused the token" in err, err
    rc, out, err = fetch(f"hf://{GATED_REPO}", tmp_path, env_for(hub, HF_TOKEN=GATED_TOKEN))
    assert rc == 0, err
    assert (Path(out["path"]) / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_unknown_scheme_and_missing_file_are_clear(hub, tmp_path):
    rc, _, err = fetch("gs://bucket/model.gguf", tmp_path, env_for(hub))
    assert rc != 0 and "unknown model source scheme 'gs://'" in err, err
    rc, _, err = fetch(f"hf://{GGUF_REPO}/nope.gguf", tmp_path, env_for(hub))
    assert rc != 0 and "has no file 'nope.gguf'" in err and "SmolLM2" in err, err
    rc, _, err = fetch("hf://dspark-test/no-such-repo", tmp_path, env_for(hub))
    assert rc != 0 and "dspark-test/no-such-repo" in err, err


def test_https_source_with_a_checksum(hub, gguf, tmp_path):
    sha = sha256(gguf)
    rc, out, err = fetch(f"{hub.cdn_url}/cdn/{sha}#sha256={sha}", tmp_path, env_for(hub))
    assert rc == 0, err
    assert sha256(Path(out["path"])) == sha
    rc, _, err = fetch(f"{hub.cdn_url}/cdn/{sha}#sha256={'0' * 64}", tmp_path / "other", env_for(hub))
    assert rc != 0 and "checksum mismatch" in err, err


# --- serving from remote sources ---------------------------------------------------------------

def test_two_engines_on_one_cache_download_once_and_serve(hub, gguf, tmp_path):
    sha = sha256(gguf)
    before = len(chunk_gets(hub, sha))
    env = env_for(hub)
    source = f"hf://{GGUF_REPO}"
    a = launch_engine(["--cache", str(tmp_path)], "dspark-src-a.log", model=source, env=env)
    b = launch_engine(["--cache", str(tmp_path)], "dspark-src-b.log", model=source, env=env)
    try:
        for proc, url, log in (a, b):
            wait_ready(proc, url, log)
        n = -(-gguf.stat().st_size // CHUNK)
        assert len(chunk_gets(hub, sha)) - before == n, "the weights were downloaded more than once"
        for _, url, _ in (a, b):
            assert chat(url)["usage"]["completion_tokens"] > 0
        logs = a[2].read_text() + b[2].read_text()
        assert "waiting for it" in logs  # one engine waited on the other's download
    finally:
        stop(a[0])
        stop(b[0])


def test_several_files_and_globs_fetch_exactly_those_and_serve(hub, folder, tmp_path):
    # huggingface_hub's allow_patterns, as a DSparkDeployment's huggingFace.files sends them.
    want = "config.json,*.safetensors,tokenizer*.json"
    rc, out, err = fetch(f"hf://{FOLDER_REPO}/{want}", tmp_path, env_for(hub))
    assert rc == 0, err
    snapshot = Path(out["path"])
    assert snapshot.name == hub.repos[FOLDER_REPO].commit
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert expected <= {p.name for p in folder.iterdir()}
    assert {p.name for p in snapshot.iterdir()} == expected
    for name in expected:
        assert (snapshot / name).read_bytes() == (folder / name).read_bytes()
    # A selection whose pattern matches nothing names it and downloads nothing more.
    rc, _, err = fetch(f"hf://{FOLDER_REPO}/config.json,*.bin", tmp_path, env_for(hub))
    assert rc != 0 and "has no file '*.bin'" in err, err
    # One GGUF named beside another file: the engine opens the GGUF.
    rc, out, err = fetch(f"hf://{GGUF_REPO}/README.md,*.gguf", tmp_path, env_for(hub))
    assert rc == 0, err
    assert out["path"].endswith(".gguf") and (Path(out["path"]).parent / "README.md").is_file()
    proc, url, log = start_engine(["--cache", str(tmp_path)], "dspark-src-files.log",
                                  model=f"hf://{FOLDER_REPO}/{want}", env=env_for(hub))
    try:
        assert chat(url)["usage"]["completion_tokens"] > 0
    finally:
        stop(proc)


def test_a_full_cache_volume_fails_before_writing_anything(hub, gguf, tmp_path):
    # The cache on a 16 MiB tmpfs in a mount namespace of its own (root or user namespaces).
    cache = tmp_path / "cache"
    cache.mkdir()
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode().strip()}")
    script = (f'mount -t tmpfs -o size=16m tmpfs "{cache}" && '
              f'exec "{engine_bin()}" fetch "hf://{GGUF_REPO}/{gguf.name}" --cache "{cache}"')
    start = len(hub.log)
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env_for(hub),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    assert f"no space left for hf://{GGUF_REPO}" in r.stderr and "MB are free" in r.stderr, r.stderr
    # Checked before a weight byte moved (the operator reads this message as
    # ModelAvailable=False, reason CacheVolumeFull: operator/src/reconcile/model.rs).
    assert not [x for x in hub.log[start:] if x[1].startswith("/cdn/") and x[2] != "bytes=0-0"]


def test_serve_a_hugging_face_folder(hub, tmp_path):
    proc, url, log = start_engine(["--cache", str(tmp_path)], "dspark-src-folder.log",
                                  model=f"hf://{FOLDER_REPO}", env=env_for(hub))
    try:
        r = chat(url)
        assert r["usage"]["completion_tokens"] > 0
    finally:
        stop(proc)


# --- S3 (moto's S3-compatible server) ----------------------------------------------------------

@pytest.fixture(scope="module")
def s3(gguf):
    import boto3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            assert time.time() < deadline, "moto server did not start"
            time.sleep(0.2)
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket="models")
    with open(gguf, "rb") as f:
        client.put_object(Bucket="models", Key=f"smollm2/{gguf.name}", Body=f)
    yield creds, client
    proc.terminate()
    proc.wait(timeout=10)


def test_s3_source_fetches_checks_and_serves(s3, gguf, tmp_path):
    creds, client = s3
    env = env_for(None, **creds)
    source = f"s3://models/smollm2/{gguf.name}"
    rc, out, err = fetch(source, tmp_path, env)
    assert rc == 0, err
    etag = client.head_object(Bucket="models", Key=f"smollm2/{gguf.name}")["ETag"].strip('"')
    assert out["revision"] == etag
    assert sha256(Path(out["path"])) == sha256(gguf)
    rc, _, err = fetch("s3://models/missing.gguf", tmp_path, env)
    assert rc != 0 and "not found" in err, err
    proc, url, _ = start_engine(["--cache", str(tmp_path)], "dspark-src-s3.log", model=source, env=env)
    try:
        assert chat(url)["usage"]["completion_tokens"] > 0
    finally:
        stop(proc)
