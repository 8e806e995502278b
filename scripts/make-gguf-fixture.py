#!/usr/bin/env python3
"""Writes crates/sieve-model/tests/fixtures/gguf_golden.json: dequantized values computed by
llama.cpp's own Python reader (the `gguf` package), for sieve-model's golden tests.

Command (from the repository root; needs `pip install gguf numpy` and the default model fetched by
scripts/fetch-model.sh):

    python3 scripts/make-gguf-fixture.py \
        ~/.cache/sieve/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        crates/sieve-model/tests/fixtures/gguf_golden.json

Contents:
- "model": for a few tensors of the default model (Q8_0, Q4_1, F32), 8 values at a few
  (row, column) spots of the dequantized matrix in Hugging Face [rows, cols] order. For the llama
  q_proj / k_proj tensors the rows are put back into Hugging Face order with the inverse of
  convert_hf_to_gguf.py's permutation, written here with numpy reshape/swapaxes the way
  transformers' GGUF loader does it (reshape to [n_head, head_dim/2, 2, cols], swap axes 1 and 2).
- "blocks": for every block format sieve dequantizes, random bytes (seeded; f16 scale fields set
  to finite values) and gguf's dequantization of them.
"""
import json
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType as Q
from gguf.quants import dequantize


def reverse_permute(w, n_head):
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_section(path):
    reader = GGUFReader(path)
    fields = {name: f for name, f in reader.fields.items()}

    def scalar(key):
        return int(fields[key].contents())

    n_head = scalar("llama.attention.head_count")
    n_head_kv = scalar("llama.attention.head_count_kv")
    wanted = {
        "token_embd.weight": ("model.embed_tokens.weight", None),
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", n_head),
        "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", n_head_kv),
        "blk.3.attn_v.weight": ("model.layers.3.self_attn.v_proj.weight", None),
        "blk.29.ffn_down.weight": ("model.layers.29.mlp.down_proj.weight", None),
        "output_norm.weight": ("model.norm.weight", None),
    }
    out = []
    for t in reader.tensors:
        if t.name not in wanted:
            continue
        hf_name, permuted_heads = wanted[t.name]
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(d) for d in reversed(t.shape)]  # gguf lists ne innermost-first
        values = values.reshape(shape)
        if permuted_heads is not None:
            values = reverse_permute(values, permuted_heads)
        spots = []
        if values.ndim == 1:
            for col in (0, 100, shape[0] - 8):
                spots.append({"row": 0, "col": col, "values": values[col:col + 8].tolist()})
        else:
            rows, cols = shape
            for row in (0, 1, 2, 37, rows // 2 + 1, rows - 1):
                for col in (0, cols // 2 + 8, cols - 8):
                    spots.append({"row": row, "col": col, "values": values[row, col:col + 8].tolist()})
        out.append({
            "gguf_name": t.name,
            "hf_name": hf_name,
            "ggml_type": t.tensor_type.name,
            "shape": shape,
            "spots": spots,
        })
    return out


def blocks_section():
    rng = np.random.default_rng(20241130)
    # (type, blocks, byte offsets of f16 scale fields)
    formats = [
        (Q.Q4_0, 2, [0]),
        (Q.Q4_1, 2, [0, 2]),
        (Q.Q5_0, 2, [0]),
        (Q.Q5_1, 2, [0, 2]),
        (Q.Q8_0, 2, [0]),
        (Q.Q4_K, 1, [0, 2]),
        (Q.Q5_K, 1, [0, 2]),
        (Q.Q6_K, 1, [208]),
    ]
    from gguf.constants import GGML_QUANT_SIZES
    out = []
    for qtype, n_blocks, scale_offsets in formats:
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
        for b in range(n_blocks):
            for off in scale_offsets:
                scale = np.float16(rng.uniform(-0.05, 0.05))
                raw[b, off:off + 2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
        values = dequantize(raw.reshape(-1), qtype).astype(np.float32).reshape(-1)
        assert values.size == n_blocks * block_elems
        out.append({"ggml_type": qtype.name, "bytes_hex": raw.tobytes().hex(), "values": values.tolist()})
    floats = rng.normal(0, 2, size=64).astype(np.float32)
    f16 = floats.astype(np.float16)
    out.append({"ggml_type": "F16", "bytes_hex": f16.tobytes().hex(),
                "values": dequantize(f16.view(np.uint8), Q.F16).astype(np.float32).reshape(-1).tolist()})
    bf16_bits = (floats.view(np.uint32) >> 16).astype(np.uint16)
    out.append({"ggml_type": "BF16", "bytes_hex": bf16_bits.tobytes().hex(),
                "values": dequantize(bf16_bits.view(np.uint8), Q.BF16).astype(np.float32).reshape(-1).tolist()})
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    model_path, out_path = sys.argv[1:3]
    fixture = {
        "generator": "scripts/make-gguf-fixture.py (gguf package, llama.cpp's Python reader)",
        "model_file": model_path.rsplit("/", 1)[-1],
        "model": model_section(model_path),
        "blocks": blocks_section(),
    }
    with open(out_path, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
