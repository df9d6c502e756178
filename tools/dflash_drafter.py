#!/usr/bin/python3
"""DFlash drafters in the z-lab layout (config.json + model.safetensors): an independent PyTorch
forward pass, a writer and reader of the layout, and the reference fixture the C++ test compares
with (tests/data/dflash/).

    tools/dflash_drafter.py fixture OUTDIR     random tiny drafter + inputs and outputs of three
                                               draft steps, computed without a cache
    tools/dflash_drafter.py train DATA OUTDIR  train a drafter on `specmesh dflash-data` output
                                               (the target's own samples and taps)

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

    def forward(self, embd, anchors, taps):
        """Blocks of one sequence. embd [K, B, H]: block k sits at positions anchors[k] ..
        anchors[k]+B-1 and sees the context rows before anchors[k] and its own rows, all of them
        (non-causal); taps [C, n_taps*H]: the sequence's context. Returns [K, B, H] after the
        final norm. At inference (one block, every context row before it) this is the published
        forward; in training it is SpecForge's layout: blocks never see each other."""
        cfg, eps = self.cfg, self.cfg.eps
        K, B, _ = embd.shape
        C = taps.shape[0]
        D, G = cfg.head_dim, cfg.heads // cfg.kv_heads
        ctx = rms_norm(taps @ self.p["fc.weight"].T, self.p["hidden_norm.weight"], eps)  # [C, H]
        bpos = (anchors[:, None] + torch.arange(B)[None, :]).reshape(-1)  # [K*B]
        visible = torch.arange(C)[None, :] < anchors[:, None]  # [K, C]
        bias = torch.zeros(K, 1, 1, C + B, dtype=embd.dtype)
        bias[:, 0, 0, :C].masked_fill_(~visible, float("-inf"))
        x = embd
        for i in range(cfg.layers):
            w = lambda name: self.p[f"layers.{i}.{name}.weight"]
            h = rms_norm(x, w("input_layernorm"), eps)
            q = (h @ w("self_attn.q_proj").T).view(K * B, cfg.heads, D)
            q = rope(rms_norm(q, w("self_attn.q_norm"), eps), bpos, cfg.theta).view(K, B, cfg.heads, D)
            kc = (ctx @ w("self_attn.k_proj").T).view(C, cfg.kv_heads, D)
            kc = rope(rms_norm(kc, w("self_attn.k_norm"), eps), torch.arange(C), cfg.theta)
            vc = (ctx @ w("self_attn.v_proj").T).view(C, cfg.kv_heads, D)
            kb = (h @ w("self_attn.k_proj").T).view(K * B, cfg.kv_heads, D)
            kb = rope(rms_norm(kb, w("self_attn.k_norm"), eps), bpos, cfg.theta).view(K, B, cfg.kv_heads, D)
            vb = (h @ w("self_attn.v_proj").T).view(K, B, cfg.kv_heads, D)
            kc, vc = kc.repeat_interleave(G, dim=1), vc.repeat_interleave(G, dim=1)
            kb, vb = kb.repeat_interleave(G, dim=2), vb.repeat_interleave(G, dim=2)
            s = torch.cat([torch.einsum("kbhd,chd->khbc", q, kc), torch.einsum("kbhd,kehd->khbe", q, kb)], -1)
            p = (s / math.sqrt(D) + bias).softmax(-1)
            a = torch.einsum("khbc,chd->kbhd", p[..., :C], vc) + torch.einsum("khbe,kehd->kbhd", p[..., C:], vb)
            x = x + a.reshape(K, B, cfg.heads * D) @ w("self_attn.o_proj").T
            g = rms_norm(x, w("post_attention_layernorm"), eps)
            x = x + (torch.nn.functional.silu(g @ w("mlp.gate_proj").T) * (g @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
        return rms_norm(x, self.p["norm.weight"], eps)

    def __call__(self, embd, taps):
        """embd [N, B, H]: blocks at positions C .. C+B-1 after the whole context taps [C, n_taps*H]."""
        C = taps.shape[0]
        return self.forward(embd, torch.full((embd.shape[0],), C, dtype=torch.long), taps)


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
            y = ref(embd.double(), taps[:c].double())[0]
            out[f"embd{s}"] = embd[0].float()
            out[f"out{s}"] = y.float()
    out["steps"] = torch.tensor([float(v) for st in steps for v in st])
    write_safetensors(os.path.join(outdir, "reference.safetensors"), out)


# ---------------------------------------------------------------- training

def train(args):
    """Trains a drafter on `specmesh dflash-data` output: blocks at random anchors of the
    target's own samples, cross-entropy of rows 1..B-1, weighted by exp(-(k-1)/gamma), through
    the target's (frozen) classifier. The labels (--labels) are the tokens that followed
    (`sampled`), or the target's own greedy choice at each position (`greedy`, what acceptance at
    temperature 0 compares a proposal with); with greedy labels a row counts only while the
    sampled tokens before it in the block are the target's greedy ones too, as a proposal is
    only checked after the ones before it were accepted."""
    torch.manual_seed(args.seed)
    data = read_safetensors(args.data)
    with open(args.data, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n)).get("__metadata__", {})
    tokens = data["tokens"].long()
    if args.labels == "greedy" and "greedy" not in data:
        sys.exit(f"{args.data}: no 'greedy' tensor (written by specmesh dflash-data since 2026-11-28); use --labels sampled")
    greedy = data["greedy"].long() if args.labels == "greedy" else None
    offsets = data["offsets"].long().tolist()
    taps = data["taps"].float()
    tok_embd, output = data["tok_embd"].float(), data["output"].float()
    V, H = tok_embd.shape
    layer_ids = [int(i) for i in meta["target_layer_ids"].split(",")]
    cfg = Config(hidden=H, ff=args.ff, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=H // args.heads, block=args.block, target_layers=int(meta["num_target_layers"]),
                 taps=layer_ids, mask_id=V, vocab=V, eps=float(meta.get("rms_norm_eps", 1e-5)), theta=10000.0)
    m = Drafter(cfg, own_mask=True)
    if args.init:  # continue from a drafter written earlier (same shape, or fewer layers)
        init = read_safetensors(os.path.join(args.init, "model.safetensors"))
        for k, v in init.items():
            if k not in m.p or m.p[k].shape != v.shape:
                sys.exit(f"--init {args.init}: {k} {list(v.shape)} does not fit this drafter")
            m.p[k] = v.float().requires_grad_()
        # Layers the earlier drafter did not have start as the identity: their output
        # projections are zero, so the residual stream passes them unchanged and training starts
        # from the earlier drafter's accuracy (depth up-scaling).
        for i in range(cfg.layers):
            if f"layers.{i}.self_attn.q_proj.weight" not in init:
                for name in ("self_attn.o_proj", "mlp.down_proj"):
                    m.p[f"layers.{i}.{name}.weight"] = torch.zeros_like(m.p[f"layers.{i}.{name}.weight"]).requires_grad_()
    opt = torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01)
    B = cfg.block
    decay = torch.exp(-(torch.arange(1, B, dtype=torch.float32) - 1) / args.gamma)
    seqs = [(offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1) if offsets[i + 1] - offsets[i] > B + 2]
    n_eval = max(1, len(seqs) // 20)
    evals, seqs = seqs[:n_eval], seqs[n_eval:]
    steps = args.epochs * len(seqs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.05)

    def blocks(b, e, k):
        n = e - b
        anchors = torch.randint(1, n - 1, (k,))  # the anchor's own hidden state is not known yet
        idx = anchors[:, None] + torch.arange(B)[None, :]
        valid = idx < n
        toks = tokens[b:e][idx.clamp(max=n - 1)]
        embd = torch.cat([tok_embd[toks[:, :1]], m.p["mask_embedding"].expand(k, B - 1, H)], 1)
        if greedy is None:
            return anchors, embd, toks[:, 1:], valid[:, 1:]
        # Row r's label: the target's choice after position anchor + r - 1; the row counts while
        # the block's sampled tokens 1 .. r - 1 were the target's choices too.
        labels = greedy[b:e][idx.clamp(max=n - 1)][:, :-1]
        on_path = torch.cumprod(torch.cat([torch.ones(k, 1), (toks[:, 1:-1] == labels[:, :-1]).float()], 1), 1)
        return anchors, embd, labels, valid[:, 1:] & (on_path > 0)

    def loss_of(b, e, k):
        anchors, embd, labels, valid = blocks(b, e, k)
        out = m.forward(embd, anchors, taps[b:e])
        logits = out[:, 1:] @ output.T
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(labels.shape)
        w = decay[None, :] * valid
        acc = ((logits.argmax(-1) == labels) & valid)
        # expected accepted length under greedy acceptance: the run of correct rows from row 1
        run = torch.cumprod(acc.float(), 1).sum(1).mean()
        return (ce * w).sum() / w.sum(), run

    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(seqs)).tolist()
        for j in order:
            b, e = seqs[j]
            loss, _ = loss_of(b, e, args.anchors)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0:
                print(f"step {step}/{steps} loss {loss.item():.3f}", flush=True)
        with torch.no_grad():
            torch.manual_seed(0)
            runs = [loss_of(b, e, args.anchors)[1].item() for b, e in evals]
        print(f"epoch {epoch + 1}: held-out mean accepted run {sum(runs) / len(runs):.2f} (tau ~ {1 + sum(runs) / len(runs):.2f})",
              flush=True)
        save_drafter(m, args.out, torch.float16)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    print(f"wrote {args.out}: {sum(p.numel() for p in m.parameters())} parameters, {size} bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixture", help="write the C++ test's reference drafter and outputs")
    f.add_argument("outdir")
    t = sub.add_parser("train", help="train a drafter on `specmesh dflash-data` output")
    t.add_argument("data")
    t.add_argument("out")
    t.add_argument("--layers", type=int, default=1)
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, default=4)
    t.add_argument("--ff", type=int, default=384)
    t.add_argument("--block", type=int, default=8)
    t.add_argument("--anchors", type=int, default=32, help="blocks per sequence and step")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--gamma", type=float, default=4.0, help="loss weight decay over block rows")
    t.add_argument("--seed", type=int, default=15)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--log-every", type=int, default=100)
    t.add_argument("--init", help="start from this drafter directory instead of random weights")
    t.add_argument("--labels", choices=("sampled", "greedy"), default="sampled",
                   help="what row r learns: the sampled token at anchor + r, or the target's greedy choice there")
    args = ap.parse_args()
    torch.set_num_threads(getattr(args, "threads", 1))
    if args.cmd == "fixture":
        fixture(args.outdir)
    elif args.cmd == "train":
        train(args)


if __name__ == "__main__":
    sys.exit(main())
