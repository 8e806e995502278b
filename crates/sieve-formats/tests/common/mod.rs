//! Hostile-input checks shared by the per-format integration tests.

use sieve_formats::blob;
use sieve_formats::{registry, FormatKind};

/// Flips the given bits of a format payload, re-frames it with a valid checksum (so only the
/// payload validation stands in the way) and loads it: an error is fine, a loaded matrix must
/// decode and multiply without panicking. Returns false when a loaded matrix is inconsistent.
pub fn flipped_payload_is_safe(
    kind: FormatKind,
    mut payload: Vec<u8>,
    flips: &[(usize, u8)],
) -> bool {
    for &(at, bit) in flips {
        let i = at % payload.len();
        payload[i] ^= 1 << bit;
    }
    match registry::from_bytes(&blob::frame(kind as u16, &payload)) {
        Ok(back) => {
            let d = back.decode();
            let mut y = vec![0f32; back.rows()];
            let x = vec![1f32; back.cols()];
            back.matvec(&x, None, &mut y).is_ok() && d.rows() == back.rows()
        }
        Err(_) => true,
    }
}

/// Random bytes are never a format; in a valid frame they are an error or a loadable matrix
/// (never a panic), and a truncated frame is always an error.
pub fn random_bytes_are_safe(kind: FormatKind, bytes: &[u8]) -> bool {
    if registry::from_bytes(bytes).is_ok() {
        return false;
    }
    let mut framed = blob::frame(kind as u16, bytes);
    if let Ok(back) = registry::from_bytes(&framed) {
        let _ = back.decode();
    }
    framed.truncate(framed.len() / 2);
    registry::from_bytes(&framed).is_err()
}
