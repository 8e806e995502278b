//! LLaMA layer shapes (the sets `sieve bench kernels` measures) and `MxK` parsing.

use crate::error::{Result, SimError};

/// The (M, K) products of a named set, or one `MxK` shape.
pub fn shapes_of(name: &str) -> Result<Vec<(usize, usize)>> {
    Ok(match name {
        "llama2-7b" => vec![(4096, 4096), (11008, 4096), (4096, 11008)],
        "llama2-13b" => vec![(5120, 5120), (13824, 5120), (5120, 13824)],
        "llama3-8b" => vec![(1024, 4096), (14336, 4096), (4096, 14336)],
        "llama2-70b" => vec![(8192, 8192), (28672, 8192), (8192, 28672)],
        other => vec![parse_shape(other)?],
    })
}

/// Parses `MxK` (both positive).
pub fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let bad = || {
        SimError::Option(format!(
            "shape '{s}': expected MxK such as 4096x11008, or one of llama2-7b, llama2-13b, \
             llama3-8b, llama2-70b"
        ))
    };
    let (m, k) = s.trim().split_once('x').ok_or_else(bad)?;
    let m: usize = m.parse().map_err(|_| bad())?;
    let k: usize = k.parse().map_err(|_| bad())?;
    if m == 0 || k == 0 {
        return Err(SimError::Option(format!(
            "shape '{s}' has a zero dimension"
        )));
    }
    Ok((m, k))
}

/// All twelve measured shapes.
pub const ALL_SETS: [&str; 4] = ["llama2-7b", "llama2-13b", "llama3-8b", "llama2-70b"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_and_custom_shapes() {
        assert_eq!(shapes_of("llama2-7b").unwrap().len(), 3);
        assert_eq!(shapes_of("64x128").unwrap(), vec![(64, 128)]);
        assert!(shapes_of("0x5").is_err());
        assert!(shapes_of("llama9").is_err());
        assert!(parse_shape("12x").is_err());
    }
}
