#!/usr/bin/env python3
"""Reference logits for the golden test of sieve's forward pass, from an independent NumPy Llama.

Exact command (from the repository root; needs `pip install numpy gguf`):

    python3 scripts/make-golden-logits.py ~/.cache/sieve/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        crates/sieve-model/tests/fixtures/smollm2-135m-golden.json

What is independent of sieve's Rust code:
- weights are dequantized by the `gguf` package (llama.cpp's own reference NumPy dequantizers);
- Q and K are used in GGUF's stored row order with llama.cpp's "normal" RoPE (adjacent pairs
  (2i, 2i+1) rotated), while sieve un-permutes the rows and applies Hugging Face rotate-half RoPE;
  the two agree only if the un-permutation is right;
- everything is computed in float64 with full-precision weights (sieve stores weights as f16).

The prompt is fixed as token ids (the tokenizer is not under test here); the pieces are looked up
in the GGUF vocabulary. The fixture records, for every position, the argmax and the gap between
the best and second-best logit, and for the last position the top-10 ids and values.
"""

import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# "The capital of France is Paris. The river that runs through the city is called the"
PIECES = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis", "ĠParis", ".", "ĠThe", "Ġriver", "Ġthat",
          "Ġruns", "Ġthrough", "Ġthe", "Ġcity", "Ġis", "Ġcalled", "Ġthe"]


def field(reader, key):
    f = reader.fields[key]
    return f.contents()


def main(model_path, out_path):
    r = GGUFReader(model_path)
    arch = field(r, "general.architecture")
    if arch != "llama":
        sys.exit(f"this reference implements the llama architecture, the file is {arch}")
    n_layer = int(field(r, "llama.block_count"))
    d = int(field(r, "llama.embedding_length"))
    n_head = int(field(r, "llama.attention.head_count"))
    n_kv = int(field(r, "llama.attention.head_count_kv"))
    eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
    theta = float(field(r, "llama.rope.freq_base"))
    hd = d // n_head
    vocab = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
             for i in r.fields["tokenizer.ggml.tokens"].data]
    index = {t: i for i, t in enumerate(vocab)}
    ids = [index[p] for p in PIECES]

    tensors = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float64)
        # GGUF lists dimensions innermost first; NumPy wants them outermost first.
        tensors[t.name] = w.reshape([int(x) for x in reversed(t.shape)])

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, None] * inv[None, :]  # [n][hd/2]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope_adjacent_pairs(x):  # x: [n][heads][hd], GGUF row order
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    x = tensors["token_embd.weight"][ids]  # [n][d]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rms(x, tensors[p + "attn_norm.weight"])
        q = (h @ tensors[p + "attn_q.weight"].T).reshape(n, n_head, hd)
        k = (h @ tensors[p + "attn_k.weight"].T).reshape(n, n_kv, hd)
        v = (h @ tensors[p + "attn_v.weight"].T).reshape(n, n_kv, hd)
        q, k = rope_adjacent_pairs(q), rope_adjacent_pairs(k)
        group = n_head // n_kv
        att = np.empty((n, n_head, hd))
        for hh in range(n_head):
            g = hh // group
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            att[:, hh, :] = s @ v[:, g, :]
        x = x + att.reshape(n, d) @ tensors[p + "attn_output.weight"].T
        h = rms(x, tensors[p + "ffn_norm.weight"])
        gate = h @ tensors[p + "ffn_gate.weight"].T
        up = h @ tensors[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ tensors[p + "ffn_down.weight"].T
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    logits = rms(x, tensors["output_norm.weight"]) @ head.T  # [n][V]

    order = np.argsort(-logits, axis=-1)
    last = logits[-1]
    top = order[-1, :10]
    fixture = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "generator": "scripts/make-golden-logits.py (NumPy float64, gguf dequantization)",
        "text": "".join(PIECES).replace("Ġ", " "),
        "token_ids": ids,
        "argmax": [int(i) for i in order[:, 0]],
        "top2_gap": [float(logits[t, order[t, 0]] - logits[t, order[t, 1]]) for t in range(n)],
        "last_top10_ids": [int(i) for i in top],
        "last_top10_logits": [float(last[i]) for i in top],
    }
    with open(out_path, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(json.dumps({k: fixture[k] for k in ("argmax", "last_top10_ids")}))
    print("predicted:", " | ".join(vocab[i] for i in fixture["argmax"]))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make-golden-logits.py MODEL.gguf OUT.json")
    main(sys.argv[1], sys.argv[2])
