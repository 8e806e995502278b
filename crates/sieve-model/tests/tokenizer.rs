//! Tokenizer tests. The first group builds small byte-level vocabularies by hand and runs
//! everywhere; the second needs the default model (SmolLM2-135M-Instruct GGUF) and checks ids
//! against `tests/fixtures/smollm2-tokens.json`, made by `scripts/make-tokenizer-fixture.py`
//! with independent implementations. Those skip, saying so, when the model file is absent.

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;
use sieve_model::gguf::GgufFile;
use sieve_model::tokenizer::{GgufTokenizerSpec, Tokenizer};
use sieve_model::ModelError;

/// GPT-2's byte -> character table (printable Latin-1 stays, the rest moves to U+0100...).
fn gpt2_byte_chars() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut extra = 0x100;
    (0..256u32)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                extra += 1;
                extra - 1
            };
            char::from_u32(code).unwrap_or('?')
        })
        .collect()
}

/// 256 byte tokens, a few merges, two control tokens and one user-defined token.
fn tiny_spec(pre: &str) -> GgufTokenizerSpec {
    let mut tokens: Vec<String> = gpt2_byte_chars().iter().map(|c| c.to_string()).collect();
    let mut merges = Vec::new();
    for (left, right) in [
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("Ġ", "w"),
        ("1", "2"),
        ("12", "3"),
    ] {
        merges.push(format!("{left} {right}"));
        tokens.push(format!("{left}{right}"));
    }
    let mut token_types = vec![1; tokens.len()];
    for (name, kind) in [("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4)] {
        tokens.push(name.to_owned());
        token_types.push(kind);
    }
    let im_end = (tokens.len() - 2) as u32;
    GgufTokenizerSpec {
        model: "gpt2".into(),
        pre: pre.into(),
        tokens,
        merges,
        token_types,
        bos_token_id: Some(im_end - 1),
        eos_token_id: Some(im_end),
        ..GgufTokenizerSpec::default()
    }
}

fn build(spec: &GgufTokenizerSpec) -> Tokenizer {
    match Tokenizer::from_gguf_spec(spec) {
        Ok(t) => t,
        Err(e) => panic!("building the tokenizer failed: {e}"),
    }
}

fn ok<T>(r: sieve_model::Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn tiny_vocabulary_applies_merges_and_pre_tokenizer_digit_rules() {
    let tiny = build(&tiny_spec("smollm"));
    let id = |t: &str| {
        tiny.token_to_id(t)
            .unwrap_or_else(|| panic!("no token {t}"))
    };
    assert_eq!(ok(tiny.encode("hello", false)), vec![id("hello")]);
    // smollm isolates every digit, so the "123" merge can never apply.
    assert_eq!(
        ok(tiny.encode("123", false)),
        vec![id("1"), id("2"), id("3")]
    );
    // gpt2 keeps digit runs together and merges them.
    let gpt2 = build(&tiny_spec("gpt2"));
    assert_eq!(ok(gpt2.encode("123", false)), vec![id("123")]);
    // llama3 groups up to three digits: "1234" -> "123", "4".
    let llama3 = build(&tiny_spec("llama-bpe"));
    assert_eq!(ok(llama3.encode("1234", false)), vec![id("123"), id("4")]);
    // qwen2 isolates digits like smollm, but through its own regex.
    let qwen2 = build(&tiny_spec("qwen2"));
    assert_eq!(
        ok(qwen2.encode("123", false)),
        vec![id("1"), id("2"), id("3")]
    );
    assert!(!qwen2.add_bos_by_default() && llama3.add_bos_by_default());
    // " world" starts with the space-w merge; the rest are bytes.
    let ids = ok(tiny.encode(" world", false));
    assert_eq!(ids[0], id("Ġw"));
    assert_eq!(ids.len(), 5);
}

#[test]
fn special_tokens_match_whole_and_decode_by_flag() {
    let tiny = build(&tiny_spec("smollm"));
    let start = tiny.token_to_id("<|im_start|>").unwrap_or(u32::MAX);
    let end = tiny.token_to_id("<|im_end|>").unwrap_or(u32::MAX);
    let tool = tiny.token_to_id("<tool>").unwrap_or(u32::MAX);
    let ids = ok(tiny.encode("<|im_start|>hello<tool><|im_end|>", false));
    assert_eq!(ids.first(), Some(&start));
    assert_eq!(ids.last(), Some(&end));
    assert!(ids.contains(&tool));
    assert_eq!(
        ok(tiny.decode(&ids, false)),
        "<|im_start|>hello<tool><|im_end|>"
    );
    // Control tokens go, user-defined ones are ordinary text.
    assert_eq!(ok(tiny.decode(&ids, true)), "hello<tool>");
    assert!(tiny.is_special(start) && !tiny.is_special(tool));
    assert_eq!(tiny.eos_ids(), &[end]);
    assert_eq!(tiny.bos_id(), Some(start));
    assert_eq!(ok(tiny.encode("hello", true)).first(), Some(&start));
}

#[test]
fn decode_rejects_ids_outside_the_vocabulary() {
    let tiny = build(&tiny_spec("smollm"));
    let outside = tiny.vocab_size() as u32;
    assert!(matches!(
        tiny.decode(&[outside], false),
        Err(ModelError::Tokenizer(_))
    ));
    let mut stream = tiny.stream(false);
    assert!(stream.push(outside).is_err());
}

#[test]
fn stream_holds_back_a_character_split_over_byte_tokens() {
    let tiny = build(&tiny_spec("smollm"));
    // No merges cover these, so every UTF-8 byte is its own token.
    let text = "é日🙂!";
    let ids = ok(tiny.encode(text, false));
    assert_eq!(ids.len(), text.len());
    let mut stream = tiny.stream(true);
    let pieces: Vec<Option<String>> = ids.iter().map(|&id| ok(stream.push(id))).collect();
    let expected: Vec<Option<&str>> = vec![
        None,
        Some("é"),
        None,
        None,
        Some("日"),
        None,
        None,
        None,
        Some("🙂"),
        Some("!"),
    ];
    assert_eq!(
        pieces.iter().map(|p| p.as_deref()).collect::<Vec<_>>(),
        expected
    );
    assert_eq!(stream.finish(), None);
}

#[test]
fn stream_flushes_an_unfinished_character_as_replacement_at_the_end() {
    let tiny = build(&tiny_spec("smollm"));
    let ids = ok(tiny.encode("日", false));
    let mut stream = tiny.stream(false);
    assert_eq!(ok(stream.push(ids[0])), None);
    assert_eq!(stream.finish().as_deref(), Some("\u{FFFD}"));
}

#[test]
fn bad_specs_are_refused_with_reasons() {
    let mut spec = tiny_spec("mystery-pre");
    let err = Tokenizer::from_gguf_spec(&spec)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("mystery-pre") && err.contains("smollm") && err.contains("qwen2"),
        "{err}"
    );

    spec = tiny_spec("smollm");
    spec.model = "llama".into();
    assert!(matches!(
        Tokenizer::from_gguf_spec(&spec),
        Err(ModelError::Unsupported(_))
    ));

    spec = tiny_spec("smollm");
    spec.merges.push("nospace".into());
    assert!(Tokenizer::from_gguf_spec(&spec).is_err());

    spec = tiny_spec("smollm");
    spec.merges.push("absent token".into());
    assert!(matches!(
        Tokenizer::from_gguf_spec(&spec),
        Err(ModelError::Tokenizer(_))
    ));

    spec = tiny_spec("smollm");
    spec.token_types.pop();
    assert!(Tokenizer::from_gguf_spec(&spec).is_err());

    spec = tiny_spec("smollm");
    spec.eos_token_id = Some(1_000_000);
    assert!(Tokenizer::from_gguf_spec(&spec).is_err());

    assert!(Tokenizer::from_gguf_spec(&GgufTokenizerSpec {
        model: "gpt2".into(),
        pre: "smollm".into(),
        ..Default::default()
    })
    .is_err());
}

#[test]
fn tokenizer_json_loads_with_its_config() {
    let dir = std::env::temp_dir().join(format!("sieve-tok-test-{}", std::process::id()));
    ok(std::fs::create_dir_all(&dir).map_err(|e| ModelError::Tokenizer(e.to_string())));
    let chars = gpt2_byte_chars();
    let mut vocab = serde_json::Map::new();
    for (id, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), id.into());
    }
    vocab.insert("he".into(), 256.into());
    vocab.insert("<s>".into(), 257.into());
    vocab.insert("</s>".into(), 258.into());
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 257, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 258, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab, "merges": ["h e"]}
    });
    let config = serde_json::json!({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": true,
        "chat_template": "{{ '<|im_start|>' }}"
    });
    let write = |name: &str, value: &serde_json::Value| {
        ok(std::fs::write(dir.join(name), value.to_string())
            .map_err(|e| ModelError::Tokenizer(e.to_string())));
    };
    write("tokenizer.json", &json);
    write("tokenizer_config.json", &config);
    let tok = ok(Tokenizer::from_file(dir.join("tokenizer.json")));
    assert_eq!(tok.bos_id(), Some(257));
    assert!(tok.eos_ids().contains(&258));
    assert!(tok.add_bos_by_default());
    assert_eq!(tok.chat_template(), Some("{{ '<|im_start|>' }}"));
    let ids = ok(tok.encode("hello 日", true));
    assert_eq!(&ids[..2], &[257, 256]);
    assert_eq!(ok(tok.decode(&ids, true)), "hello 日");
    let mut stream = tok.stream(true);
    let mut streamed = String::new();
    for id in ids {
        if let Some(piece) = ok(stream.push(id)) {
            streamed.push_str(&piece);
        }
    }
    assert_eq!(streamed, "hello 日");
    let missing = Tokenizer::from_file(dir.join("absent.json"));
    assert!(matches!(missing, Err(ModelError::Io { .. })));
    std::fs::remove_dir_all(&dir).ok();
}

proptest! {
    #[test]
    fn tiny_vocabulary_round_trips_any_text(text in "\\PC{0,60}") {
        let tiny = tiny_tokenizer();
        let ids = tiny.encode(&text, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(tiny.decode(&ids, false).map_err(|e| TestCaseError::fail(e.to_string()))?, text.clone());
        let mut stream = tiny.stream(false);
        let mut streamed = String::new();
        for id in ids {
            if let Some(piece) = stream.push(id).map_err(|e| TestCaseError::fail(e.to_string()))? {
                streamed.push_str(&piece);
            }
        }
        streamed.extend(stream.finish());
        prop_assert_eq!(streamed, text);
    }
}

fn tiny_tokenizer() -> &'static Tokenizer {
    static TINY: OnceLock<Tokenizer> = OnceLock::new();
    TINY.get_or_init(|| build(&tiny_spec("smollm")))
}

// ---- tests on the default model ------------------------------------------------------------

fn model_path() -> PathBuf {
    let home = std::env::var_os("SIEVE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sieve")))
        .unwrap_or_default();
    home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The SmolLM2 tokenizer, or None (with the reason printed) when the model file is absent.
fn smollm2() -> Option<&'static Tokenizer> {
    static TOKENIZER: OnceLock<Option<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            let path = model_path();
            if !path.exists() {
                eprintln!(
                    "skipped: {} is absent (scripts/fetch-model.sh fetches it)",
                    path.display()
                );
                return None;
            }
            let spec = ok(GgufFile::open(&path).and_then(|f| f.tokenizer_spec()));
            Some(build(&spec))
        })
        .as_ref()
}

#[derive(serde::Deserialize)]
struct Fixture {
    vocab_size: usize,
    references: Vec<String>,
    long_text: Option<LongText>,
    cases: Vec<FixtureCase>,
}

/// Ids of a long text, kept as a count and a hash.
#[derive(serde::Deserialize)]
struct LongText {
    prefix_bytes: usize,
    token_count: usize,
    ids_fnv1a64: String,
}

fn fixture() -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2-tokens.json");
    let raw = ok(std::fs::read_to_string(&path).map_err(|e| ModelError::Tokenizer(e.to_string())));
    ok(serde_json::from_str(&raw).map_err(|e| ModelError::Tokenizer(e.to_string())))
}

/// FNV-1a 64 over the ids as little-endian u32, as the fixture script computes it.
fn fnv1a64_ids(ids: &[u32]) -> u64 {
    ids.iter()
        .flat_map(|id| id.to_le_bytes())
        .fold(0xCBF2_9CE4_8422_2325, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01B3)
        })
}

#[derive(serde::Deserialize)]
struct FixtureCase {
    text: String,
    ids: Vec<u32>,
}

#[test]
fn smollm2_ids_match_the_independent_reference() {
    let Some(tok) = smollm2() else { return };
    let fixture = fixture();
    assert!(!fixture.references.is_empty());
    assert_eq!(tok.vocab_size(), fixture.vocab_size);
    assert!(fixture.cases.len() >= 10);
    for case in &fixture.cases {
        assert_eq!(
            ok(tok.encode(&case.text, false)),
            case.ids,
            "ids for {:?}",
            case.text
        );
        assert_eq!(
            ok(tok.decode(&case.ids, false)),
            case.text,
            "text for {:?}",
            case.ids
        );
    }
}

#[test]
fn smollm2_special_tokens_and_metadata() {
    let Some(tok) = smollm2() else { return };
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    // EOS (id 2, <|im_end|>) and <|endoftext|> (id 0) both end generation.
    assert!(
        tok.eos_ids().contains(&2) && tok.eos_ids().contains(&0),
        "{:?}",
        tok.eos_ids()
    );
    assert!(!tok.add_bos_by_default());
    assert!(tok
        .chat_template()
        .is_some_and(|t| t.contains("<|im_start|>")));
    let ids = ok(tok.encode("<|im_start|>user\nhi<|im_end|>", false));
    assert_eq!(ok(tok.decode(&ids, true)), "user\nhi");
}

#[test]
fn smollm2_stream_reassembles_multibyte_text() {
    let Some(tok) = smollm2() else { return };
    let text = "café 日本語 🙂 — done";
    let ids = ok(tok.encode(text, false));
    let mut stream = tok.stream(true);
    let mut pieces = Vec::new();
    let mut held = 0;
    for &id in &ids {
        match ok(stream.push(id)) {
            Some(piece) => pieces.push(piece),
            None => held += 1,
        }
    }
    pieces.extend(stream.finish());
    assert_eq!(pieces.concat(), text);
    // Some of these characters are split over byte tokens in this vocabulary.
    assert!(held > 0, "no token was held back: {ids:?}");
}

#[test]
fn smollm2_round_trips_wikitext() {
    let Some(tok) = smollm2() else { return };
    // The repository carries WikiText-2 (data/wikitext-2/), so this test always runs.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/wikitext-2/test.txt");
    let raw = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{} is part of the repository: {e}", path.display()));
    let long = fixture().long_text;
    let mut end = raw
        .len()
        .min(long.as_ref().map_or(200_000, |l| l.prefix_bytes));
    while !raw.is_char_boundary(end) {
        end -= 1;
    }
    let text = &raw[..end];
    let ids = ok(tok.encode(text, false));
    if let Some(long) = long {
        assert_eq!(
            ids.len(),
            long.token_count,
            "token count of the wikitext prefix"
        );
        assert_eq!(
            format!("{:016x}", fnv1a64_ids(&ids)),
            long.ids_fnv1a64,
            "ids of the wikitext prefix"
        );
    }
    assert_eq!(ok(tok.decode(&ids, false)), text);
    // Chunked reading (what `eval ppl --data` and `pack --calib` do) gives the same ids at any
    // chunk size that leaves room for cut points.
    for chunk in [4 << 10, 64 << 10] {
        let chunked = ok(tok.encode_reader(text.as_bytes(), "wikitext", false, None, chunk));
        assert_eq!(chunked, ids, "chunks of {chunk} bytes");
    }
}

#[test]
fn sentencepiece_style_tokenizer_json_streams_through_the_generic_path() {
    // Llama-2 layout: "▁" for spaces, <0xNN> byte-fallback tokens, a decoder that strips the
    // leading space: not byte-level, so the stream decodes windows of ids.
    let dir = std::env::temp_dir().join(format!("sieve-tok-spm-{}", std::process::id()));
    ok(std::fs::create_dir_all(&dir).map_err(|e| ModelError::Tokenizer(e.to_string())));
    let mut vocab = serde_json::Map::new();
    for (id, token) in [
        "<unk>", "<s>", "</s>", "▁", "▁hello", "▁world", "<0xE6>", "<0x97>", "<0xA5>",
    ]
    .iter()
    .enumerate()
    {
        vocab.insert((*token).to_owned(), id.into());
    }
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                  "vocab": vocab, "merges": []}
    });
    ok(std::fs::write(dir.join("tokenizer.json"), json.to_string())
        .map_err(|e| ModelError::Tokenizer(e.to_string())));
    let tok = ok(Tokenizer::from_file(dir.join("tokenizer.json")));
    std::fs::remove_dir_all(&dir).ok();
    // No config file: BOS/EOS come from the usual names.
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    let ids = [1, 4, 5, 3, 6, 7, 8, 2];
    assert_eq!(ok(tok.decode(&ids, true)), "hello world 日");
    let mut stream = tok.stream(true);
    let pieces: Vec<Option<String>> = ids.iter().map(|&id| ok(stream.push(id))).collect();
    let shown: Vec<Option<&str>> = pieces.iter().map(|p| p.as_deref()).collect();
    assert_eq!(
        shown,
        vec![
            None,
            Some("hello"),
            Some(" world"),
            Some(" "),
            None,
            None,
            Some("日"),
            None
        ]
    );
    assert_eq!(stream.finish(), None);
}
