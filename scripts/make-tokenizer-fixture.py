#!/usr/bin/env python3
"""Writes the token-id fixture that crates/sieve-model/tests/tokenizer.rs checks against.

Command (from the repository root):

    pip install gguf regex            # required
    pip install tokenizers            # optional second reference
    pip install llama-cpp-python      # optional third reference (the llama.cpp tokenizer itself)
    python3 scripts/make-tokenizer-fixture.py \
        ~/.cache/sieve/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        crates/sieve-model/tests/fixtures/smollm2-tokens.json \
        data/wikitext-2/test.txt

The primary reference is a from-scratch Python byte-level BPE written here (nothing shared with
the Rust code under test): the vocabulary and merges come from the GGUF file, the text is split
with the regexes llama.cpp uses for the `smollm` pre-tokenizer (`\\p{N}` first, then the GPT-2
regex, applied one after the other, unmatched spans kept as their own pieces), special tokens
(token_type 3 = control, 4 = user-defined) are cut out of the text first, longest match first.
When the Python `tokenizers` package and/or `llama_cpp` are importable, every string is also
encoded by them and the script refuses to write the fixture on any disagreement; the names of
the references that agreed go into the fixture's `references` field.

With the optional third argument, the first 200,000 bytes of that text (cut back to a character
boundary) are encoded too; their token count and FNV-1a-64 hash of the ids (as little-endian u32)
go into `long_text`, so the fixture checks ~50k ids without storing them.
"""

import json
import sys

import gguf
import regex

# llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: two regexes applied in sequence.
SMOLLM_REGEXES = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
]

TEXTS = [
    "Hello world",
    "The capital of France is",
    "12345 678",
    "café 日本語 🙂",
    "  multiple   spaces\tand\ttabs  ",
    "line one\nline two\n\n\nline five\r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "It's they're we'll I'd don't DON'T",
    'fn main() { println!("{}", x + 1); }',
    "",
    "Ünïcödé ñ ß — “quotes” … ½ ٣ 0.5e-3",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<file_sep>   c",
]


def read_vocab(path):
    reader = gguf.GGUFReader(path)
    fields = reader.fields

    def strings(key):
        field = fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def ints(key):
        field = fields[key]
        return [int(field.parts[i][0]) for i in field.data]

    def string(key):
        field = fields[key]
        return bytes(field.parts[field.data[0]]).decode("utf-8")

    return {
        "model": string("tokenizer.ggml.model"),
        "pre": string("tokenizer.ggml.pre"),
        "tokens": strings("tokenizer.ggml.tokens"),
        "merges": strings("tokenizer.ggml.merges"),
        "token_types": ints("tokenizer.ggml.token_type"),
    }


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


class ReferenceBpe:
    def __init__(self, vocab):
        self.token_to_id = {}
        for index, token in enumerate(vocab["tokens"]):
            self.token_to_id.setdefault(token, index)
        self.ranks = {}
        for rank, merge in enumerate(vocab["merges"]):
            left, right = merge.split(" ", 1)
            self.ranks.setdefault((left, right), rank)
        self.specials = sorted(
            (t for t, kind in zip(vocab["tokens"], vocab["token_types"]) if kind in (3, 4) and t),
            key=len,
            reverse=True,
        )
        self.byte_char = bytes_to_unicode()
        self.regexes = [regex.compile(r) for r in SMOLLM_REGEXES]

    def split_specials(self, text):
        """[(is_special, text)], leftmost match first, the longest special at a position wins."""
        out, start, position = [], 0, 0
        while position < len(text):
            hit = next((s for s in self.specials if text.startswith(s, position)), None)
            if hit is None:
                position += 1
                continue
            if start < position:
                out.append((False, text[start:position]))
            out.append((True, hit))
            position += len(hit)
            start = position
        if start < len(text):
            out.append((False, text[start:]))
        return out

    def pre_split(self, text):
        pieces = [text]
        for pattern in self.regexes:
            next_pieces = []
            for piece in pieces:
                cursor = 0
                for match in pattern.finditer(piece):
                    if match.start() > cursor:
                        next_pieces.append(piece[cursor : match.start()])
                    if match.end() > match.start():
                        next_pieces.append(match.group())
                    cursor = match.end()
                if cursor < len(piece):
                    next_pieces.append(piece[cursor:])
            pieces = next_pieces
        return pieces

    def bpe(self, piece):
        symbols = [self.byte_char[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            best = None
            for i in range(len(symbols) - 1):
                rank = self.ranks.get((symbols[i], symbols[i + 1]))
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return [self.token_to_id[s] for s in symbols]

    def encode(self, text):
        ids = []
        for is_special, part in self.split_specials(text):
            if is_special:
                ids.append(self.token_to_id[part])
                continue
            for piece in self.pre_split(part):
                ids.extend(self.bpe(piece))
        return ids


def hf_tokenizers_reference(vocab):
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return None
    token_to_id = {}
    for index, token in enumerate(vocab["tokens"]):
        token_to_id.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    tok = Tokenizer(models.BPE(token_to_id, merges))
    # The pre-tokenizer SmolLM2's own tokenizer.json declares: isolated digits, then GPT-2 ByteLevel.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(vocab["tokens"], vocab["token_types"])
            if kind == 3
        ]
    )
    _ = Regex  # imported to fail early on very old versions without it
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def llama_cpp_reference(path):
    try:
        import llama_cpp
    except ImportError:
        return None
    model = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    return lambda text: model.tokenize(text.encode("utf-8"), add_bos=False, special=True) if text else []


LONG_TEXT_BYTES = 200_000


def fnv1a64_ids(ids):
    value = 0xCBF29CE484222325
    for token in ids:
        for byte in int(token).to_bytes(4, "little"):
            value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def long_text_prefix(path):
    with open(path, "rb") as f:
        data = f.read()
    cut = min(len(data), LONG_TEXT_BYTES)
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut].decode("utf-8")


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    model_path, out_path = sys.argv[1], sys.argv[2]
    long_path = sys.argv[3] if len(sys.argv) == 4 else None
    vocab = read_vocab(model_path)
    if vocab["model"] != "gpt2" or vocab["pre"] != "smollm":
        sys.exit(f"expected a gpt2/smollm tokenizer, found {vocab['model']}/{vocab['pre']}")
    primary = ReferenceBpe(vocab)
    others = {
        "hf-tokenizers (python, Digits+ByteLevel)": hf_tokenizers_reference(vocab),
        "llama.cpp (llama-cpp-python, vocab_only)": llama_cpp_reference(model_path),
    }
    agreed = ["python-bpe (this script)"]
    cases = []
    for text in TEXTS:
        ids = primary.encode(text)
        for name, encode in others.items():
            if encode is None:
                continue
            theirs = list(encode(text))
            if theirs != ids:
                sys.exit(f"{name} disagrees on {text!r}: {theirs} vs {ids}")
        cases.append({"text": text, "ids": ids})
    long_text = None
    if long_path:
        text = long_text_prefix(long_path)
        ids = primary.encode(text)
        for name, encode in others.items():
            if encode is not None and list(encode(text)) != ids:
                sys.exit(f"{name} disagrees on the long text")
        long_text = {
            "source": long_path.rsplit("/", 2)[-2] + "/" + long_path.rsplit("/", 1)[-1],
            "prefix_bytes": LONG_TEXT_BYTES,
            "token_count": len(ids),
            "ids_fnv1a64": f"{fnv1a64_ids(ids):016x}",
        }
    agreed += [name for name, encode in others.items() if encode is not None]
    fixture = {
        "model_file": model_path.rsplit("/", 1)[-1],
        "tokenizer": f"{vocab['model']}/{vocab['pre']}",
        "vocab_size": len(vocab["tokens"]),
        "references": agreed,
        "made_by": "scripts/make-tokenizer-fixture.py",
        "long_text": long_text,
        "cases": cases,
    }
    # One case per line keeps diffs of the fixture readable.
    head = {k: v for k, v in fixture.items() if k != "cases"}
    lines = [json.dumps(case, ensure_ascii=False) for case in cases]
    body = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
    with open(out_path, "w", encoding="utf-8") as out:
        out.write(body + ',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    print(f"wrote {len(cases)} cases to {out_path}; references that agreed: {agreed}")


if __name__ == "__main__":
    main()
