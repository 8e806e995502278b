//! Where the default model and the evaluation data live.

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// The default model's file name under `$SIEVE_HOME/models/`.
pub const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$SIEVE_HOME`, else `~/.cache/sieve`.
pub fn sieve_home() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("SIEVE_HOME").filter(|h| !h.is_empty()) {
        return Some(PathBuf::from(home));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("sieve"))
}

/// The model to use: `explicit` when given, else the default model, which must exist.
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.to_path_buf());
    }
    let Some(home) = sieve_home() else {
        bail!("neither SIEVE_HOME nor HOME is set; pass --model PATH");
    };
    let path = home.join("models").join(DEFAULT_MODEL);
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => Ok(path),
        Ok(_) => bail!(
            "the default model {} is not a regular file (pass --model PATH)",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "the default model {} is missing; run `bash scripts/fetch-model.sh` from the \
             repository root (or pass --model PATH)",
            path.display()
        ),
        Err(e) => bail!(
            "the default model {} cannot be read: {e} (pass --model PATH)",
            path.display()
        ),
    }
}

/// The evaluation and calibration text sieve carries: WikiText-2's splits (`test.txt`,
/// `valid.txt`), from `$SIEVE_HOME/data/wikitext-2/` (where `scripts/fetch-model.sh` puts them),
/// else from the `data/wikitext-2/` folder of a checkout the command runs in or was built into
/// (`target/release/sieve`). An installed `sieve` needs the first.
pub fn default_text(file: &str) -> Result<PathBuf> {
    let in_home = sieve_home().map(|h| h.join("data").join("wikitext-2").join(file));
    if let Some(p) = in_home.as_ref().filter(|p| p.is_file()) {
        return Ok(p.clone());
    }
    if let Some(p) = checkout_candidates()
        .into_iter()
        .filter(|dir| dir.join("Cargo.toml").is_file())
        .map(|dir| dir.join("data").join("wikitext-2").join(file))
        .find(|p| p.is_file())
    {
        return Ok(p);
    }
    let looked = in_home.map_or_else(
        || "$SIEVE_HOME/data/wikitext-2".to_string(),
        |p| p.display().to_string(),
    );
    bail!(
        "the default text {looked} is missing; run `bash scripts/fetch-model.sh` from the sieve \
         repository (it installs the model and WikiText-2 under $SIEVE_HOME), or pass a file"
    )
}

/// Directories that may be a checkout's root: the current directory and its ancestors, and the
/// executable's ancestors (`target/release/sieve`). Never the source path baked in at build time:
/// an installed binary must not depend on where it was built.
fn checkout_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        out.extend(cwd.ancestors().map(Path::to_path_buf));
    }
    if let Ok(exe) = std::env::current_exe() {
        out.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
    }
    out
}
