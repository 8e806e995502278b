//! The H200 measurements the model is calibrated on (`data/h200-rlc-csc.json`, extracted from
//! docs/bench: run 3's `rlc-csc/b1024/c64/w4` and cuBLAS rows over the 12 LLaMA shapes, run 2's
//! Fig. 5 stage variants on the LLaMA-2-7B shapes, run 6's empty-launch time).

use crate::cost::CostModel;
use crate::error::{Result, SimError};
use crate::gpu::GpuSpec;
use crate::kernel::{Features, KernelConfig, Stage};
use crate::sim::{simulate, Point};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

const DATA: &str = include_str!("../data/h200-rlc-csc.json");

/// m, k, sp, dp, then µs of full, no-recon, no-accum, loads-only.
type RawStages = (usize, usize, f64, f64, f64, f64, f64, f64);

#[derive(Deserialize)]
struct Raw {
    copy_gbs: f64,
    empty_launch_us: f64,
    cublas: Vec<(String, usize, usize, f64)>,
    rlc_csc: Vec<(usize, usize, f64, f64, f64)>,
    stages: Vec<RawStages>,
}

/// One measured kernel time.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Measured {
    pub point: Point,
    pub us: f64,
}

/// Fig. 5 stage variants of one point: full, without reconstruction, without accumulation,
/// loads only (µs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct MeasuredStages {
    pub point: Point,
    pub us: [f64; 4],
}

pub struct Measurements {
    pub copy_gbs: f64,
    pub empty_launch_us: f64,
    /// (model, m, k, µs) of cuBLAS GemmEx N = 1 on the dense matrix.
    pub cublas: Vec<(String, usize, usize, f64)>,
    pub rlc_csc: Vec<Measured>,
    pub stages: Vec<MeasuredStages>,
}

pub fn load() -> Result<Measurements> {
    let raw: Raw = serde_json::from_str(DATA).map_err(|e| SimError::Data(e.to_string()))?;
    let pt = |m, k, sp, dp| Point { m, k, sp, dp };
    Ok(Measurements {
        copy_gbs: raw.copy_gbs,
        empty_launch_us: raw.empty_launch_us,
        cublas: raw.cublas,
        rlc_csc: raw
            .rlc_csc
            .into_iter()
            .map(|(m, k, sp, dp, us)| Measured {
                point: pt(m, k, sp, dp),
                us,
            })
            .collect(),
        stages: raw
            .stages
            .into_iter()
            .map(|(m, k, sp, dp, a, b, c, d)| MeasuredStages {
                point: pt(m, k, sp, dp),
                us: [a, b, c, d],
            })
            .collect(),
    })
}

impl Measurements {
    /// cuBLAS time of an `m x k` product, if measured.
    pub fn cublas_us(&self, m: usize, k: usize) -> Option<f64> {
        self.cublas
            .iter()
            .find(|c| c.1 == m && c.2 == k)
            .map(|c| c.3)
    }
}

/// Model against measurement at one point.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CalibrationPoint {
    pub point: Point,
    pub measured_us: f64,
    pub model_us: f64,
    /// model / measured - 1.
    pub error: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub points: Vec<CalibrationPoint>,
    pub mean_abs_error: f64,
    pub max_abs_error: f64,
    /// Points within 20% of the measurement.
    pub within_20pct: usize,
    /// Fig. 5 stage shares: (point, measured [full, no-recon, no-accum, loads-only], model).
    pub stages: Vec<(Point, [f64; 4], [f64; 4])>,
}

impl Calibration {
    /// Fig. 5: each stage point's reconstruction share of the full kernel time, `(full -
    /// no-reconstruction) / full`, as (measured, model), in the order of [`Self::stages`].
    pub fn reconstruction_shares(&self) -> Vec<(f64, f64)> {
        self.stages
            .iter()
            .map(|(_, m, s)| ((m[0] - m[1]) / m[0], (s[0] - s[1]) / s[0]))
            .collect()
    }

    /// The mean of [`Self::reconstruction_shares`], (measured, model); (0, 0) without stage
    /// points.
    pub fn mean_reconstruction_share(&self) -> (f64, f64) {
        let shares = self.reconstruction_shares();
        let (measured, model) = shares
            .iter()
            .fold((0.0, 0.0), |(a, b), (m, s)| (a + m, b + s));
        let n = shares.len().max(1) as f64;
        (measured / n, model / n)
    }
}

/// Runs the measured configuration (decoder off, no register accumulation) at every measured
/// point accepted by `filter`, and the stage variants when `with_stages`.
pub fn calibrate(
    meas: &Measurements,
    cost: &CostModel,
    gpu: &GpuSpec,
    filter: &dyn Fn(&Point) -> bool,
    with_stages: bool,
    seed: u64,
) -> Result<Calibration> {
    let cfg = KernelConfig::measured();
    let chosen: Vec<&Measured> = meas.rlc_csc.iter().filter(|m| filter(&m.point)).collect();
    let points = chosen
        .par_iter()
        .map(|m| {
            let r = simulate(m.point, &cfg, &Features::baseline(), cost, gpu, seed)?;
            Ok(CalibrationPoint {
                point: m.point,
                measured_us: m.us,
                model_us: r.us,
                error: r.us / m.us - 1.0,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut stages = Vec::new();
    if with_stages {
        let chosen: Vec<&MeasuredStages> =
            meas.stages.iter().filter(|s| filter(&s.point)).collect();
        stages = chosen
            .par_iter()
            .map(|s| {
                let mut model = [0.0; 4];
                for (i, st) in Stage::ALL.into_iter().enumerate() {
                    let feat = Features {
                        stage: st,
                        ..Features::baseline()
                    };
                    model[i] = simulate(s.point, &cfg, &feat, cost, gpu, seed)?.us;
                }
                Ok((s.point, s.us, model))
            })
            .collect::<Result<Vec<_>>>()?;
    }
    let n = points.len().max(1) as f64;
    Ok(Calibration {
        mean_abs_error: points.iter().map(|p| p.error.abs()).sum::<f64>() / n,
        max_abs_error: points.iter().map(|p| p.error.abs()).fold(0.0, f64::max),
        within_20pct: points.iter().filter(|p| p.error.abs() <= 0.2).count(),
        points,
        stages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconstruction_shares_and_their_mean() {
        let p = Point {
            m: 64,
            k: 64,
            sp: 0.5,
            dp: 0.5,
        };
        let mut c = Calibration {
            points: Vec::new(),
            mean_abs_error: 0.0,
            max_abs_error: 0.0,
            within_20pct: 0,
            stages: vec![
                (p, [10.0, 6.0, 5.0, 4.0], [8.0, 6.0, 5.0, 4.0]),
                (p, [10.0, 8.0, 5.0, 4.0], [8.0, 2.0, 5.0, 4.0]),
            ],
        };
        assert_eq!(c.reconstruction_shares(), vec![(0.4, 0.25), (0.2, 0.75)]);
        let (measured, model) = c.mean_reconstruction_share();
        assert!((measured - 0.3).abs() < 1e-12 && (model - 0.5).abs() < 1e-12);
        c.stages.clear();
        assert_eq!(c.mean_reconstruction_share(), (0.0, 0.0));
    }
}
