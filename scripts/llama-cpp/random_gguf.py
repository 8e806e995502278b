#!/usr/bin/env python3
"""Write a random-weight Llama GGUF of a real shape, directly in a quantized type.

For speed benchmarks (llama.cpp vs sieve) where the weights' values do not matter but their
shapes, types and magnitudes do. No f16 stage: each tensor's quantized blocks are made at random
(random quants, with scales picked so that the weights have magnitudes around sqrt(3/K), K the
row length, like a uniform init) and streamed to the file one tensor at a time.

usage: random_gguf.py --shape llama2-7b|tiny --type f16|q8_0|q4_0|q4_k_m|q6_k -o PATH
                     [--tokenizer gpt2|llama] [--seed N]

Types:
  f16     every matrix F16 (uniform in [-sqrt(3/K), sqrt(3/K)], 256 levels)
  q8_0    every matrix Q8_0
  q4_0    every matrix Q4_0
  q4_k_m  llama.cpp's Q4_K_M mix: Q4_K everywhere, Q6_K for output.weight and for attn_v and
          ffn_down in the layers llama.cpp's "use more bits" rule picks (the first and last
          eighth of the layers and every third layer between: 16 of 32 for 7B). This follows
          llama.cpp's rule for a model with no GQA; the finer cases (GQA, MoE, imatrix) don't
          apply here.
  q6_k    every matrix Q6_K
Norms are F32 ones; token_embd.weight has the same type as the other matrices (Q4_K for
q4_k_m, as llama.cpp's Q4_K_M has).

Shapes: llama2-7b (hidden 4096, intermediate 11008, 32 layers, 32 heads, vocab 32000) and tiny
(hidden 256, intermediate 768, 2 layers, 4 heads, vocab 512; intermediate 768 rather than 688
so that every row length is a multiple of 256, which the k-quant blocks need).

Tokenizer (--tokenizer; both are read by llama.cpp):
  gpt2 (default)  byte-level BPE, tokenizer.ggml.pre "gpt-2": <unk>, <s>, </s> (control), the 256
                  byte-level symbols of GPT-2's byte->unicode map, then two-symbol tokens with
                  their merges ("a b" -> "ab"), letters and the space symbol first. sieve reads
                  only byte-level BPE, so this is the one both engines load.
  llama           SentencePiece-style: <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF>
                  (type 6), then unique filler pieces "▁a", "▁b", ... (sieve refuses it:
                  "SentencePiece tokenizers are not supported").
Both: bos 1, eos 2, unk 0.

Uses the gguf-py of the llama.cpp tree that scripts/llama-cpp/fetch.sh puts in
vendor/llama.cpp (or GGUF_PY=/path/to/gguf-py); needs numpy.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, os.environ.get("GGUF_PY", str(REPO / "vendor" / "llama.cpp" / "gguf-py")))
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

SHAPES = {
    "llama2-7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000),
    "tiny": dict(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=4, vocab=512),
}
# llama.cpp's llama_ftype numbers, for general.file_type
FILE_TYPE = {"f16": 1, "q4_0": 2, "q8_0": 7, "q4_k_m": 15, "q6_k": 18}
BASE_TYPE = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k_m": Q.Q4_K, "q6_k": Q.Q6_K}


def f16_bytes(x: np.ndarray) -> np.ndarray:
    """(n,) float -> (n, 2) uint8, little-endian f16."""
    return np.ascontiguousarray(x.astype("<f2")).view(np.uint8).reshape(-1, 2)


class Blocks:
    """Random quantized blocks for one (rows, k) matrix, as a (rows, k // blk * bytes) uint8 array."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def u8(self, *shape: int) -> np.ndarray:
        return self.rng.integers(0, 256, size=shape, dtype=np.uint8)

    def jitter(self, n: int) -> np.ndarray:
        return self.rng.uniform(0.8, 1.2, size=n).astype(np.float32)

    def f16(self, rows: int, k: int) -> np.ndarray:
        a = np.sqrt(3.0 / k)
        table = np.linspace(-a, a, 256, dtype=np.float32).astype("<f2")
        return table[self.u8(rows, k)]

    def q8_0(self, rows: int, k: int) -> np.ndarray:
        # block: f16 d, 32 x int8 q; w = d * q, q uniform in [-128, 127]
        n = rows * k // 32
        b = self.u8(n, 34)
        b[:, 0:2] = f16_bytes(np.sqrt(3.0 / k) / 127.0 * self.jitter(n))
        return b.reshape(rows, -1)

    def q4_0(self, rows: int, k: int) -> np.ndarray:
        # block: f16 d, 16 bytes of nibbles; w = d * (q - 8), q in [0, 15]
        n = rows * k // 32
        b = self.u8(n, 18)
        b[:, 0:2] = f16_bytes(np.sqrt(3.0 / k) / 7.5 * self.jitter(n))
        return b.reshape(rows, -1)

    def q4_k(self, rows: int, k: int) -> np.ndarray:
        # super-block of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8 sub-blocks,
        # 128 bytes of nibbles; w = d * sc * q - dmin * m, q in [0, 15]
        n = rows * k // 256
        a = np.sqrt(3.0 / k)
        b = self.u8(n, 144)
        sc = self.rng.integers(32, 64, size=(n, 8), dtype=np.uint8)
        mn = self.rng.integers(32, 64, size=(n, 8), dtype=np.uint8)
        # pick d so d*sc*15 spans ~2a, and dmin so dmin*m ~ a (centres the range)
        b[:, 0:2] = f16_bytes(2.0 * a / (15.0 * 48.0) * self.jitter(n))
        b[:, 2:4] = f16_bytes(a / 48.0 * self.jitter(n))
        s = b[:, 4:16]
        # packing that llama.cpp's get_scale_min_k4 reads back:
        #   j < 4: sc = s[j] & 63, m = s[j+4] & 63
        #   j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4, m = (s[j+4] >> 4) | (s[j] >> 6) << 4
        s[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
        s[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
        s[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
        return b.reshape(rows, -1)

    def q6_k(self, rows: int, k: int) -> np.ndarray:
        # super-block of 256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 x int8 scales,
        # f16 d; w = d * scale * (q - 32), q in [0, 63]
        n = rows * k // 256
        b = self.u8(n, 210)
        sc = self.rng.integers(16, 128, size=(n, 16), dtype=np.int16)
        sign = self.rng.integers(0, 2, size=(n, 16), dtype=np.int16) * 2 - 1
        b[:, 192:208] = (sc * sign).astype(np.int8).view(np.uint8)
        b[:, 208:210] = f16_bytes(np.sqrt(3.0 / k) / (32.0 * 72.0) * self.jitter(n))
        return b.reshape(rows, -1)

    def make(self, qtype: Q, rows: int, k: int) -> np.ndarray:
        return {Q.F16: self.f16, Q.Q8_0: self.q8_0, Q.Q4_0: self.q4_0,
                Q.Q4_K: self.q4_k, Q.Q6_K: self.q6_k}[qtype](rows, k)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers get Q6_K attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(s: dict, ftype: str) -> list[tuple[str, Q, tuple[int, ...]]]:
    """(name, type, numpy shape (rows, k)) in file order."""
    h, f, v, L = s["hidden"], s["intermediate"], s["vocab"], s["layers"]
    hd = h // s["heads"]
    kv = hd * s["kv_heads"]
    base = BASE_TYPE[ftype]
    km = ftype == "q4_k_m"
    plan = [("token_embd.weight", base, (v, h))]
    for i in range(L):
        more = km and use_more_bits(i, L)
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", Q.F32, (h,)),
            (p + "attn_q.weight", base, (h, h)),
            (p + "attn_k.weight", base, (kv, h)),
            (p + "attn_v.weight", Q.Q6_K if more else base, (kv, h)),
            (p + "attn_output.weight", base, (h, h)),
            (p + "ffn_norm.weight", Q.F32, (h,)),
            (p + "ffn_gate.weight", base, (f, h)),
            (p + "ffn_up.weight", base, (f, h)),
            (p + "ffn_down.weight", Q.Q6_K if more else base, (h, f)),
        ]
    plan += [("output_norm.weight", Q.F32, (h,)),
             ("output.weight", Q.Q6_K if km else base, (v, h))]
    return plan


def nbytes(qtype: Q, shape: tuple[int, ...]) -> int:
    blk, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    assert shape[-1] % blk == 0, f"row length {shape[-1]} is not a multiple of {qtype.name}'s block {blk}"
    return n // blk * size


def vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n:
        # bijective base-26: a..z, aa..zz, aaa..
        word, j = "", i
        while True:
            word = letters[j % 26] + word
            j = j // 26 - 1
            if j < 0:
                break
        tokens.append("\u2581" + word)
        types.append(1)
        i += 1
    tokens, types = tokens[:n], types[:n]
    scores = [0.0] * 259 + [-float(k) for k in range(1, n - 258)]
    return tokens, scores[:n], types


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable unicode symbol map, as a list indexed by byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def vocab_bpe(n: int) -> tuple[list[str], list[float], list[int], list[str]]:
    sym = byte_symbols()
    tokens = ["<unk>", "<s>", "</s>"] + sym
    types = [3, 3, 3] + [1] * 256
    # two-symbol tokens: the space symbol and letters first, then the rest of the byte symbols
    first = [sym[ord(" ")]] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    order = first + [x for x in sym if x not in first]
    merges: list[str] = []
    need = n - len(tokens)
    assert need <= len(order) ** 2, "vocab too large for two-symbol tokens"
    for a in order:
        for b in order:
            if len(merges) == need:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            types.append(1)
    scores = [0.0] * len(tokens)
    return tokens[:n], scores[:n], types[:n], merges


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, required=True)
    ap.add_argument("--type", choices=FILE_TYPE, required=True)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--tokenizer", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    s = SHAPES[args.shape]
    h, heads = s["hidden"], s["heads"]
    plan = tensor_plan(s, args.type)
    t0 = time.time()

    w = gguf.GGUFWriter(args.output, "llama")
    w.add_name(f"random {args.shape} {args.type}")
    w.add_file_type(FILE_TYPE[args.type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["intermediate"])
    w.add_head_count(heads)
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(h // heads)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(s["vocab"])
    if args.tokenizer == "llama":
        tokens, scores, types = vocab(s["vocab"])
        w.add_tokenizer_model("llama")
    else:
        tokens, scores, types, merges = vocab_bpe(s["vocab"])
        w.add_tokenizer_model("gpt2")
        # "gpt-2" with a hyphen: llama.cpp's llama_vocab::impl::load knows "gpt-2" but not "gpt2"
        # and throws "unknown pre-tokenizer type: 'gpt2'" (llama-bench then only says "failed to
        # load model"); sieve accepts both spellings for the GPT-2 regex.
        w.add_tokenizer_pre("gpt-2")
        w.add_token_merges(merges)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(args.tokenizer == "llama")
    w.add_add_eos_token(False)

    # Declare every tensor (shape and size only), write the header, then stream the data.
    for name, qt, shape in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(qt, shape), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    gen = Blocks(np.random.default_rng(args.seed))
    total = 0
    for name, qt, shape in plan:
        if qt == Q.F32:
            data = np.ones(shape, dtype=np.float32)
        else:
            data = gen.make(qt, shape[0], shape[1])
        assert data.nbytes == nbytes(qt, shape), name
        w.write_tensor_data(data)
        total += data.nbytes
        del data
    w.close()
    print(f"{args.output}: {args.shape} {args.type}, {len(plan)} tensors, "
          f"{total / 2**30:.2f} GiB of weights, {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
