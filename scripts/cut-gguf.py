#!/usr/bin/env python3
"""Writes a copy of a Llama-family GGUF cut to its first N decoder layers.

    python3 scripts/cut-gguf.py IN.gguf OUT.gguf --layers 4

The metadata is copied with `<arch>.block_count` set to N, the tensors of layers >= N are
dropped, and the remaining tensor data is copied byte for byte (realigned to the file's
alignment). Used to carry SmolLM2 to the GPU machine in one transfer: a cut model runs the same
code path as the whole one, and GPU and CPU must agree on it (crates/sieve-gpu tests).
No dependencies beyond the standard library.
"""
import argparse
import struct
import sys

# GGUF metadata value types -> struct format (scalars), 8 = string, 9 = array.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Bytes per block and elements per block of the GGML types the loader knows.
BLOCKS = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
          12: (144, 256), 13: (176, 256), 14: (210, 256), 30: (2, 1)}


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0]

    def string(self):
        n = self.take("Q")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, ty):
        """Skips a value, returning its raw bytes."""
        start = self.pos
        if ty in SCALARS:
            self.take(SCALARS[ty])
        elif ty == 8:
            self.string()
        elif ty == 9:
            inner = self.take("I")
            n = self.take("Q")
            for _ in range(n):
                self.value(inner)
        else:
            sys.exit(f"unknown GGUF value type {ty}")
        return self.data[start:self.pos]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, required=True)
    a = ap.parse_args()
    if a.layers < 1:
        sys.exit("--layers must be at least 1")
    data = open(a.src, "rb").read()
    r = Reader(data)
    if r.take("I") != 0x46554747:
        sys.exit(f"{a.src} is not a GGUF file")
    version = r.take("I")
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    kvs, arch, alignment = [], None, 32
    for _ in range(n_kv):
        key = r.string()
        ty = r.take("I")
        raw = r.value(ty)
        if key == b"general.architecture":
            arch = raw[8:]
        if key == b"general.alignment":
            alignment = struct.unpack("<I", raw)[0]
        kvs.append((key, ty, raw))
    if arch is None:
        sys.exit("no general.architecture")
    block_key = arch + b".block_count"
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take("I")
        dims = [r.take("Q") for _ in range(nd)]
        ty = r.take("I")
        off = r.take("Q")
        tensors.append((name, dims, ty, off))
    data_start = (r.pos + alignment - 1) // alignment * alignment

    def nbytes(dims, ty):
        if ty not in BLOCKS:
            sys.exit(f"unknown tensor type {ty}")
        b, e = BLOCKS[ty]
        n = 1
        for d in dims:
            n *= d
        return n // e * b

    def layer_of(name):
        if name.startswith(b"blk."):
            return int(name.split(b".")[1])
        return -1

    kept = [t for t in tensors if layer_of(t[0]) < a.layers]
    out = bytearray(struct.pack("<IIQQ", 0x46554747, version, len(kept), len(kvs)))
    for key, ty, raw in kvs:
        if key == block_key:
            raw = struct.pack("<I", a.layers)
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", ty) + raw
    offset, blobs = 0, []
    for name, dims, ty, off in kept:
        size = nbytes(dims, ty)
        blob = data[data_start + off:data_start + off + size]
        if len(blob) != size:
            sys.exit(f"tensor {name!r} runs past the end of the file")
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ty, offset)
        blobs.append((offset, blob))
        offset = (offset + size + alignment - 1) // alignment * alignment
    out += b"\0" * ((-len(out)) % alignment)
    base = len(out)
    for off, blob in blobs:
        out += b"\0" * (base + off - len(out))
        out += blob
    open(a.dst, "wb").write(out)
    print(f"{a.dst}: {a.layers} of {max(layer_of(t[0]) for t in tensors) + 1} layers, {len(kept)} tensors, {len(out)} bytes")


if __name__ == "__main__":
    main()
