"""File checks shared by the shipped-drafter tests: a drafter folder under drafters/ holds
config.json, model.safetensors and a manifest.json that names the weights' sha256."""
import hashlib
import json
import re
import struct
from pathlib import Path

DRAFTERS = Path(__file__).resolve().parents[2] / "drafters"


def manifest(drafter: Path):
    return json.loads((drafter / "manifest.json").read_text())


def config(drafter: Path):
    return json.loads((drafter / "config.json").read_text())


def tensors(drafter: Path):
    """The safetensors header: name -> {dtype, shape, data_offsets}."""
    raw = (drafter / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return header


def check_weights_are_the_ones_the_manifest_names(drafter: Path):
    m = manifest(drafter)["files"]["model.safetensors"]
    digest = hashlib.sha256((drafter / "model.safetensors").read_bytes()).hexdigest()
    assert digest == m["sha256"], "model.safetensors changed without its manifest"


def check_small_bf16_and_without_the_shared_target_weights(drafter: Path, budget_bytes: int):
    size = (drafter / "model.safetensors").stat().st_size
    assert size <= budget_bytes, f"{size} bytes: over the {budget_bytes / 1e6:.0f} MB budget"
    t = tensors(drafter)
    assert {v["dtype"] for v in t.values()} == {"BF16"}
    shared = [k for k in t if re.search(r"embed_tokens|lm_head", k)]
    assert not shared, f"stores the target's shared weights: {shared}"
