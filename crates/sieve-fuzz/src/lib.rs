//! Fuzzing on stable Rust, without cargo-fuzz: a mutation-based harness over every reader of
//! untrusted bytes in sieve (GGUF files, safetensors directories, `.sieve` containers, every
//! weight format's blob, the GGUF tokenizer builder).
//!
//! | module | job |
//! |---|---|
//! | [`alloc`] | counting global allocator: peak heap per input, a cap on single allocations |
//! | [`mutate`] | generic byte mutations and structure-aware field rewrites |
//! | [`layout`] | independent walkers locating fields, re-sealing checksums after a mutation |
//! | [`seeds`] | the seed corpus (tiny models of every kind, a cut of the default model) |
//! | [`targets`] | what each target runs on an input |
//! | [`runner`] | the loop: mutate, run under `catch_unwind`, time, measure, record findings |

pub mod alloc;
pub mod layout;
pub mod mutate;
pub mod runner;
pub mod seeds;
pub mod targets;

/// The committed seed corpus, `crates/sieve-fuzz/corpus/<target>/`.
pub fn corpus_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

/// The corpus files of one target, sorted by name.
pub fn load_corpus(dir: &std::path::Path, target: &str) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir.join(target)) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            std::fs::read(e.path()).ok().map(|b| (name, b))
        })
        .collect();
    out.sort();
    out
}
