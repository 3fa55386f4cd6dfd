#!/usr/bin/env python3
"""A plain PyTorch reference of shoal's models (GPT and Llama families), trained on the
same token windows shoal draws, for `scripts/parity.sh`.

    parity.py CONFIG.toml [--steps N] [--threads T] [--init torch|shoal]
              [--beta2 B] [--decay all|matrices] [--gelu erf|tanh] [--json FILE]

CONFIG is a shoal run config whose data is a text file (byte tokens) or a prepared folder.
The batches are shoal's own: its sampler (xoshiro256++ seeded through SplitMix64 and
xxh3) is reproduced here, so both see the same windows in the same order, and the eval
batches are shoal's held-out stream. The model is written the obvious PyTorch way
(nn.Linear, nn.Embedding, nn.LayerNorm, torch.optim.AdamW with its defaults); the flags
switch single choices to shoal's (its initialisation, β₂, decay only on matrices, the tanh
GELU) to find which one makes a difference. Prints one JSON object: train loss (mean of the
last 20 steps), eval loss, tokens/s.
"""
import argparse
import json
import math
import os
import sys
import time
import tomllib

import torch
import torch.nn as nn
import torch.nn.functional as F
import xxhash

M64 = (1 << 64) - 1


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def derive_seed(base, label):
    return xxhash.xxh3_64_intdigest(label.encode(), seed=mix64(base))


class Rng:
    """shoal's xoshiro256++ (src/rng.rs)."""

    def __init__(self, seed):
        self.s, x = [], seed
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & M64
            self.s.append(mix64(x))

    def next_u64(self):
        s = self.s
        rotl = lambda v, k: ((v << k) | (v >> (64 - k))) & M64
        result = (rotl((s[0] + s[3]) & M64, 23) + s[0]) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return result

    def below(self, n):
        return (self.next_u64() * n) >> 64


def batches(tokens, seed_label, data_seed, batch, seq):
    rng = Rng(derive_seed(data_seed, seed_label))
    starts = len(tokens) - seq
    while True:
        idx = torch.tensor([rng.below(starts) for _ in range(batch)])
        rows = torch.stack([tokens[i:i + seq + 1] for i in idx.tolist()])
        yield rows[:, :-1].long(), rows[:, 1:].long()


def load_tokens(cfg):
    data = cfg["data"]
    if data["source"] == "text":
        raw = open(data["path"], "rb").read()
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int32)
        return t, t
    if data["source"] == "prepared":
        meta = json.load(open(os.path.join(data["path"], "meta.json")))
        dt = {"u16": torch.int16, "u32": torch.int32}[meta["dtype"]]

        def read(files):
            parts = []
            for f in files:
                b = bytearray(open(os.path.join(data["path"], f), "rb").read())
                x = torch.frombuffer(b, dtype=dt).to(torch.int64)
                parts.append(x & 0xFFFF if dt == torch.int16 else x)
            return torch.cat(parts)

        return read(meta["train"]), read([meta["val"]])
    sys.exit(f"parity.py reads text or prepared data, not {data['source']!r}")


class Attn(nn.Module):
    def __init__(self, d, heads, kv_heads, bias, rope):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, heads * self.hd, bias=bias)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=bias)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=bias)
        self.o = nn.Linear(d, d, bias=bias)
        self.rope = rope

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Rope(nn.Module):
    def __init__(self, seq, hd, theta):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        a = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        a = torch.cat([a, a], dim=-1)
        self.register_buffer("cos", a.cos().float(), persistent=False)
        self.register_buffer("sin", a.sin().float(), persistent=False)

    def forward(self, x):
        t, half = x.shape[2], x.shape[3] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos[:t] + rot * self.sin[:t]


class RmsNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, m, llama, rope, gelu):
        super().__init__()
        d = m["d_model"]
        heads = m["n_heads"]
        eps = m.get("norm_eps", 1e-5)
        norm = (lambda: RmsNorm(d, eps)) if llama else (lambda: nn.LayerNorm(d))
        self.llama, self.gelu = llama, gelu
        self.n1, self.n2 = norm(), norm()
        self.attn = Attn(d, heads, m.get("n_kv_heads") or heads, not llama, rope)
        ratio = m.get("mlp_ratio", 4)
        if llama:
            ffn = m.get("ffn_hidden") or (2 * ratio * d // 3 + 7) // 8 * 8
            self.gate = nn.Linear(d, ffn, bias=False)
            self.up = nn.Linear(d, ffn, bias=False)
            self.down = nn.Linear(ffn, d, bias=False)
        else:
            ffn = m.get("ffn_hidden") or ratio * d
            self.up = nn.Linear(d, ffn)
            self.down = nn.Linear(ffn, d)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        if self.llama:
            h = F.silu(self.gate(h)) * self.up(h)
        else:
            h = F.gelu(self.up(h), approximate=self.gelu)
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self, m, gelu):
        super().__init__()
        llama = m.get("family", "gpt") == "llama"
        d, seq = m["d_model"], m["seq_len"]
        rope = Rope(seq, d // m["n_heads"], m.get("rope_theta", 10000.0)) if llama else None
        self.wte = nn.Embedding(m["vocab"], d)
        self.wpe = None if llama else nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(m, llama, rope, gelu) for _ in range(m["n_layers"]))
        self.norm = RmsNorm(d, m.get("norm_eps", 1e-5)) if llama else nn.LayerNorm(d)
        self.head = nn.Linear(d, m["vocab"], bias=False)
        if llama and m.get("tie_embeddings"):
            self.head.weight = self.wte.weight

    def shoal_init(self, n_layers):
        """shoal's initialisation: N(0, 0.02²) weights, residual projections scaled by
        1/√(2·layers), positions N(0, 0.01²), zero biases."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name == "wpe.weight":
                nn.init.normal_(p, std=0.01)
            elif name.endswith(("o.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, x):
        h = self.wte(x)
        if self.wpe is not None:
            h = h + self.wpe.weight[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init", choices=["torch", "shoal"], default="torch")
    ap.add_argument("--emb-std", type=float, help="after --init: embeddings N(0, s²)")
    ap.add_argument("--lin-std", choices=["fanin", "0.02"],
                    help="after --init: linear weights N(0, 1/(3·fan_in)) or N(0, 0.02²)")
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--decay", choices=["all", "matrices"], default="all")
    ap.add_argument("--gelu", choices=["none", "tanh"], default="none",
                    help="none: the exact (erf) GELU, PyTorch's default")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:0 (timed with a sync per step)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.set_num_threads(a.threads)
    cfg = tomllib.load(open(a.config, "rb"))
    m, o, tr = cfg["model"], cfg.get("optimizer", {}), cfg.get("training", {})
    torch.manual_seed(m.get("seed", 1))
    model = Model(m, a.gelu)
    if a.init == "shoal":
        model.shoal_init(m["n_layers"])
    for name, p in model.named_parameters():
        if a.emb_std is not None and name in ("wte.weight", "wpe.weight"):
            nn.init.normal_(p, std=a.emb_std)
        if a.lin_std and p.dim() == 2 and name not in ("wte.weight", "wpe.weight"):
            std = 0.02 if a.lin_std == "0.02" else 1 / math.sqrt(3 * p.shape[1])
            nn.init.normal_(p, std=std)
    model.to(dev)
    if a.decay == "all":
        groups = [{"params": list(model.parameters())}]
    else:
        mats = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "wpe" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "wte" not in n and "wpe" not in n)]
        groups = [{"params": mats}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.get("lr", 1e-3), betas=(o.get("beta1", 0.9), a.beta2),
                            eps=o.get("eps", 1e-8), weight_decay=o.get("weight_decay", 0.1))
    train_tokens, eval_tokens = load_tokens(cfg)
    batch, seq = tr.get("batch_size", 16), m["seq_len"]
    steps = a.steps or tr.get("steps", 1000)
    seed = tr.get("data_seed", 1)
    data = batches(train_tokens, "trainer/0", seed, batch, seq)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(data)
        x, y = x.to(dev), y.to(dev)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    secs = time.perf_counter() - t0
    model.eval()
    ev = batches(eval_tokens, "eval", seed, batch, seq)
    with torch.no_grad():
        evals = []
        for _ in range(8):
            x, y = next(ev)
            x, y = x.to(dev), y.to(dev)
            lg = model(x)
            evals.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1)).item())
    out = {
        "impl": "pytorch", "family": m.get("family", "gpt"), "init": a.init, "beta2": a.beta2,
        "decay": a.decay, "gelu": a.gelu, "steps": steps,
        "train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "eval_loss": sum(evals) / len(evals),
        "tokens_per_s": steps * batch * seq / secs, "seconds": secs,
        "threads": torch.get_num_threads(), "device": a.device,
    }
    print(json.dumps(out))
    if a.json:
        json.dump(out, open(a.json, "w"))


if __name__ == "__main__":
    main()
