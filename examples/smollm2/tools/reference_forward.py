#!/usr/bin/env python3
"""Independent fp64 numpy forward of SmolLM2 (Llama) from GGUF, for checking smollm2_eval.

Tensors are read and dequantized with the PyPI `gguf` package (not kvq's reader). Q/K
rows are un-permuted back to the Hugging Face layout and RoPE is applied HF-style
(rotate_half), so this also checks that adjacent-pair RoPE on GGUF weights is right.

  python3 reference_forward.py MODEL.gguf --ids 504,3575,282,4649,314 [--compare logits.f32]

--compare reads smollm2_eval's raw float32 [n, vocab] logits and prints the max relative
difference max|a-b| / max|b| over all positions.
"""
import argparse
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--save")
    a = ap.parse_args()
    r = GGUFReader(a.model)
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.")}
    T = {t.name: t for t in r.tensors}

    def W(name):
        t = T[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(x) for x in reversed(t.shape)])

    L, D = f["llama.block_count"], f["llama.embedding_length"]
    Hq, Hkv = f["llama.attention.head_count"], f["llama.attention.head_count_kv"]
    d = D // Hq
    theta, eps = f["llama.rope.freq_base"], f["llama.attention.layer_norm_rms_epsilon"]

    def unpermute(w, n_head):  # inverse of llama.cpp's convert permute
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    ids = [int(s) for s in a.ids.split(",")]
    n = len(ids)
    E = W("token_embd.weight")
    x = E[ids]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(n)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]

    def rope(t):
        rot = np.concatenate([-t[..., d // 2:], t[..., : d // 2]], -1)
        return t * cos + rot * sin

    mask = np.triu(np.full((n, n), -np.inf), 1)
    for l in range(L):
        p = f"blk.{l}."
        h = rms(x, W(p + "attn_norm.weight"))
        q = (h @ unpermute(W(p + "attn_q.weight"), Hq).T).reshape(n, Hq, d)
        k = (h @ unpermute(W(p + "attn_k.weight"), Hkv).T).reshape(n, Hkv, d)
        v = (h @ W(p + "attn_v.weight").T).reshape(n, Hkv, d)
        q, k = rope(q), rope(k)
        g = Hq // Hkv
        k = np.repeat(k, g, axis=1)
        v = np.repeat(v, g, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(n, Hq * d)
        x = x + o @ W(p + "attn_output.weight").T
        h = rms(x, W(p + "ffn_norm.weight"))
        gt = h @ W(p + "ffn_gate.weight").T
        up = h @ W(p + "ffn_up.weight").T
        x = x + (gt / (1 + np.exp(-gt)) * up) @ W(p + "ffn_down.weight").T
    logits = rms(x, W("output_norm.weight")) @ E.T
    print("next token:", int(logits[-1].argmax()))
    if a.save:
        logits.astype(np.float32).tofile(a.save)
    if a.compare:
        c = np.fromfile(a.compare, dtype=np.float32).reshape(logits.shape).astype(np.float64)
        rel = np.abs(c - logits).max() / np.abs(logits).max()
        print(f"max |cpp - ref| = {np.abs(c - logits).max():.3e}, max |ref| = {np.abs(logits).max():.3f}, "
              f"max relative logit difference = {rel:.3e}, top-1 agree = {(c.argmax(-1) == logits.argmax(-1)).mean():.3f}")


if __name__ == "__main__":
    main()
