//! The sweep behind `sieve sim celty`: every requested (shape, weight sparsity, activation
//! sparsity) point simulated under one kernel configuration, beside its measurement and the
//! dense baseline, plus the optional calibration and comparison with the paper. The CLI only
//! parses its flags into [`SweepOptions`] and prints what [`run_sweep`] returns, so the same
//! sweep can be driven from tests or other tools without the command line.

use crate::area::{overhead_percent, DecoderDesign, GENERATIONS};
use crate::error::{Result, SimError};
use crate::measured::{self, Calibration};
use crate::paper::{self, Comparison};
use crate::{simulate, CostModel, Features, GpuSpec, KernelConfig, Point, SimResult, Stage};
use serde::Serialize;

/// What to sweep and what to compute beside the points.
#[derive(Clone, Debug)]
pub struct SweepOptions {
    /// The (M, K) products, already parsed (see [`crate::shapes`]).
    pub shapes: Vec<(usize, usize)>,
    /// Weight sparsities, each in [0, 1).
    pub weight_sparsities: Vec<f64>,
    /// Activation sparsities, each in [0, 1).
    pub activation_sparsities: Vec<f64>,
    /// Fraction of each sub-partition's output rows accumulated in its register file, in [0, 1].
    pub reg_fraction: f64,
    /// The hardware RLC decoder on or off.
    pub decoder: bool,
    /// Thread mapping and tile of the simulated kernel.
    pub config: KernelConfig,
    /// Also run the calibration against the measured H200 points of these shapes.
    pub calibrate: bool,
    /// Also compute the comparison with the paper's figures over these shapes.
    pub compare_with_paper: bool,
    pub seed: u64,
}

/// One simulated point beside its measurement (when the configuration is the measured one) and
/// the dense cuBLAS baseline.
#[derive(Clone, Debug, Serialize)]
pub struct SweepPoint {
    pub result: SimResult,
    pub measured_us: Option<f64>,
    pub cublas_us: f64,
    /// False when `cublas_us` is an estimate (shape not measured).
    pub cublas_measured: bool,
}

/// Everything a sweep computed; serialises to the `--json` report (field order is the report's).
#[derive(Clone, Debug, Serialize)]
pub struct Sweep {
    pub gpu: GpuSpec,
    pub cost: CostModel,
    pub results: Vec<SweepPoint>,
    pub calibration: Option<Calibration>,
    pub comparison: Option<Comparison>,
    /// Table 1: the decoder's area overhead, per GPU generation ("name chip", percent).
    pub area: Vec<(String, f64)>,
}

impl SweepOptions {
    /// The hardware features these options describe.
    pub fn features(&self) -> Features {
        Features {
            decoder: self.decoder,
            reg_fraction: self.reg_fraction,
            stage: Stage::Full,
        }
    }

    /// Refuses sparsities and register fractions outside their ranges, before any work.
    pub fn validate(&self) -> Result<()> {
        for v in self
            .weight_sparsities
            .iter()
            .chain(&self.activation_sparsities)
        {
            if !(0.0..1.0).contains(v) {
                return Err(SimError::Option(format!("sparsity {v} outside [0, 1)")));
            }
        }
        if !(0.0..=1.0).contains(&self.reg_fraction) {
            return Err(SimError::Option(format!(
                "--reg-fraction {} outside [0, 1]",
                self.reg_fraction
            )));
        }
        Ok(())
    }
}

/// Runs the sweep. `on_point` sees each point as soon as it is simulated, so a caller can
/// stream results while the rest (and the slower calibration and comparison) still run.
pub fn run_sweep(options: &SweepOptions, on_point: &mut dyn FnMut(&SweepPoint)) -> Result<Sweep> {
    options.validate()?;
    let gpu = GpuSpec::h200();
    let cost = CostModel::h200();
    let measurements = measured::load()?;
    let features = options.features();
    // Only the configuration the H200 kernel actually ran has measurements to stand beside.
    let is_measured_config =
        options.config == KernelConfig::measured() && features == Features::baseline();

    // Every shape's grid is checked before anything is simulated or allocated.
    for &(m, k) in &options.shapes {
        crate::sim::check_grid(&options.config, m, k)?;
    }
    let mut results = Vec::new();
    for &(m, k) in &options.shapes {
        for &sp in &options.weight_sparsities {
            for &dp in &options.activation_sparsities {
                let point = Point { m, k, sp, dp };
                let result = simulate(point, &options.config, &features, &cost, &gpu, options.seed)
                    .map_err(|source| SimError::AtPoint {
                        point: format!("{m}x{k} sp {sp} dp {dp}"),
                        source: Box::new(source),
                    })?;
                let measured_us = if is_measured_config {
                    measurements
                        .rlc_csc
                        .iter()
                        .find(|x| x.point == point)
                        .map(|x| x.us)
                } else {
                    None
                };
                let (cublas_us, cublas_measured) =
                    paper::cublas_us(&measurements, &cost, &gpu, m, k);
                let swept = SweepPoint {
                    result,
                    measured_us,
                    cublas_us,
                    cublas_measured,
                };
                on_point(&swept);
                results.push(swept);
            }
        }
    }

    let calibration = if options.calibrate {
        let shapes = &options.shapes;
        Some(measured::calibrate(
            &measurements,
            &cost,
            &gpu,
            &|p: &Point| shapes.contains(&(p.m, p.k)),
            true,
            options.seed,
        )?)
    } else {
        None
    };
    let comparison = if options.compare_with_paper {
        Some(paper::compare(
            &options.shapes,
            &measurements,
            &cost,
            &gpu,
            options.seed,
        )?)
    } else {
        None
    };
    let area = GENERATIONS
        .iter()
        .map(|g| {
            (
                format!("{} {}", g.name, g.chip),
                overhead_percent(g, &DecoderDesign::celty()),
            )
        })
        .collect();
    Ok(Sweep {
        gpu,
        cost,
        results,
        calibration,
        comparison,
        area,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> SweepOptions {
        SweepOptions {
            shapes: vec![(64, 64)],
            weight_sparsities: vec![0.5],
            activation_sparsities: vec![0.5],
            reg_fraction: 0.0,
            decoder: false,
            config: KernelConfig::measured(),
            calibrate: false,
            compare_with_paper: false,
            seed: 1,
        }
    }

    #[test]
    fn out_of_range_options_are_refused_before_any_work() {
        let mut bad = options();
        bad.weight_sparsities = vec![1.0];
        assert!(run_sweep(&bad, &mut |_| {}).is_err());
        let mut bad = options();
        bad.reg_fraction = 1.5;
        assert!(run_sweep(&bad, &mut |_| {}).is_err());
    }

    #[test]
    fn every_point_is_streamed_and_returned() {
        let mut opts = options();
        opts.activation_sparsities = vec![0.3, 0.5];
        let mut streamed = 0;
        let sweep = run_sweep(&opts, &mut |_| streamed += 1).expect("sweep of a small shape");
        assert_eq!(streamed, 2);
        assert_eq!(sweep.results.len(), 2);
        assert!(sweep.calibration.is_none() && sweep.comparison.is_none());
    }
}
