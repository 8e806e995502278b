//! (being written) BPE tokenizer from `tokenizer.json` or from GGUF metadata.

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
