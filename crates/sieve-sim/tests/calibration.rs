//! The calibration error against the measured H200 kernel, printed (`cargo test -p sieve-sim
//! --test calibration -- --nocapture`). The LLaMA-2-7B shapes only (48 points), to keep the test
//! short; `sieve sim celty --calibrate --shapes llama2-7b,llama2-13b,llama3-8b,llama2-70b` runs
//! all 192.

use sieve_sim::measured::{calibrate, load};
use sieve_sim::{CostModel, GpuSpec};

#[test]
fn calibration_error_on_llama2_7b() {
    let meas = load().unwrap();
    assert_eq!(meas.rlc_csc.len(), 192);
    assert_eq!(meas.stages.len(), 48);
    let sevenb = [(4096, 4096), (11008, 4096), (4096, 11008)];
    let c = calibrate(
        &meas,
        &CostModel::h200(),
        &GpuSpec::h200(),
        &|p| sevenb.contains(&(p.m, p.k)),
        false,
        1,
    )
    .unwrap();
    assert_eq!(c.points.len(), 48);
    println!(
        "calibration error, LLaMA-2-7B shapes: mean |error| {:.1}%, max {:.1}%, {}/{} within 20%",
        100.0 * c.mean_abs_error,
        100.0 * c.max_abs_error,
        c.within_20pct,
        c.points.len()
    );
    assert!(
        c.mean_abs_error < 0.20,
        "mean error {:.3}",
        c.mean_abs_error
    );
}
