//! Helpers for the GGUF reader's tests; the files themselves are built by [`super::writer`].

use super::MetaValue;

pub(crate) fn s(v: &str) -> MetaValue {
    MetaValue::String(v.to_string())
}

pub(crate) fn strings(items: &[&str]) -> MetaValue {
    MetaValue::Array(items.iter().map(|x| s(x)).collect())
}
