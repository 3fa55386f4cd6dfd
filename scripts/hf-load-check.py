#!/usr/bin/env python3
"""Loads a `shoal export` of a llama-family run into Hugging Face transformers'
LlamaForCausalLM and checks it computes what shoal computes: the greedy continuation of a
prompt must equal `shoal generate --temperature 0`'s.

    scripts/hf-load-check.py MODEL.safetensors TOKENIZER.json [PROMPT]

Needs torch, transformers and safetensors (a development tool, not a dependency of shoal);
SHOAL points at the binary (default target/release/shoal).
"""
import json
import os
import subprocess
import sys
import tomllib

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

model_path, tok_path = sys.argv[1], sys.argv[2]
prompt = sys.argv[3] if len(sys.argv) > 3 else "The "
shoal = os.environ.get("SHOAL", "target/release/shoal")
tokens = 20

with safe_open(model_path, "pt") as f:
    meta = f.metadata()
    state = {k: f.get_tensor(k) for k in f.keys()}
cfg = tomllib.loads(meta["shoal.config"])["model"]
if cfg.get("family") != "llama":
    sys.exit(f"{model_path} is a {cfg.get('family', 'gpt')} model; this check is for llama")
d, heads = cfg["d_model"], cfg["n_heads"]
ffn = cfg.get("ffn_hidden") or ((2 * cfg.get("mlp_ratio", 4) * d // 3 + 7) // 8 * 8)
hf = LlamaConfig(
    vocab_size=cfg["vocab"],
    hidden_size=d,
    intermediate_size=ffn,
    num_hidden_layers=cfg["n_layers"],
    num_attention_heads=heads,
    num_key_value_heads=cfg.get("n_kv_heads") or heads,
    max_position_embeddings=cfg["seq_len"],
    rms_norm_eps=cfg.get("norm_eps", 1e-5),
    rope_theta=cfg.get("rope_theta", 10000.0),
    tie_word_embeddings=bool(cfg.get("tie_embeddings", False)),
    attention_bias=False,
    mlp_bias=False,
)
model = LlamaForCausalLM(hf).eval()
missing, unexpected = model.load_state_dict(state, strict=False)
missing = [m for m in missing if not (hf.tie_word_embeddings and m == "lm_head.weight")]
if missing or unexpected:
    sys.exit(f"names do not match transformers' Llama: missing {missing}, unexpected {unexpected}")

tok = Tokenizer.from_file(tok_path)
ids = tok.encode(prompt).ids
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))
hf_text = prompt + tok.decode(out[0, len(ids):].tolist())
ours = subprocess.run(
    [shoal, "generate", "--model", model_path, "--tokenizer", tok_path, "--prompt", prompt,
     "--tokens", str(tokens), "--temperature", "0"],
    check=True, capture_output=True, text=True).stdout.removesuffix("\n")
print(json.dumps({"transformers": hf_text, "shoal": ours}))
if hf_text != ours:
    sys.exit("the greedy continuations differ")
print(f"transformers' LlamaForCausalLM loads {model_path} ({len(state)} tensors) and continues "
      f"the prompt as shoal does ({tokens} greedy tokens)")
