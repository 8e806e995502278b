//! Model files, tokenizer, Llama-family forward pass and sampling.
