#!/usr/bin/python3
"""DFlash drafters in the z-lab layout (config.json + model.safetensors): an independent PyTorch
forward pass, a writer and reader of the layout, and the reference fixture the C++ test compares
with (tests/data/dflash/).

    tools/dflash_drafter.py fixture OUTDIR     random tiny drafter + inputs and outputs of three
                                               draft steps, computed without a cache

Needs python3-torch (Debian; scripts/tools-deps.sh installs it). The forward here follows the
published model (z-lab dflash/model.py) and recomputes the whole context every step, so it checks
the C++ drafter's context-only cache, its RoPE offsets and its non-causal attention.
"""
import argparse
import json
import math
import os
import struct
import sys

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


# ---------------------------------------------------------------- safetensors (no extra package)

def write_safetensors(path, tensors, metadata=None):
    """tensors: dict name -> tensor (F32, F16 or BF16), written in insertion order."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        buf = bytearray(data[8 + n + b:8 + n + e])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(TORCH_DTYPES[info["dtype"]]).reshape(info["shape"]).clone()
    return out


# ---------------------------------------------------------------- the drafter

class Config:
    def __init__(self, hidden, ff, layers, heads, kv_heads, head_dim, block, target_layers, taps, mask_id,
                 vocab=None, eps=1e-6, theta=10000.0):
        self.hidden, self.ff, self.layers, self.heads, self.kv_heads = hidden, ff, layers, heads, kv_heads
        self.head_dim, self.block, self.target_layers, self.taps = head_dim, block, target_layers, list(taps)
        self.mask_id, self.vocab, self.eps, self.theta = mask_id, vocab, eps, theta

    def to_json(self):
        c = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden, "intermediate_size": self.ff, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "block_size": self.block, "num_target_layers": self.target_layers,
            "dflash_config": {"mask_token_id": self.mask_id, "target_layer_ids": self.taps},
            "rms_norm_eps": self.eps, "rope_theta": self.theta, "rope_scaling": None,
            "hidden_act": "silu", "attention_bias": False, "layer_types": ["full_attention"] * self.layers,
        }
        if self.vocab:
            c["vocab_size"] = self.vocab
        return c

    @staticmethod
    def from_json(c):
        d = c["dflash_config"]
        return Config(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                      c.get("num_key_value_heads", c["num_attention_heads"]),
                      c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]), c["block_size"],
                      c["num_target_layers"], d["target_layer_ids"], d["mask_token_id"], c.get("vocab_size"),
                      c.get("rms_norm_eps", 1e-6), c.get("rope_theta", 10000.0))


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """x [..., n, heads, D] rotated at positions pos [n]: the halves of a head pair up (HF rotate_half)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Drafter:
    """The weights by their file names (p), and the forward pass."""

    def __init__(self, cfg, own_mask=False):
        self.cfg = cfg
        H, Q, KV, F = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ff
        P = lambda t: t.requires_grad_()
        self.p = {}
        self.p["fc.weight"] = P(torch.randn(H, H * len(cfg.taps)) / math.sqrt(H * len(cfg.taps)))
        self.p["hidden_norm.weight"] = P(torch.ones(H))
        self.p["norm.weight"] = P(torch.ones(H))
        for i in range(cfg.layers):
            pre = f"layers.{i}."
            for name, shape in [("self_attn.q_proj", (Q, H)), ("self_attn.k_proj", (KV, H)), ("self_attn.v_proj", (KV, H)),
                                ("self_attn.o_proj", (H, Q)), ("mlp.gate_proj", (F, H)), ("mlp.up_proj", (F, H)),
                                ("mlp.down_proj", (H, F))]:
                self.p[pre + name + ".weight"] = P(torch.randn(*shape) / math.sqrt(shape[1]))
            for name, n in [("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.q_norm", cfg.head_dim),
                            ("self_attn.k_norm", cfg.head_dim)]:
                self.p[pre + name + ".weight"] = P(torch.ones(n))
        if own_mask:
            self.p["mask_embedding"] = P(torch.randn(H) * 0.02)

    def parameters(self):
        return list(self.p.values())

    def to(self, dtype):
        self.p = {k: v.detach().to(dtype).requires_grad_() for k, v in self.p.items()}
        return self

    def __call__(self, embd, taps):
        """embd [N, B, H]: blocks at positions C .. C+B-1; taps [N, C, n_taps*H]: the context.
        Returns [N, B, H] after the final norm (no cache: the whole context every call)."""
        cfg, eps = self.cfg, self.cfg.eps
        n, B, _ = embd.shape
        C = taps.shape[1]
        D, G = cfg.head_dim, cfg.heads // cfg.kv_heads
        ctx = rms_norm(taps @ self.p["fc.weight"].T, self.p["hidden_norm.weight"], eps)
        kpos = torch.arange(C + B)
        qpos = torch.arange(C, C + B)
        x = embd
        for i in range(cfg.layers):
            w = lambda name: self.p[f"layers.{i}.{name}.weight"]
            h = rms_norm(x, w("input_layernorm"), eps)
            q = (h @ w("self_attn.q_proj").T).view(n, B, cfg.heads, D)
            kin = torch.cat([ctx, h], 1)
            k = (kin @ w("self_attn.k_proj").T).view(n, C + B, cfg.kv_heads, D)
            v = (kin @ w("self_attn.v_proj").T).view(n, C + B, cfg.kv_heads, D)
            q = rope(rms_norm(q, w("self_attn.q_norm"), eps), qpos, cfg.theta)
            k = rope(rms_norm(k, w("self_attn.k_norm"), eps), kpos, cfg.theta)
            k = k.repeat_interleave(G, dim=2)
            v = v.repeat_interleave(G, dim=2)
            s = torch.einsum("nbhd,nkhd->nhbk", q, k) / math.sqrt(D)
            a = torch.einsum("nhbk,nkhd->nbhd", s.softmax(-1), v).reshape(n, B, cfg.heads * D)
            x = x + a @ w("self_attn.o_proj").T
            g = rms_norm(x, w("post_attention_layernorm"), eps)
            x = x + (torch.nn.functional.silu(g @ w("mlp.gate_proj").T) * (g @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
        return rms_norm(x, self.p["norm.weight"], eps)


def save_drafter(model, outdir, dtype=torch.float16):
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "config.json"), "w") as f:
        json.dump(model.cfg.to_json(), f, indent=2)
        f.write("\n")
    write_safetensors(os.path.join(outdir, "model.safetensors"),
                      {k: v.detach().to(dtype) for k, v in model.p.items()}, {"format": "pt"})


def load_drafter(indir, dtype=torch.float64):
    with open(os.path.join(indir, "config.json")) as f:
        cfg = Config.from_json(json.load(f))
    weights = read_safetensors(os.path.join(indir, "model.safetensors"))
    m = Drafter(cfg, own_mask="mask_embedding" in weights)
    m.p = {k: v.to(dtype).requires_grad_() for k, v in weights.items()}
    return m


# ---------------------------------------------------------------- the reference fixture

def fixture(outdir):
    """A tiny GQA drafter (q_dim != hidden) and three cached draft steps' reference outputs:
    5 new context rows, then 3 more, then the cache cropped to 6 rows and 2 new ones."""
    torch.manual_seed(15)
    cfg = Config(hidden=16, ff=24, layers=2, heads=4, kv_heads=2, head_dim=8, block=4, target_layers=8,
                 taps=[1, 3, 5], mask_id=9, theta=10000.0)
    m = Drafter(cfg)
    with torch.no_grad():  # non-trivial norm weights
        for k in m.p:
            if k.endswith("norm.weight"):
                m.p[k].mul_(0).add_(1 + 0.3 * torch.randn_like(m.p[k]))
    save_drafter(m, outdir, torch.float16)
    ref = load_drafter(outdir, torch.float64)  # the stored (F16-rounded) weights, in float64
    T = cfg.hidden * len(cfg.taps)
    taps = torch.randn(10, T)
    out = {"taps": taps.float()}
    steps = [(0, 5), (5, 8), (6, 8)]  # (rows kept from before, context rows after the step's append)
    with torch.no_grad():
        for s, (_, c) in enumerate(steps):
            embd = torch.randn(1, cfg.block, cfg.hidden)
            y = ref(embd.double(), taps[:c].double()[None])[0]
            out[f"embd{s}"] = embd[0].float()
            out[f"out{s}"] = y.float()
    out["steps"] = torch.tensor([float(v) for st in steps for v in st])
    write_safetensors(os.path.join(outdir, "reference.safetensors"), out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixture", help="write the C++ test's reference drafter and outputs")
    f.add_argument("outdir")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "fixture":
        fixture(args.outdir)


if __name__ == "__main__":
    sys.exit(main())
