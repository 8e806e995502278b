//! Independent walkers over the file layouts, used to aim mutations: where the numeric fields
//! of a GGUF file are, and how to re-seal the checksums of `.sieve` containers and format blobs
//! after a mutation so that it reaches the parsers behind them. They are written against the
//! format documentation, not the readers, and stop quietly where a mutated file stops making
//! sense.

use crate::mutate::{Field, FieldKind};
use sieve_formats::blob::fnv1a64;

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}
fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// Most fields one walk records (a real vocabulary has ~10^5 strings).
const MAX_FIELDS: usize = 4096;

/// The numeric fields of a GGUF image: counts, string and array lengths, value type ids,
/// tensor dims, types and offsets.
pub fn gguf_fields(b: &[u8]) -> Vec<Field> {
    let mut out = Vec::new();
    let _ = walk_gguf(b, &mut out);
    out
}

fn push(out: &mut Vec<Field>, offset: usize, width: usize, kind: FieldKind) {
    if out.len() < MAX_FIELDS {
        out.push(Field {
            offset,
            width,
            kind,
        });
    }
}

fn walk_gguf(b: &[u8], out: &mut Vec<Field>) -> Option<()> {
    if b.get(..4)? != b"GGUF" {
        return None;
    }
    push(out, 4, 4, FieldKind::Value);
    let n_tensors = u64_at(b, 8)?;
    push(out, 8, 8, FieldKind::Count);
    let n_meta = u64_at(b, 16)?;
    push(out, 16, 8, FieldKind::Count);
    let mut pos = 24usize;
    for _ in 0..n_meta.min(1 << 20) {
        pos = string(b, pos, out)?;
        let ty = u32_at(b, pos)?;
        push(out, pos, 4, FieldKind::TypeId);
        pos = value(b, pos + 4, ty, out, 0)?;
    }
    for _ in 0..n_tensors.min(1 << 20) {
        pos = string(b, pos, out)?;
        let n_dims = u32_at(b, pos)?;
        push(out, pos, 4, FieldKind::Count);
        pos += 4;
        for _ in 0..n_dims.min(8) {
            push(out, pos, 8, FieldKind::Dim);
            pos += 8;
        }
        push(out, pos, 4, FieldKind::TypeId);
        push(out, pos + 4, 8, FieldKind::Offset);
        pos += 12;
    }
    Some(())
}

fn string(b: &[u8], pos: usize, out: &mut Vec<Field>) -> Option<usize> {
    let len = u64_at(b, pos)? as usize;
    push(out, pos, 8, FieldKind::Length);
    let end = pos.checked_add(8)?.checked_add(len)?;
    (end <= b.len()).then_some(end)
}

fn value(b: &[u8], pos: usize, ty: u32, out: &mut Vec<Field>, depth: usize) -> Option<usize> {
    let scalar = |w: usize| (pos + w <= b.len()).then_some(pos + w);
    match ty {
        0 | 1 | 7 => scalar(1),
        2 | 3 => scalar(2),
        4..=6 => {
            push(out, pos, 4, FieldKind::Value);
            scalar(4)
        }
        10..=12 => {
            push(out, pos, 8, FieldKind::Value);
            scalar(8)
        }
        8 => string(b, pos, out),
        9 if depth < 4 => {
            let elem = u32_at(b, pos)?;
            push(out, pos, 4, FieldKind::TypeId);
            let count = u64_at(b, pos + 4)?;
            push(out, pos + 4, 8, FieldKind::Count);
            let mut p = pos + 12;
            for _ in 0..count.min(1 << 20) {
                p = value(b, p, elem, out, depth + 1)?;
            }
            Some(p)
        }
        _ => None,
    }
}

/// The numeric fields of a `.sieve` container's header and section table.
pub fn pack_fields(b: &[u8]) -> Vec<Field> {
    let mut out = Vec::new();
    push(&mut out, 8, 4, FieldKind::Value);
    push(&mut out, 12, 4, FieldKind::Count);
    push(&mut out, 16, 8, FieldKind::Length);
    let Some(table_len) = u64_at(b, 16) else {
        return out;
    };
    let table_end = 32usize.saturating_add(table_len as usize).min(b.len());
    let mut pos = 32;
    while pos + 2 <= table_end {
        let Some(name_len) = u16_at(b, pos) else {
            break;
        };
        push(&mut out, pos, 2, FieldKind::Length);
        pos += 2 + name_len as usize;
        push(&mut out, pos, 2, FieldKind::TypeId);
        push(&mut out, pos + 2, 8, FieldKind::Offset);
        push(&mut out, pos + 10, 8, FieldKind::Length);
        pos += 26;
    }
    out
}

/// Sections of a `.sieve` image: (name, kind, offset, length), as far as the table is readable.
pub fn pack_sections(b: &[u8]) -> Vec<(String, u16, usize, usize)> {
    let mut out = Vec::new();
    let (Some(count), Some(table_len)) = (u32_at(b, 12), u64_at(b, 16)) else {
        return out;
    };
    let table_end = 32usize.saturating_add(table_len as usize).min(b.len());
    let mut pos = 32;
    for _ in 0..count.min(1 << 16) {
        let Some(name_len) = u16_at(b, pos) else {
            break;
        };
        let name_end = pos + 2 + name_len as usize;
        let (Some(name), Some(kind), Some(off), Some(len)) = (
            b.get(pos + 2..name_end),
            u16_at(b, name_end),
            u64_at(b, name_end + 2),
            u64_at(b, name_end + 10),
        ) else {
            break;
        };
        if name_end + 26 > table_end {
            break;
        }
        out.push((
            String::from_utf8_lossy(name).into_owned(),
            kind,
            off as usize,
            len as usize,
        ));
        pos = name_end + 26;
    }
    out
}

/// Recomputes every blob checksum inside weight sections, then every section checksum and the
/// table checksum, wherever the (possibly mutated) table still points inside the file.
pub fn reseal_pack(b: &mut [u8]) {
    let (Some(count), Some(table_len)) = (u32_at(b, 12), u64_at(b, 16)) else {
        return;
    };
    let table_end = 32usize.saturating_add(table_len as usize);
    if table_end > b.len() {
        return;
    }
    let mut pos = 32;
    for _ in 0..count.min(1 << 16) {
        let Some(name_len) = u16_at(b, pos) else {
            break;
        };
        let e = pos + 2 + name_len as usize;
        if e + 26 > table_end {
            break;
        }
        let (Some(kind), Some(off), Some(len)) =
            (u16_at(b, e), u64_at(b, e + 2), u64_at(b, e + 10))
        else {
            break;
        };
        let (off, len) = (off as usize, len as usize);
        if let Some(end) = off.checked_add(len).filter(|&x| x <= b.len()) {
            if kind == 2 {
                reseal_blob(&mut b[off..end]);
            }
            let sum = fnv1a64(&b[off..end]);
            b[e + 18..e + 26].copy_from_slice(&sum.to_le_bytes());
        }
        pos = e + 26;
    }
    let sum = fnv1a64(&b[32..table_end]);
    b[24..32].copy_from_slice(&sum.to_le_bytes());
}

/// Fields of a format blob: the frame header's length, and every aligned u32/u64 of the first
/// 256 payload bytes (where each format keeps its dimensions and array lengths).
pub fn blob_fields(b: &[u8]) -> Vec<Field> {
    let mut out = vec![Field {
        offset: 16,
        width: 8,
        kind: FieldKind::Length,
    }];
    let end = b.len().min(32 + 256);
    let mut pos = 32;
    while pos + 8 <= end {
        out.push(Field {
            offset: pos,
            width: 8,
            kind: FieldKind::Count,
        });
        out.push(Field {
            offset: pos,
            width: 4,
            kind: FieldKind::Dim,
        });
        pos += 4;
    }
    out
}

/// Recomputes a format blob's payload checksum (when its length field still fits).
pub fn reseal_blob(b: &mut [u8]) {
    let Some(len) = u64_at(b, 16) else { return };
    let Some(end) = 32usize.checked_add(len as usize).filter(|&e| e <= b.len()) else {
        return;
    };
    let sum = fnv1a64(&b[32..end]);
    b[24..32].copy_from_slice(&sum.to_le_bytes());
}

/// The safetensors input of the directory target: `u32 config length, config.json, file`.
pub fn split_st_input(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = u32_at(b, 0)? as usize;
    let config = b.get(4..4usize.checked_add(n)?)?;
    Some((config, &b[4 + n..]))
}

pub fn join_st_input(config: &[u8], file: &[u8]) -> Vec<u8> {
    let mut out = (config.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(config);
    out.extend_from_slice(file);
    out
}
