"""The shipped drafter is what its manifest says it is.

`make demo` serves drafters/smollm2-135m-dspark-markov; its manifest.json is the recipe that
reproduces it. These checks catch a drafter replaced without its manifest (or the other way
round), a checkpoint that stores the target's shared embedding / LM head, a dtype or size
that breaks the "small, bf16, ~25 MB" promise, a prompt file the recipe names but the repo
lacks, and STS temperatures that differ between config.json and the manifest.
"""
import json
import re
from pathlib import Path

import shipped

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = shipped.DRAFTERS / "smollm2-135m-dspark-markov"


def manifest():
    return shipped.manifest(DRAFTER)


def config():
    return shipped.config(DRAFTER)


def prompts(path):
    """The prompts of a jsonl prompt file, in order."""
    return [json.loads(s)["prompt"] for s in Path(path).read_text().splitlines() if s.strip()]


def tensors():
    return shipped.tensors(DRAFTER)


def test_weights_are_the_ones_the_manifest_names():
    shipped.check_weights_are_the_ones_the_manifest_names(DRAFTER)


def test_small_bf16_and_without_the_shared_target_weights():
    shipped.check_small_bf16_and_without_the_shared_target_weights(DRAFTER, 25 * 1000 * 1000)


def test_architecture_matches_config_and_tensors():
    arch, c, t = manifest()["architecture"], config(), tensors()
    assert c["num_hidden_layers"] == arch["layers"]
    assert c["block_size"] == arch["block_size"]
    assert c["target_layer_ids"] == arch["target_layers"]
    assert c["markov_rank"] == arch["markov_rank"]
    assert c["markov_head_type"] == manifest()["drafter"].removeprefix("dspark-")
    assert bool(c.get("compact_w1")) == arch["compact_w1"]
    assert bool(c.get("context_input")) == arch["context_input"]
    h, r = c["hidden_size"], c["markov_rank"]
    assert t["fc.weight"]["shape"] == [h, h * len(c["target_layer_ids"])]
    assert t["markov_head.markov_w2.weight"]["shape"] == [arch["draft_vocab"], r]
    w1_rows = arch["draft_vocab"] + 1 if arch["compact_w1"] else c["vocab_size"]
    assert t["markov_head.markov_w1.weight"]["shape"] == [w1_rows, r]
    layers = {int(k.split(".")[1]) for k in t if k.startswith("layers.")}
    assert layers == set(range(arch["layers"]))


def test_sts_in_config_is_the_calibration_the_manifest_records():
    c, sts = config(), manifest()["sts"]
    for key, mode in [("sts_temperatures", "sampled"), ("sts_temperatures_greedy", "greedy")]:
        assert len(c[key]) == c["block_size"]
        for a, b in zip(c[key], sts[mode]["temperatures"]):
            assert abs(a - b) < 1e-5, (key, c[key], sts[mode]["temperatures"])
        assert sts[mode]["ece_all_after"] <= 0.02, f"{mode}: ECE after STS over 2 %"
        assert sts[mode]["ece_all_after"] <= sts[mode]["ece_all_before"]


def test_recipe_names_prompt_files_the_repo_has_with_the_stated_counts():
    m = manifest()
    named = 0
    for ds in m["data"]["datasets"]:
        hit = re.match(r"(data/prompts/\S+) \(([\d,]+)", ds["prompts"])
        assert hit, ds["prompts"]
        path, count = ROOT / hit.group(1), int(hit.group(2).replace(",", ""))
        lines = prompts(path)
        assert len(lines) == count, f"{path}: {len(lines)} prompts, manifest says {count}"
        assert all(lines)
        named += 1
    commands = " ".join(m["commands"])
    for ds in m["data"]["datasets"]:
        assert ds["prompts"].split()[0] in commands
    assert named >= 2
    stages = [k for k in m["budget"] if re.fullmatch(r"stage\d+", k)]
    total = sum(m["budget"][s]["block_tokens"] for s in stages)
    assert total == m["budget"]["block_tokens"]
    assert len([c for c in m["commands"] if " train " in c and "--out" in c]) == len(stages)


def test_eval_prompts_stay_out_of_the_training_prompts():
    def norm(s):
        return " ".join(s.lower().split())

    here = ROOT / "data" / "prompts"
    train = {norm(p) for name in ["train.jsonl", "train-magpie.jsonl", "train-magpie2.jsonl"]
             for p in prompts(here / name)}
    for name in ["code.jsonl", "math.jsonl", "chat.jsonl"]:
        for p in prompts(here / name):
            assert norm(p) not in train, f"eval prompt in the training set: {p[:80]}"


# Serving with no --speculation: the model's shipped drafter, found through --drafters by the
# `target_models` its manifest lists, runs with the dspark policy at its own block size;
# `--speculation none` turns it off; a drafter for another model, or one that does not load on
# this model, leaves the server plain (and starting).

def test_manifest_names_the_models_it_serves():
    assert "SmolLM2-135M-Instruct" in manifest()["target_models"]


def serve(args, name):
    from engine_proc import start_engine
    return start_engine(["--startup-profile", "false", *args], f"dspark-shipped-{name}.log")


def get(url, path):
    import urllib.request
    with urllib.request.urlopen(url + path, timeout=30) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def complete(url, prompt):
    import urllib.request
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": 48,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def drafted(url):
    text = get(url, "/metrics")
    return sum(float(l.split()[-1]) for l in text.splitlines()
               if l.startswith("dspark_spec_decode_num_draft_tokens_total"))


PROMPTS = ["def fibonacci(n):", "The three primary colors are", "Question: What is 12 * 7?\nAnswer:"]


def test_no_speculation_flag_serves_the_shipped_drafter_losslessly():
    outs = {}
    # "auto" gives no --drafters: the default search order finds the checkout's drafters/.
    for name, args in [("auto", []),
                       ("off", ["--drafters", str(DRAFTER.parent), "--speculation", "none"])]:
        proc, url, _ = serve(args, name)
        try:
            ready = get(url, "/ready")
            outs[name] = [complete(url, p) for p in PROMPTS]
            outs[name + "-drafted"] = drafted(url)
        finally:
            proc.kill()
            proc.wait()
        if name == "auto":
            assert ready["speculation"] == "dspark-markov", ready
            assert ready["policy"] == "dspark", ready
            assert ready["gamma"] == config()["block_size"], ready
            assert Path(ready["drafter"]).resolve() == DRAFTER.resolve(), ready
        else:
            assert ready["speculation"] == "none", ready
            assert ready["drafter"] is None, ready
    assert outs["auto-drafted"] > 0, "the shipped drafter proposed nothing"
    assert outs["off-drafted"] == 0
    assert outs["auto"] == outs["off"], "speculation changed greedy output"


def test_drafters_for_other_models_or_that_do_not_load_leave_the_server_plain(tmp_path):
    other = tmp_path / "other" / "some-drafter"
    other.mkdir(parents=True)
    for f in ["config.json", "model.safetensors"]:
        (other / f).symlink_to(DRAFTER / f)
    m = manifest()
    m["target_models"] = ["Qwen3-8B"]
    (other / "manifest.json").write_text(json.dumps(m))
    # Names this model, but its config does not fit it (another hidden size): refused at load.
    broken = tmp_path / "broken" / "smollm2-wrong-shape"
    broken.mkdir(parents=True)
    c = config()
    c["hidden_size"] = 960
    (broken / "config.json").write_text(json.dumps(c))
    (broken / "model.safetensors").symlink_to(DRAFTER / "model.safetensors")
    (broken / "manifest.json").write_text(json.dumps(manifest()))
    for name, folder in [("other", other.parent), ("broken", broken.parent)]:
        proc, url, log = serve(["--drafters", str(folder)], name)
        try:
            ready = get(url, "/ready")
            assert ready["speculation"] == "none", (name, ready)
            assert complete(url, PROMPTS[0])
        finally:
            proc.kill()
            proc.wait()
        if name == "broken":
            assert "does not load on this model" in Path(log).read_text()


def test_a_drafter_without_speculation_flag_runs_its_own_head_and_block():
    proc, url, _ = serve(["--drafter", str(DRAFTER), "--drafters", "/nonexistent"], "explicit")
    try:
        ready = get(url, "/ready")
        assert complete(url, PROMPTS[1])
        assert drafted(url) > 0
    finally:
        proc.kill()
        proc.wait()
    assert (ready["speculation"], ready["policy"]) == ("dspark-markov", "dspark"), ready
    assert ready["gamma"] == config()["block_size"], ready
