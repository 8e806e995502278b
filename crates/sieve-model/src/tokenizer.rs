//! BPE tokenizer from `tokenizer.json` or from GGUF metadata, with special tokens and a streaming
//! decoder.
//!
//! Both sources end up as a Hugging Face `tokenizers::Tokenizer`. For GGUF the byte-level BPE
//! model is rebuilt from `tokenizer.ggml.tokens` + `tokenizer.ggml.merges`, and the pre-tokenizer
//! (the regex that cuts text into words before BPE) is chosen by `tokenizer.ggml.pre` with the
//! same regexes llama.cpp uses for that name: a wrong choice silently changes token ids (digits
//! are the usual victim), so unknown names are refused rather than guessed.

use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{ModelError, Result};

/// The tokenizer description stored in GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
/// The GGUF reader fills it; [`Tokenizer`] is built from it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GgufTokenizerSpec {
    /// `tokenizer.ggml.model`, e.g. `gpt2` (byte-level BPE) or `llama` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `smollm`, `llama-bpe`, `qwen2`; empty when absent.
    pub pre: String,
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.merges`, each "left right".
    pub merges: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    pub token_types: Vec<i32>,
    pub scores: Vec<f32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub chat_template: Option<String>,
}

/// Most bytes read from a `tokenizer.json`: 256 MiB (large vocabularies are 10-20 MB).
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 256 << 20;

/// GGUF `token_type` values that matter here.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Tokens that end a turn in the chat formats we know; generation stops on any of them.
const END_OF_TURN_TOKENS: [&str; 4] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
];

/// GPT-2's split regex. llama.cpp writes it without the final `|\s+`; the two are equivalent
/// with isolated splitting because whatever `\s+` would add is a single unmatched whitespace
/// character, which becomes its own piece either way.
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a `tokenizer.ggml.pre` name pre-tokenizes, after llama.cpp's `llama-vocab.cpp`.
struct PreTokenizerRecipe {
    /// Applied in order; each splits the pieces the previous one produced.
    regexes: &'static [&'static str],
    /// Take a whole word from the vocabulary before trying merges (llama.cpp `ignore_merges`).
    ignore_merges: bool,
    /// llama.cpp's BOS default for this family when the file has no `add_bos_token`.
    add_bos: bool,
}

/// The `tokenizer.ggml.pre` names accepted, grouped by the regexes they share in llama.cpp.
const KNOWN_PRE_TOKENIZERS: &[(&[&str], PreTokenizerRecipe)] = &[
    (
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        PreTokenizerRecipe {
            regexes: &[r"\p{N}", GPT2_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "dbrx",
            "smaug-bpe",
        ],
        PreTokenizerRecipe {
            regexes: &[LLAMA3_REGEX],
            ignore_merges: true,
            add_bos: true,
        },
    ),
    (
        &["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"],
        PreTokenizerRecipe {
            regexes: &[QWEN2_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
    (
        &["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"],
        PreTokenizerRecipe {
            regexes: &[GPT2_REGEX],
            ignore_merges: false,
            add_bos: false,
        },
    ),
];

fn pre_tokenizer_recipe(name: &str) -> Result<&'static PreTokenizerRecipe> {
    KNOWN_PRE_TOKENIZERS
        .iter()
        .find(|(names, _)| names.contains(&name))
        .map(|(_, recipe)| recipe)
        .ok_or_else(|| {
            let known: Vec<&str> = KNOWN_PRE_TOKENIZERS
                .iter()
                .flat_map(|(names, _)| names.iter().copied())
                .collect();
            let shown = if name.is_empty() { "(absent)" } else { name };
            ModelError::Tokenizer(format!(
                "unknown pre-tokenizer tokenizer.ggml.pre = {shown}; known: {}",
                known.join(", ")
            ))
        })
}

/// GPT-2's byte-level alphabet: the printable character that stands for each byte 0..=255
/// (printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order).
fn byte_level_alphabet() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(code).unwrap_or('?')
        })
        .collect()
}

/// A text <-> token-id converter with the model's special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos_by_default: bool,
    chat_template: Option<String>,
    /// Control tokens: matched whole in text, dropped on decode when asked to skip specials.
    special_ids: HashSet<u32>,
    /// True when token strings are GPT-2 byte-level text, so a token maps to exact bytes and
    /// the stream decoder can work byte by byte.
    byte_level: bool,
    /// `inner` with special tokens encoded as plain text, built on first use
    /// ([`Tokenizer::encode_literal`]).
    literal: std::sync::OnceLock<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("byte_level", &self.byte_level)
            .finish_non_exhaustive()
    }
}

fn tokenizer_error(context: &str, err: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{context}: {err}"))
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. BOS/EOS, `add_bos_token` and the chat template come
    /// from `tokenizer_config.json` (and extra EOS ids from `generation_config.json`) in the same
    /// folder when present; otherwise well-known special-token names are used.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let bytes = crate::weights::read_small_file(path, MAX_TOKENIZER_JSON_BYTES)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| tokenizer_error(&format!("parsing {shown}"), e))?;
        let folder = path.parent().unwrap_or_else(|| Path::new("."));
        let config = read_optional_json(&folder.join("tokenizer_config.json"))?;
        let generation = read_optional_json(&folder.join("generation_config.json"))?;

        let special_ids: HashSet<u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let named = |key: &str| -> Option<u32> {
            let value = config.as_ref()?.get(key)?;
            let content = value
                .as_str()
                .or_else(|| value.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(content)
        };
        let bos_id = named("bos_token").or_else(|| {
            ["<|begin_of_text|>", "<s>"]
                .iter()
                .find_map(|t| inner.token_to_id(t))
        });
        let mut eos_ids: Vec<u32> = named("eos_token").into_iter().collect();
        if let Some(ids) = generation.as_ref().and_then(|g| g.get("eos_token_id")) {
            let listed: Vec<u64> = match ids {
                serde_json::Value::Array(items) => {
                    items.iter().filter_map(|v| v.as_u64()).collect()
                }
                other => other.as_u64().into_iter().collect(),
            };
            eos_ids.extend(listed.into_iter().filter_map(|id| u32::try_from(id).ok()));
        }
        if eos_ids.is_empty() {
            eos_ids.extend(inner.token_to_id("</s>"));
        }
        let add_bos_by_default = config
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let chat_template = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(|t| {
                match t {
                    serde_json::Value::String(s) => Some(s.clone()),
                    // Newer configs list named templates; "default" is the chat one.
                    serde_json::Value::Array(items) => items
                        .iter()
                        .find(|i| i.get("name").and_then(|n| n.as_str()) == Some("default"))
                        .or_else(|| items.first())
                        .and_then(|i| i.get("template"))
                        .and_then(|s| s.as_str())
                        .map(str::to_owned),
                    _ => None,
                }
            });
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self::assemble(
            inner,
            vocab_size,
            bos_id,
            eos_ids,
            add_bos_by_default,
            chat_template,
            special_ids,
            byte_level,
        ))
    }

    /// Builds the tokenizer a GGUF file describes. Only byte-level BPE (`tokenizer.ggml.model =
    /// gpt2`) is supported; SentencePiece (`llama`) is refused.
    pub fn from_gguf_spec(spec: &GgufTokenizerSpec) -> Result<Self> {
        match spec.model.as_str() {
            "gpt2" => {}
            "llama" => {
                return Err(ModelError::Unsupported(
                    "SentencePiece tokenizers (tokenizer.ggml.model = llama) are not supported; \
                     byte-level BPE (gpt2) is"
                        .into(),
                ))
            }
            other => {
                return Err(ModelError::Unsupported(format!(
                    "tokenizer model tokenizer.ggml.model = {other:?}; supported: gpt2 \
                     (byte-level BPE)"
                )))
            }
        }
        let vocab_size = spec.tokens.len();
        if vocab_size == 0 {
            return Err(ModelError::Metadata {
                key: "tokenizer.ggml.tokens".into(),
                reason: "empty vocabulary".into(),
            });
        }
        if u32::try_from(vocab_size).is_err() {
            return Err(ModelError::Metadata {
                key: "tokenizer.ggml.tokens".into(),
                reason: format!("{vocab_size} tokens do not fit u32 ids"),
            });
        }
        if !spec.token_types.is_empty() && spec.token_types.len() != vocab_size {
            return Err(ModelError::Metadata {
                key: "tokenizer.ggml.token_type".into(),
                reason: format!("{} entries for {vocab_size} tokens", spec.token_types.len()),
            });
        }
        for (key, id) in [
            ("tokenizer.ggml.bos_token_id", spec.bos_token_id),
            ("tokenizer.ggml.eos_token_id", spec.eos_token_id),
        ] {
            if let Some(id) = id {
                if id as usize >= vocab_size {
                    return Err(ModelError::Metadata {
                        key: key.into(),
                        reason: format!("id {id} outside the vocabulary of {vocab_size}"),
                    });
                }
            }
        }
        if spec.merges.is_empty() {
            // BPE with no merges maps every word to single characters: the model would run on
            // token ids it never saw in training and print fluent-looking garbage.
            return Err(ModelError::Metadata {
                key: "tokenizer.ggml.merges".into(),
                reason: "absent or empty; a byte-level BPE (gpt2) tokenizer needs its merges, \
                         without them every word would be cut into single characters"
                    .into(),
            });
        }
        let recipe = pre_tokenizer_recipe(&spec.pre)?;

        // Ids are positions; a duplicated string keeps its first id (the later one can still be
        // decoded through the added-token table when it is special).
        let mut vocab = Vocab::default();
        for (id, token) in spec.tokens.iter().enumerate() {
            vocab.entry(token.clone()).or_insert(id as u32);
        }
        let mut merges: Merges = Vec::with_capacity(spec.merges.len());
        for (index, merge) in spec.merges.iter().enumerate() {
            let (left, right) = merge.split_once(' ').ok_or_else(|| ModelError::Metadata {
                key: "tokenizer.ggml.merges".into(),
                reason: format!("merge {index} {merge:?} is not \"left right\""),
            })?;
            merges.push((left.to_owned(), right.to_owned()));
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(recipe.ignore_merges)
            .build()
            .map_err(|e| tokenizer_error("building BPE from GGUF vocabulary and merges", e))?;

        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(recipe.regexes.len() + 1);
        for regex in recipe.regexes {
            let split = Split::new(
                SplitPattern::Regex((*regex).to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| tokenizer_error(&format!("compiling split regex {regex}"), e))?;
            steps.push(split.into());
        }
        // The regexes above already split; ByteLevel only maps bytes to its printable alphabet.
        steps.push(ByteLevel::new(false, false, false).into());

        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(Sequence::new(steps)));
        inner.with_decoder(Some(ByteLevel::new(false, false, false)));

        let mut special_ids = HashSet::new();
        let mut control = Vec::new();
        let mut user_defined = Vec::new();
        for (id, (token, kind)) in spec.tokens.iter().zip(&spec.token_types).enumerate() {
            if token.is_empty() {
                continue;
            }
            match *kind {
                TOKEN_TYPE_CONTROL => {
                    special_ids.insert(id as u32);
                    control.push(AddedToken::from(token.clone(), true).normalized(false));
                }
                TOKEN_TYPE_USER_DEFINED => {
                    user_defined.push(AddedToken::from(token.clone(), false).normalized(false));
                }
                _ => {}
            }
        }
        inner.add_special_tokens(&control);
        inner.add_tokens(&user_defined);

        Ok(Self::assemble(
            inner,
            vocab_size,
            spec.bos_token_id,
            spec.eos_token_id.into_iter().collect(),
            spec.add_bos_token.unwrap_or(recipe.add_bos),
            spec.chat_template.clone(),
            special_ids,
            true,
        ))
    }

    /// A tokenizer for models with random weights (`--synthetic`), which have none: one token
    /// per byte of the text (ids 3..=258, GPT-2's byte-level alphabet), id 0 `<unk>`, 1 `<s>`
    /// (BOS), 2 `</s>`; ids from 259 up are placeholders `<tN>` that decode as that text.
    /// No id ends a text: a random model's output means nothing, so generation runs to its
    /// token limit, as a load test wants. `vocab_size` must be at least 259.
    pub fn bytes(vocab_size: usize) -> Result<Self> {
        const FIRST_BYTE: u32 = 3;
        let first_placeholder = FIRST_BYTE as usize + 256;
        if vocab_size < first_placeholder || u32::try_from(vocab_size).is_err() {
            return Err(ModelError::InvalidArgument(format!(
                "a byte tokenizer needs {first_placeholder} to 2^32 ids; the model has {vocab_size}"
            )));
        }
        let mut vocab = Vocab::default();
        for (id, name) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert((*name).to_owned(), id as u32);
        }
        for (byte, ch) in byte_level_alphabet().into_iter().enumerate() {
            vocab.insert(ch.to_string(), FIRST_BYTE + byte as u32);
        }
        for id in first_placeholder..vocab_size {
            vocab.insert(format!("<t{id}>"), id as u32);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .unk_token("<unk>".to_owned())
            .build()
            .map_err(|e| tokenizer_error("building the byte tokenizer", e))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
        inner.with_decoder(Some(ByteLevel::new(false, false, false)));
        let specials: Vec<AddedToken> = ["<unk>", "<s>", "</s>"]
            .iter()
            .map(|t| AddedToken::from(*t, true).normalized(false))
            .collect();
        inner.add_special_tokens(&specials);
        Ok(Self::assemble(
            inner,
            vocab_size,
            Some(1),
            Vec::new(),
            false,
            None,
            HashSet::from([0, 1, 2]),
            true,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        inner: tokenizers::Tokenizer,
        vocab_size: usize,
        bos_id: Option<u32>,
        mut eos_ids: Vec<u32>,
        add_bos_by_default: bool,
        chat_template: Option<String>,
        special_ids: HashSet<u32>,
        byte_level: bool,
    ) -> Self {
        for name in END_OF_TURN_TOKENS {
            if let Some(id) = inner.token_to_id(name) {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        Self {
            inner,
            vocab_size,
            bos_id,
            eos_ids,
            add_bos_by_default,
            chat_template,
            special_ids,
            byte_level,
            literal: std::sync::OnceLock::new(),
        }
    }

    /// Token ids for `text`. Special tokens written in the text (`<|im_start|>`) become their
    /// single ids. With `add_bos`, the BOS id is put first; asking for it on a vocabulary without
    /// one is an error.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| tokenizer_error("encoding", e))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if add_bos {
            let bos = self.bos_id.ok_or_else(|| {
                ModelError::Tokenizer(
                    "a BOS token was asked for but the vocabulary has none".into(),
                )
            })?;
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// Token ids for `text` taken literally: a special token's text written in it
    /// (`<|im_start|>`) is encoded as ordinary characters, not as the special id. For text from
    /// users placed inside a chat template, so that it cannot open or close turns. No BOS.
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>> {
        let literal = self.literal.get_or_init(|| {
            let mut plain = self.inner.clone();
            plain.set_encode_special_tokens(true);
            plain
        });
        let encoding = literal
            .encode_fast(text, false)
            .map_err(|e| tokenizer_error("encoding", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of the UTF-8 text file `path`, read and tokenized in chunks, stopping as soon as
    /// `max_tokens` ids (BOS included) are in hand: the work and memory are bounded by the
    /// limit, not by the file (see [`Self::encode_reader`]).
    pub fn encode_file(
        &self,
        path: &Path,
        add_bos: bool,
        max_tokens: Option<usize>,
    ) -> Result<Vec<u32>> {
        let file = crate::weights::open_text(path)?;
        let chunk = text_chunk_bytes(max_tokens);
        self.encode_reader(
            file,
            &path.display().to_string(),
            add_bos,
            max_tokens,
            chunk,
        )
    }

    /// Token ids of the UTF-8 text `reader` yields (`name` labels it in errors), tokenized
    /// `chunk_bytes` at a time. Each chunk ends at a space that follows a non-space character
    /// and precedes a letter (`x| Word`): every supported pre-tokenizer already splits there, so
    /// the ids equal those of the whole text at once. A stretch of [`MAX_UNCUT_CHUNKS`] chunks
    /// with no such point (text without words) is cut at a character boundary instead, which
    /// keeps memory bounded at the cost of possibly different ids around that cut.
    pub fn encode_reader(
        &self,
        mut reader: impl std::io::Read,
        name: &str,
        add_bos: bool,
        max_tokens: Option<usize>,
        chunk_bytes: usize,
    ) -> Result<Vec<u32>> {
        let limit = max_tokens.unwrap_or(usize::MAX);
        let chunk_bytes = chunk_bytes.max(1);
        let mut ids = self.encode("", add_bos)?;
        let mut pending: Vec<u8> = Vec::new();
        // File offset of `pending[0]`, for error messages.
        let mut consumed: u64 = 0;
        let mut eof = false;
        let mut buf = vec![0u8; chunk_bytes.min(1 << 16)];
        while ids.len() < limit {
            let target = pending.len() + chunk_bytes;
            while !eof && pending.len() < target {
                let want = buf.len().min(target - pending.len());
                match reader.read(&mut buf[..want]) {
                    Ok(0) => eof = true,
                    Ok(n) => pending.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(source) => {
                        return Err(ModelError::Io {
                            path: name.to_string(),
                            source,
                        })
                    }
                }
            }
            let valid = match std::str::from_utf8(&pending) {
                Ok(t) => t.len(),
                // A character cut by the chunk end completes with the next read.
                Err(e) if e.error_len().is_none() && !eof => e.valid_up_to(),
                Err(e) => {
                    return Err(ModelError::InvalidArgument(format!(
                        "{name} is not UTF-8 text (invalid byte at offset {})",
                        consumed + e.valid_up_to() as u64
                    )))
                }
            };
            let text = std::str::from_utf8(&pending[..valid]).map_err(|e| {
                ModelError::InvalidArgument(format!("{name} is not UTF-8 text: {e}"))
            })?;
            let cut = if eof {
                text.len()
            } else {
                match safe_cut(text) {
                    Some(c) => c,
                    None if pending.len() >= MAX_UNCUT_CHUNKS * chunk_bytes => text.len(),
                    None => continue,
                }
            };
            if cut > 0 {
                let piece = self
                    .inner
                    .encode_fast(&text[..cut], false)
                    .map_err(|e| tokenizer_error(&format!("encoding {name}"), e))?;
                ids.extend_from_slice(piece.get_ids());
            }
            pending.drain(..cut);
            consumed += cut as u64;
            if eof && pending.is_empty() {
                break;
            }
        }
        ids.truncate(limit);
        Ok(ids)
    }

    /// Text for `ids`; control tokens are dropped when `skip_special`. Bytes that are not valid
    /// UTF-8 (a character cut between tokens) come out as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| tokenizer_error("decoding", e))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(id) => Err(ModelError::Tokenizer(format!(
                "token id {id} outside the vocabulary of {}",
                self.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// A decoder that turns ids arriving one at a time into complete UTF-8 pieces.
    pub fn stream(&self, skip_special: bool) -> TokenStream<'_> {
        TokenStream {
            tokenizer: self,
            skip_special,
            pending_bytes: Vec::new(),
            window: Vec::new(),
            window_context: 0,
            window_prefix: String::new(),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Ids that end generation: the model's EOS plus any end-of-turn token the vocabulary has.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// Whether the model expects a BOS at the start of a prompt (`add_bos_token`).
    pub fn add_bos_by_default(&self) -> bool {
        self.add_bos_by_default
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token's string as stored in the vocabulary (byte-level alphabet for BPE models).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The raw bytes a byte-level token stands for, the way the ByteLevel decoder maps them: a
    /// token with a character outside the byte alphabet is taken as its UTF-8 text.
    fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        let token = self.inner.id_to_token(id).ok_or_else(|| {
            ModelError::Tokenizer(format!("token id {id} has no text in the vocabulary"))
        })?;
        let table = unicode_to_byte();
        let mapped: Option<Vec<u8>> = token
            .chars()
            .map(|c| table.get(c as usize).copied().flatten())
            .collect();
        Ok(mapped.unwrap_or_else(|| token.into_bytes()))
    }
}

/// Bytes of text tokenized at once by [`Tokenizer::encode_file`]: 256 KiB (the tokenizer's
/// working memory is ~100x the text it holds), or fewer when a token limit needs less (16 bytes
/// per token asked for, at least 4 KiB).
pub const TEXT_CHUNK_BYTES: usize = 256 << 10;

/// Chunks of text without a safe cut point after which [`Tokenizer::encode_reader`] cuts anyway.
pub const MAX_UNCUT_CHUNKS: usize = 4;

fn text_chunk_bytes(max_tokens: Option<usize>) -> usize {
    match max_tokens {
        Some(n) => n.saturating_mul(16).clamp(4 << 10, TEXT_CHUNK_BYTES),
        None => TEXT_CHUNK_BYTES,
    }
}

/// The last byte offset in `text` (not 0) of a space that follows a non-whitespace character and
/// precedes a letter: a point where every pre-tokenizer regex of [`KNOWN_PRE_TOKENIZERS`] ends
/// one piece and starts the next (` ?\p{L}+` and its variants take the space with the word;
/// nothing takes a non-space character together with the space after it).
fn safe_cut(text: &str) -> Option<usize> {
    let mut after: Option<char> = None;
    let mut at_space: Option<usize> = None;
    for (i, c) in text.char_indices().rev() {
        if let Some(space) = at_space.take() {
            if !c.is_whitespace() {
                return Some(space);
            }
        }
        if c == ' ' && i > 0 && after.is_some_and(char::is_alphabetic) {
            at_space = Some(i);
        }
        after = Some(c);
    }
    None
}

fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let shown = path.display().to_string();
    let bytes = crate::weights::read_small_file(path, crate::weights::MAX_JSON_BYTES)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ModelError::Malformed {
            path: shown,
            reason: e.to_string(),
        })
}

/// GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves, the
/// other 68 bytes take the characters from U+0100 on, in byte order.
fn byte_to_unicode() -> [char; 256] {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut table = ['\0'; 256];
    let mut next_extra = 0x100u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let byte = byte as u32;
        let code = if printable(byte) {
            byte
        } else {
            next_extra += 1;
            next_extra - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    table
}

/// The inverse of [`byte_to_unicode`], indexed by code point (all of them are below U+0144).
fn unicode_to_byte() -> &'static [Option<u8>] {
    static TABLE: OnceLock<Vec<Option<u8>>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let forward = byte_to_unicode();
        let size = forward.iter().map(|&c| c as usize + 1).max().unwrap_or(0);
        let mut inverse = vec![None; size];
        for (byte, c) in forward.iter().enumerate() {
            inverse[*c as usize] = Some(byte as u8);
        }
        inverse
    })
}

/// Incremental detokenizer: push ids as the model produces them, get text as soon as it forms
/// whole characters. A character whose bytes are split over several tokens is held back until
/// its last byte arrives.
pub struct TokenStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    /// Byte-level mode: bytes of an unfinished UTF-8 character.
    pending_bytes: Vec<u8>,
    /// Generic mode (decoders that are not byte-level): ids whose text is not settled yet,
    /// the first `window_context` of them already emitted and kept only as left context.
    window: Vec<u32>,
    window_context: usize,
    window_prefix: String,
}

impl TokenStream<'_> {
    /// Adds one token; returns the text that became complete, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.tokenizer.check_ids(&[id])?;
        if self.tokenizer.byte_level {
            if self.skip_special && self.tokenizer.is_special(id) {
                return Ok(None);
            }
            let bytes = self.tokenizer.token_bytes(id)?;
            self.pending_bytes.extend_from_slice(&bytes);
            let text = take_complete_utf8(&mut self.pending_bytes);
            return Ok((!text.is_empty()).then_some(text));
        }
        self.window.push(id);
        let text = self.tokenizer.decode(&self.window, self.skip_special)?;
        if text.len() <= self.window_prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let fresh = match text.strip_prefix(self.window_prefix.as_str()) {
            Some(rest) => rest.to_owned(),
            // The decoder rewrote earlier text (rare, e.g. whitespace cleanup): emit what is new
            // by length on a character boundary rather than repeating text.
            None => text
                .char_indices()
                .find(|(i, _)| *i >= self.window_prefix.len())
                .map(|(i, _)| text[i..].to_owned())
                .unwrap_or_default(),
        };
        let emitted_ids = self.window.len();
        self.window.drain(..self.window_context);
        self.window_context = emitted_ids - self.window_context;
        self.window_prefix = self.tokenizer.decode(&self.window, self.skip_special)?;
        Ok((!fresh.is_empty()).then_some(fresh))
    }

    /// Ends the stream; bytes of a character that never completed come out as U+FFFD.
    pub fn finish(self) -> Option<String> {
        if self.tokenizer.byte_level {
            let text = String::from_utf8_lossy(&self.pending_bytes).into_owned();
            return (!text.is_empty()).then_some(text);
        }
        if self.window.len() == self.window_context {
            return None;
        }
        let text = self
            .tokenizer
            .decode(&self.window, self.skip_special)
            .ok()?;
        let fresh = text
            .get(self.window_prefix.len()..)
            .unwrap_or_default()
            .to_owned();
        (!fresh.is_empty()).then_some(fresh)
    }
}

/// Removes and returns the longest decodable prefix of `bytes`, leaving the bytes of a character
/// that may still be completed; byte sequences that can never be valid become U+FFFD.
fn take_complete_utf8(bytes: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&bytes[start..]) {
            Ok(text) => {
                out.push_str(text);
                start = bytes.len();
                break;
            }
            Err(err) => {
                let valid = start + err.valid_up_to();
                out.push_str(std::str::from_utf8(&bytes[start..valid]).unwrap_or_default());
                match err.error_len() {
                    Some(bad) => {
                        out.push('\u{FFFD}');
                        start = valid + bad;
                    }
                    None => {
                        start = valid;
                        break;
                    }
                }
            }
        }
    }
    bytes.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection_onto_printable_characters() {
        let forward = byte_to_unicode();
        let distinct: HashSet<char> = forward.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(forward[b' ' as usize], 'Ġ');
        assert_eq!(forward[b'\n' as usize], 'Ċ');
        assert_eq!(forward[b'A' as usize], 'A');
        let inverse = unicode_to_byte();
        for (byte, c) in forward.iter().enumerate() {
            assert_eq!(inverse[*c as usize], Some(byte as u8));
        }
    }

    #[test]
    fn complete_utf8_holds_back_an_unfinished_character() {
        let mut pending = "a日".as_bytes()[..3].to_vec();
        assert_eq!(take_complete_utf8(&mut pending), "a");
        assert_eq!(pending.len(), 2);
        pending.push("日".as_bytes()[2]);
        assert_eq!(take_complete_utf8(&mut pending), "日");
        assert!(pending.is_empty());
    }

    #[test]
    fn complete_utf8_replaces_bytes_that_can_never_be_valid() {
        let mut pending = vec![b'x', 0xFF, b'y', 0xE6];
        assert_eq!(take_complete_utf8(&mut pending), "x\u{FFFD}y");
        assert_eq!(pending, vec![0xE6]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_refused_with_the_known_names() {
        let err = pre_tokenizer_recipe("mystery")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("mystery"), "{err}");
        assert!(
            err.contains("smollm") && err.contains("llama-bpe") && err.contains("qwen2"),
            "{err}"
        );
    }

    fn small_spec() -> GgufTokenizerSpec {
        GgufTokenizerSpec {
            model: "gpt2".into(),
            pre: "smollm".into(),
            tokens: ["a", "b", "ab", "Ġ"].map(String::from).to_vec(),
            merges: vec!["a b".into()],
            ..GgufTokenizerSpec::default()
        }
    }

    #[test]
    fn safe_cuts_fall_between_a_word_end_and_a_spaced_word() {
        assert_eq!(safe_cut("ab cd"), Some(2));
        assert_eq!(safe_cut("ab  cd"), None);
        assert_eq!(safe_cut("ab 12"), None);
        assert_eq!(safe_cut(" cd"), None);
        assert_eq!(safe_cut("x. Yz and"), Some(5));
        assert_eq!(safe_cut("日本 語"), Some(6));
    }

    #[test]
    fn chunked_encoding_equals_whole_encoding_and_stops_at_the_limit() {
        let spec = GgufTokenizerSpec {
            tokens: ["a", "b", "ab", "Ġ", "Ċ", "1", "Ġab", ".", "ĠĠ"]
                .map(String::from)
                .to_vec(),
            merges: vec!["a b".into(), "Ġ ab".into(), "Ġ Ġ".into()],
            ..small_spec()
        };
        let tok = Tokenizer::from_gguf_spec(&spec).unwrap();
        let text = "ab ab. ba\n\n  ab1 b1a  ab\nab ".repeat(40);
        let whole = tok.encode(&text, false).unwrap();
        // Cut points come every few words here, so every chunk size of at least a quarter of
        // their spacing cuts only at them (smaller ones fall back to forced cuts by design).
        for chunk in [12, 16, 64, 1000] {
            let got = tok
                .encode_reader(text.as_bytes(), "t", false, None, chunk)
                .unwrap();
            assert_eq!(got, whole, "chunk {chunk}");
        }
        let first = tok
            .encode_reader(text.as_bytes(), "t", false, Some(10), 8)
            .unwrap();
        assert_eq!(first, whole[..10]);
        // Reading stops once the limit is reached: an endless reader still returns.
        let endless = std::io::repeat(b'a');
        let got = tok.encode_reader(endless, "t", false, Some(5), 64).unwrap();
        assert_eq!(got.len(), 5);
        let err = tok
            .encode_reader(&b"ab \xff ab"[..], "bad.txt", false, None, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad.txt") && err.contains("offset 3"), "{err}");
    }

    #[test]
    fn bpe_without_merges_is_refused() {
        let tok = Tokenizer::from_gguf_spec(&small_spec()).unwrap();
        assert_eq!(tok.encode("ab", false).unwrap(), [2]);
        let spec = GgufTokenizerSpec {
            merges: Vec::new(),
            ..small_spec()
        };
        let err = Tokenizer::from_gguf_spec(&spec).unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.merges"), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn complete_utf8_in_any_chunking_reassembles_the_text(text in "\\PC{0,40}", cuts in proptest::collection::vec(0usize..200, 0..8)) {
            let bytes = text.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pending = Vec::new();
            let mut out = String::new();
            let mut last = 0;
            for cut in cuts.into_iter().chain([bytes.len()]) {
                pending.extend_from_slice(&bytes[last..cut]);
                out.push_str(&take_complete_utf8(&mut pending));
                last = cut;
            }
            proptest::prop_assert!(pending.is_empty());
            proptest::prop_assert_eq!(out, text);
        }
    }

    #[test]
    fn byte_tokenizer_round_trips_text_and_ends_nothing() {
        let t = Tokenizer::bytes(32000).unwrap();
        assert_eq!(t.vocab_size(), 32000);
        let text = "Hello, wörld!\n\ttabs and  spaces";
        let ids = t.encode(text, false).unwrap();
        assert_eq!(ids.len(), text.len(), "one token per byte");
        assert!(ids.iter().all(|&id| (3..259).contains(&id)), "{ids:?}");
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        // Streaming decode gives the same text, the multi-byte character included.
        let mut stream = t.stream(false);
        let mut streamed = String::new();
        for &id in &ids {
            if let Some(piece) = stream.push(id).unwrap() {
                streamed.push_str(&piece);
            }
        }
        streamed.extend(stream.finish());
        assert_eq!(streamed, text);
        // Placeholders decode as their names; no id ends a text.
        assert_eq!(t.decode(&[300], false).unwrap(), "<t300>");
        assert!((0..32000).all(|id| !t.is_eos(id)));
        assert_eq!(t.bos_id(), Some(1));
        assert!(Tokenizer::bytes(258).is_err());
        assert!(Tokenizer::bytes(0).is_err());
    }
}
