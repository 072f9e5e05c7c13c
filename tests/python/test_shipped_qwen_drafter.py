"""The shipped Qwen2.5-Coder-1.5B drafter is what its manifest says it is (issue #50).

`serve --model <the 1.5B GGUF>` picks drafters/qwen2.5-coder-1.5b-dspark-markov by default
(the engine's loader test covers that). These file checks catch weights replaced without the
manifest (or the other way round), a checkpoint over the 64 MB the repository and the engine
image carry or storing the target's shared embedding / LM head, STS temperatures in
config.json that are not the calibration the manifest records, and data totals that do not
add up.
"""
import re

import shipped

DRAFTER = shipped.DRAFTERS / "qwen2.5-coder-1.5b-dspark-markov"


def manifest():
    return shipped.manifest(DRAFTER)


def config():
    return shipped.config(DRAFTER)


def tensors():
    return shipped.tensors(DRAFTER)


def test_weights_are_the_ones_the_manifest_names():
    shipped.check_weights_are_the_ones_the_manifest_names(DRAFTER)


def test_under_64_mb_bf16_and_without_the_shared_target_weights():
    shipped.check_small_bf16_and_without_the_shared_target_weights(DRAFTER, 64 * 1000 * 1000)


def test_architecture_matches_config_and_tensors():
    arch, c, t = manifest()["architecture"], config(), tensors()
    assert c["num_hidden_layers"] == arch["layers"]
    assert c["block_size"] == arch["block_size"]
    assert c["target_layer_ids"] == arch["target_layers"]
    assert c["intermediate_size"] == arch["intermediate_size"]
    assert c["markov_rank"] == arch["markov_rank"]
    assert len(c["draft_vocab"]) == arch["draft_vocab"]
    assert bool(c.get("full_block")) == arch["full_block"]
    assert bool(c.get("compact_w1")) == arch["compact_w1"]
    assert t["markov_head.markov_w1.weight"]["shape"] == [arch["draft_vocab"] + 1, arch["markov_rank"]]
    assert t["markov_head.markov_w2.weight"]["shape"] == [arch["draft_vocab"], arch["markov_rank"]]


def test_sts_in_config_is_the_calibration_the_manifest_records():
    c = config()
    by_mode = {s["sts"]["mode"]: s for s in manifest()["sts"]}
    for key, mode in [("sts_temperatures", "sampled"), ("sts_temperatures_greedy", "greedy")]:
        sts = by_mode[mode]["sts"]
        assert len(c[key]) == c["block_size"]
        for a, b in zip(c[key], sts["temperatures"]):
            assert abs(a - b) < 1e-5, (key, c[key], sts["temperatures"])
        assert sts["ece_all_after"] <= sts["ece_all_before"]
        assert by_mode[mode]["acceptance"]["tau"] > 1.0


def test_data_and_budget_add_up():
    m = manifest()
    ds = m["data"]["datasets"]
    assert sum(d["sequences"] for d in ds) == m["data"]["sequences"]
    assert sum(d["tokens"] for d in ds) == m["data"]["tokens"]
    # Every dataset the last training command names is described, and nothing else.
    train = [c for c in m["commands"] if " --out " in c and "--init" in c][-1]
    named = re.search(r"--dataset (\S+)", train).group(1).split(",")
    assert [n.rsplit("/", 1)[1] for n in named] == [d["name"] for d in ds]
    steps = re.search(r"--steps (\d+)", train).group(1)
    stages = sorted((k for k in m["budget"] if k.startswith("stage_")), key=lambda k: int(k[6:]))
    assert int(steps) == m["budget"][stages[-1]]["steps"]
    assert m["budget"]["total_wall_seconds"] >= sum(m["budget"][k]["wall_seconds"] for k in stages)
