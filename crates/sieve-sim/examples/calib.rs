//! Calibration explorer: prints model vs measured for every measured point, or fits the
//! calibrated constants by coordinate descent (`fit`).
//! `cargo run --release -p sieve-sim --example calib -- [7b] [stages] [fit] [knob=value ...]`
use sieve_sim::measured::{calibrate, load, Calibration};
use sieve_sim::{CostModel, GpuSpec};

const KNOBS: [&str; 8] = ["dram", "shfl", "atom", "conf", "col", "fixed", "l2", "regs"];

fn get(c: &CostModel, k: &str) -> f64 {
    match k {
        "dram" => c.dram_latency as f64,
        "shfl" => c.shfl_latency as f64,
        "atom" => c.atom_latency as f64,
        "conf" => c.atom_conflict_cycles as f64,
        "col" => c.column_chain as f64,
        "fixed" => c.fixed_us,
        "regs" => c.regs_per_thread as f64,
        "red" => c.red_cycles as f64,
        "l2" => c.l2_latency as f64,
        _ => panic!("unknown knob {k}"),
    }
}

fn set(c: &mut CostModel, k: &str, f: f64) {
    match k {
        "dram" => c.dram_latency = f.round() as u32,
        "shfl" => c.shfl_latency = f.round() as u32,
        "atom" => c.atom_latency = f.round() as u32,
        "conf" => c.atom_conflict_cycles = f.round() as u32,
        "col" => c.column_chain = f.round() as u32,
        "fixed" => c.fixed_us = (f * 100.0).round() / 100.0,
        "regs" => c.regs_per_thread = (f.round() as u32 / 8 * 8).max(16),
        "red" => c.red_cycles = f.round() as u32,
        "l2" => c.l2_latency = f.round() as u32,
        _ => panic!("unknown knob {k}"),
    }
}

fn objective(c: &Calibration) -> f64 {
    let mut sum: f64 = c.points.iter().map(|p| p.error.abs()).sum();
    let mut n = c.points.len() as f64;
    for (_, m, s) in &c.stages {
        for i in 1..4 {
            sum += 0.5 * (s[i] / m[i] - 1.0).abs();
            n += 0.5;
        }
    }
    sum / n
}

fn main() -> sieve_sim::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let meas = load()?;
    let gpu = GpuSpec::h200();
    let mut cost = CostModel::h200();
    for a in &args[1..] {
        if let Some((k, v)) = a.split_once('=') {
            set(&mut cost, k, v.parse().expect("number"));
        }
    }
    let stages = args.iter().any(|a| a == "stages");
    let only7b = args.iter().any(|a| a == "7b");
    let fit = args.iter().any(|a| a == "fit");
    let filter = |p: &sieve_sim::Point| !only7b || (p.m.max(p.k) <= 11008 && p.m.min(p.k) == 4096);
    let t = std::time::Instant::now();
    if fit {
        let mut best = objective(&calibrate(&meas, &cost, &gpu, &filter, stages, 1)?);
        eprintln!("start {:.2}%", 100.0 * best);
        let mut step = 1.3f64;
        for _round in 0..4 {
            for k in KNOBS {
                for dir in [step, 1.0 / step] {
                    let mut trial = cost.clone();
                    set(&mut trial, k, get(&cost, k) * dir);
                    if trial == cost {
                        continue;
                    }
                    let o = objective(&calibrate(&meas, &trial, &gpu, &filter, stages, 1)?);
                    if o < best {
                        best = o;
                        cost = trial;
                        eprintln!("{k} -> {:.2}: {:.2}%", get(&cost, k), 100.0 * best);
                        break;
                    }
                }
            }
            step = step.sqrt();
        }
        eprintln!("fit: {cost:?}");
    }
    let c = calibrate(&meas, &cost, &gpu, &filter, stages, 1)?;
    for p in &c.points {
        println!(
            "{:>5}x{:<5} sp {:.1} dp {:.1}  meas {:7.1}  model {:7.1}  err {:+5.1}%",
            p.point.m,
            p.point.k,
            p.point.sp,
            p.point.dp,
            p.measured_us,
            p.model_us,
            100.0 * p.error
        );
    }
    for (p, m, s) in &c.stages {
        println!(
            "stages {}x{} sp {:.1} dp {:.1}: meas {:.1} {:.1} {:.1} {:.1} | model {:.1} {:.1} {:.1} {:.1}",
            p.m, p.k, p.sp, p.dp, m[0], m[1], m[2], m[3], s[0], s[1], s[2], s[3]
        );
    }
    println!(
        "mean |err| {:.1}%  max {:.1}%  within 20%: {}/{}  objective {:.2}%  ({:.1} s)\n{cost:?}",
        100.0 * c.mean_abs_error,
        100.0 * c.max_abs_error,
        c.within_20pct,
        c.points.len(),
        100.0 * objective(&c),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
