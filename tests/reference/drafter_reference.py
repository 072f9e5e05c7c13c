"""Reference outputs of the public drafter implementations, for engine/tests/reference_drafters.rs.

Runs the reference PyTorch modeling code itself (DeepSeek DeepSpec's Qwen3DSparkModel and
z-lab's DFlashDraftModel, extracted by scripts/setup-reference.sh) on a tiny random Qwen3
target built with transformers, and writes under --out:
- target/: the target as a Hugging Face folder (config.json, model.safetensors, a word-level
  tokenizer.json so the engine can serve it);
- one folder per case: the drafter as its project saves it (save_pretrained), and
  reference.safetensors with the inputs fed (the target's hidden states of the prompt at the
  drafter's target layers) and the reference's outputs for the first block after the prompt:
  base logits U_k, sequential-head bias B_k, confidence logits and the greedy draft tokens;
- manifest.json: the cases.

Usage: python drafter_reference.py --deepspec DIR --dflash DIR --out DIR
(DIR of --deepspec holds the `deepspec` package, DIR of --dflash holds `dflash/model.py`.)
"""

import argparse
import json
import math
import os
import sys

import torch

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 384, 64, 128, 4, 2, 16
TARGET_LAYERS, DRAFT_LAYERS = 5, 2
LAYER_IDS = [0, 2, 3]
MASK = 380
PROMPT_LEN = 11


def randomize(module, gen):
    """Weights large enough that logits, biases and confidences are far from uniform, and
    bf16-exact, so that a checkpoint saved in bf16 (as the public ones are) holds exactly
    the weights the f32 reference computed with."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and name.endswith("bias"):
                p.copy_((torch.rand(p.shape, generator=gen) - 0.5) * 0.2)
            elif p.dim() == 1:
                p.copy_(0.7 + 0.6 * torch.rand(p.shape, generator=gen))
            elif "markov_w1" in name or "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                b = math.sqrt(3.0 / p.shape[1])
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * b)
            p.copy_(p.to(torch.bfloat16).float())


def qwen3_config(**extra):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **extra,
    )
    cfg._attn_implementation = "eager"
    return cfg


def write_tokenizer(path):
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    }
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(tok, f)


class Args(dict):
    __getattr__ = dict.__getitem__


def deepspec_case(target, hidden_states, anchor, head, block, conf_with_markov, gen):
    from deepspec.modeling.dspark.common import extract_context_feature
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config

    args = Args(
        num_draft_layers=DRAFT_LAYERS,
        target_layer_ids=LAYER_IDS,
        block_size=block,
        mask_token_id=MASK,
        num_anchors=8,
        markov_rank=0 if head == "none" else 16,
        confidence_head_alpha=0.0 if head == "none" else 1.0,
        confidence_head_with_markov=conf_with_markov,
    )
    if head != "none":
        args["markov_head_type"] = head
    cfg = build_draft_config(target.config, args)
    cfg._attn_implementation = "eager"
    model = Qwen3DSparkModel(cfg).eval()
    randomize(model, gen)
    model.initialize_embeddings_and_head(
        embed_tokens=target.model.embed_tokens, lm_head=target.lm_head
    )
    ctx = extract_context_feature(hidden_states, model.target_layer_ids)
    ids = torch.tensor([[anchor] + [MASK] * (block - 1)])
    with torch.no_grad():
        h = model._forward_backbone(
            position_ids=torch.arange(PROMPT_LEN + block).unsqueeze(0),
            noise_embedding=model.embed_tokens(ids),
            target_hidden_states=ctx,
            attention_mask=None,
            past_key_values=None,
            use_cache=False,
            is_causal=False,
        )
        base = model.compute_logits(h)
        tokens, logits = model.sample_draft_tokens(
            base,
            first_prev_token_ids=torch.tensor([anchor]),
            temperature=0.0,
            hidden_states=h,
        )
        conf = None
        if model.confidence_head is not None:
            prev = torch.cat([torch.tensor([[anchor]]), tokens[:, :-1]], dim=1)
            conf = model.predict_confidence_step(h, prev_token_ids=prev)
    return model, base[0], (logits - base)[0], None if conf is None else conf[0], tokens[0]


def dflash_case(target, hidden_states, anchor, block, gen):
    from dflash.model import DFlashDraftModel, extract_context_feature

    cfg = qwen3_config()
    cfg.num_hidden_layers = DRAFT_LAYERS
    cfg.layer_types = ["full_attention"] * DRAFT_LAYERS
    cfg.num_target_layers = TARGET_LAYERS
    cfg.block_size = block
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}
    cfg.architectures = ["DFlashDraftModel"]
    model = DFlashDraftModel(cfg).eval()
    randomize(model, gen)
    ctx = extract_context_feature(hidden_states, model.target_layer_ids)
    ids = torch.tensor([[anchor] + [MASK] * (block - 1)])
    with torch.no_grad():
        h = model(
            target_hidden=ctx,
            noise_embedding=target.model.embed_tokens(ids),
            position_ids=torch.arange(PROMPT_LEN + block).unsqueeze(0),
            past_key_values=None,
            use_cache=False,
            is_causal=False,
        )
        base = target.lm_head(h[:, 1 - block :, :])
    tokens = torch.argmax(base, dim=-1)
    return model, base[0], torch.zeros_like(base[0]), None, tokens[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspec", required=True)
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path[:0] = [a.deepspec, a.dflash]
    torch.set_default_dtype(torch.float32)
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    gen = torch.Generator().manual_seed(7)
    target = Qwen3ForCausalLM(qwen3_config()).eval()
    randomize(target, gen)
    tdir = os.path.join(a.out, "target")
    target.save_pretrained(tdir, safe_serialization=True)
    write_tokenizer(tdir)

    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=gen)
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    anchor = int(torch.argmax(out.logits[0, -1]))
    hs = out.hidden_states

    # (layout, head, block size, confidence head reads W1, dtype saved)
    cases = [
        ("deepspec", "vanilla", 7, True, "bf16"),
        ("deepspec", "vanilla", 16, True, "f32"),
        ("deepspec", "vanilla", 7, False, "f32"),
        ("deepspec", "gated", 7, True, "f32"),
        ("deepspec", "rnn", 7, True, "f32"),
        ("deepspec", "rnn", 16, True, "bf16"),
        ("deepspec", "none", 7, False, "f32"),
        ("dflash", "none", 7, False, "bf16"),
        ("dflash", "none", 16, False, "f32"),
    ]
    manifest = []
    for layout, head, block, cwm, dtype in cases:
        name = f"{layout}-{head}-b{block}" + ("" if cwm or head == "none" else "-conf-h")
        name += "-bf16" if dtype == "bf16" else ""
        d = os.path.join(a.out, name)
        if layout == "deepspec":
            model, base, bias, conf, tokens = deepspec_case(
                target, hs, anchor, head, block, cwm, gen
            )
        else:
            model, base, bias, conf, tokens = dflash_case(target, hs, anchor, block, gen)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        # One case in small shards (model.safetensors.index.json), as large checkpoints come.
        shard = "200KB" if head == "gated" else "5GB"
        model.save_pretrained(d, safe_serialization=True, max_shard_size=shard)
        if layout == "dflash" and block == 16:
            # The newer z-lab form: block_size inside dflash_config.
            p = os.path.join(d, "config.json")
            c = json.load(open(p))
            c["dflash_config"]["block_size"] = c.pop("block_size")
            json.dump(c, open(p, "w"), indent=2)
        ref = {
            "base_logits": base.contiguous(),
            "bias": bias.contiguous(),
            "tokens": tokens.to(torch.int64).contiguous(),
        }
        if conf is not None:
            ref["confidence_logits"] = conf.contiguous().float()
        for i in LAYER_IDS:
            ref[f"hidden.{i}"] = hs[i + 1][0].contiguous()
        save_file(ref, os.path.join(d, "reference.safetensors"))
        manifest.append(
            {"name": name, "layout": layout, "head": head, "block_size": block, "dtype": dtype}
        )
    json.dump(
        {
            "anchor": anchor,
            "anchor_pos": PROMPT_LEN,
            "prompt": prompt[0].tolist(),
            "layer_ids": LAYER_IDS,
            "cases": manifest,
        },
        open(os.path.join(a.out, "manifest.json"), "w"),
        indent=2,
    )


if __name__ == "__main__":
    main()
