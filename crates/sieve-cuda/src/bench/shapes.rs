//! The layer shapes the kernel benchmark measures: named LLaMA shape sets and `MxK`.

use crate::error::{CudaError, Result};

/// One matrix shape (M outputs x K inputs) and the shape set it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    /// The shape set's name (`llama2-7b`, ...), or `custom` for an `MxK` shape.
    pub model: String,
    pub m: usize,
    pub k: usize,
}

/// The projection sizes of a named model that the shape sets are made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelDims {
    pub name: &'static str,
    /// Hidden size: the rows of q and o, the columns of q, k, v, gate and up.
    pub hidden: usize,
    /// Rows of k and of v (the hidden size, or fewer heads for grouped-query attention).
    pub kv_rows: usize,
    /// Rows of gate and of up, columns of down.
    pub intermediate: usize,
}

/// Every named model.
pub const MODELS: [ModelDims; 4] = [
    ModelDims {
        name: "llama2-7b",
        hidden: 4096,
        kv_rows: 4096,
        intermediate: 11008,
    },
    ModelDims {
        name: "llama2-13b",
        hidden: 5120,
        kv_rows: 5120,
        intermediate: 13824,
    },
    ModelDims {
        name: "llama3-8b",
        hidden: 4096,
        kv_rows: 1024,
        intermediate: 14336,
    },
    ModelDims {
        name: "llama2-70b",
        hidden: 8192,
        kv_rows: 1024,
        intermediate: 28672,
    },
];

/// The named model `name`, if it is one.
pub fn model(name: &str) -> Option<ModelDims> {
    MODELS.iter().copied().find(|m| m.name == name)
}

impl ModelDims {
    /// The three shapes measured for this model: the attention projection (k/v for GQA models,
    /// whose q and o are the hidden square), the up projection and the down projection.
    pub fn shape_set(&self) -> Vec<Shape> {
        let s = |m, k| Shape {
            model: self.name.to_string(),
            m,
            k,
        };
        vec![
            s(self.kv_rows, self.hidden),
            s(self.intermediate, self.hidden),
            s(self.hidden, self.intermediate),
        ]
    }
}

/// The shapes of a named set (`llama2-7b`, `llama2-13b`, `llama3-8b`, `llama2-70b`) or one
/// `MxK` shape (both positive).
pub fn shapes_of(name: &str) -> Result<Vec<Shape>> {
    if let Some(m) = model(name) {
        return Ok(m.shape_set());
    }
    let bad = || {
        let names: Vec<&str> = MODELS.iter().map(|m| m.name).collect();
        CudaError::Option(format!(
            "unknown shape set '{name}': expected one of {} or MxK such as 4096x11008",
            names.join(", ")
        ))
    };
    let (m, k) = name.trim().split_once('x').ok_or_else(bad)?;
    let (m, k): (usize, usize) = (m.parse().map_err(|_| bad())?, k.parse().map_err(|_| bad())?);
    if m == 0 || k == 0 {
        return Err(CudaError::Option(format!(
            "shape {name} has a zero dimension"
        )));
    }
    Ok(vec![Shape {
        model: "custom".to_string(),
        m,
        k,
    }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_sets_and_custom_shapes() {
        let s = shapes_of("llama2-7b").unwrap();
        assert_eq!(
            s.iter().map(|s| (s.m, s.k)).collect::<Vec<_>>(),
            vec![(4096, 4096), (11008, 4096), (4096, 11008)]
        );
        let l3 = shapes_of("llama3-8b").unwrap();
        assert_eq!((l3[0].m, l3[0].k), (1024, 4096));
        assert_eq!((l3[2].m, l3[2].k), (4096, 14336));
        let c = shapes_of("300x70").unwrap();
        assert_eq!((c[0].m, c[0].k, c[0].model.as_str()), (300, 70, "custom"));
        assert!(shapes_of("nope").is_err());
        assert!(shapes_of("0x5").is_err());
        assert!(shapes_of("12x").is_err());
        assert!(shapes_of("x12").is_err());
    }

    /// The named sets are the twelve shapes of docs/BENCHMARKS.md (the same as sieve-sim's).
    #[test]
    fn twelve_shapes() {
        let all: Vec<Shape> = MODELS.iter().flat_map(|m| m.shape_set()).collect();
        assert_eq!(all.len(), 12);
        assert!(all.contains(&Shape {
            model: "llama2-70b".into(),
            m: 28672,
            k: 8192
        }));
    }
}
