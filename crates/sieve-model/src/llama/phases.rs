//! Where the forward pass spends its time: wall time per phase, summed over calls, for
//! `sieve generate --profile`. Off by default; then each phase boundary costs one relaxed load.
//!
//! The phases follow the dependency chain of a Llama layer (every product waits for the one
//! before it), so their sum is the forward pass's wall time and each share says what a faster
//! kernel there would save.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A phase of the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Token embeddings, RoPE tables, buffers.
    Embed,
    /// The two RMS norms of each layer and the residual additions.
    NormsResiduals,
    /// q|k|v projections.
    Qkv,
    /// RoPE and writing the KV cache.
    RopeCache,
    /// Attention over the cache.
    Attention,
    /// o projection.
    OProj,
    /// gate|up projections.
    GateUp,
    /// `silu(gate) · up`.
    SiluMul,
    /// down projection.
    Down,
    /// Final norm and the LM head.
    Head,
}

impl Phase {
    /// The phase an op of the plan's layer is counted in.
    pub fn of(op: crate::plan::LayerOp) -> Phase {
        use crate::plan::{Group, LayerOp};
        match op {
            LayerOp::Norm(_) => Phase::NormsResiduals,
            LayerOp::Product(Group::Qkv) => Phase::Qkv,
            LayerOp::RopeKv => Phase::RopeCache,
            LayerOp::Attention => Phase::Attention,
            LayerOp::Product(Group::O) => Phase::OProj,
            LayerOp::Product(Group::GateUp) => Phase::GateUp,
            LayerOp::SwiGlu => Phase::SiluMul,
            LayerOp::Product(Group::Down) => Phase::Down,
        }
    }

    /// Every phase, in the order of a forward pass.
    pub const ALL: [Phase; 10] = [
        Phase::Embed,
        Phase::NormsResiduals,
        Phase::Qkv,
        Phase::RopeCache,
        Phase::Attention,
        Phase::OProj,
        Phase::GateUp,
        Phase::SiluMul,
        Phase::Down,
        Phase::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::NormsResiduals => "norms+residuals",
            Phase::Qkv => "q|k|v",
            Phase::RopeCache => "rope+cache",
            Phase::Attention => "attention",
            Phase::OProj => "o_proj",
            Phase::GateUp => "gate|up",
            Phase::SiluMul => "silu*up",
            Phase::Down => "down_proj",
            Phase::Head => "norm+lm_head",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Phase::ALL.len()] = [const { AtomicU64::new(0) }; Phase::ALL.len()];

/// Turns the timing on or off (process-wide).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Clears the sums (e.g. when decode starts, so that the prompt is not counted).
pub fn reset() {
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
}

/// Seconds summed per phase since the last [`reset`], in [`Phase::ALL`] order.
pub fn totals() -> Vec<(Phase, f64)> {
    Phase::ALL
        .iter()
        .zip(&NANOS)
        .map(|(&p, n)| (p, n.load(Ordering::Relaxed) as f64 * 1e-9))
        .collect()
}

/// Times consecutive phases of one forward pass: each [`Clock::lap`] charges the time since
/// the previous lap to a phase.
pub(crate) struct Clock(Option<Instant>);

impl Clock {
    pub(crate) fn start() -> Self {
        Clock(ENABLED.load(Ordering::Relaxed).then(Instant::now))
    }

    pub(crate) fn lap(&mut self, phase: Phase) {
        if let Some(last) = self.0 {
            let now = Instant::now();
            NANOS[phase as usize].fetch_add((now - last).as_nanos() as u64, Ordering::Relaxed);
            self.0 = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_are_charged_to_their_phase_only_when_enabled() {
        // The sums are process-wide and other tests run forward passes in parallel threads,
        // so this checks only what they cannot disturb: a clock started while timing is off
        // keeps no time, and a lap adds at least its own duration to its phase.
        let mut off = Clock::start();
        assert!(off.0.is_none());
        off.lap(Phase::Down);
        enable(true);
        let before = totals()[Phase::Down as usize].1;
        let mut on = Clock::start();
        enable(false);
        assert!(on.0.is_some());
        std::thread::sleep(std::time::Duration::from_millis(2));
        on.lap(Phase::Down);
        let after = totals()[Phase::Down as usize].1;
        assert!(after - before >= 0.002, "{before} -> {after}");
        assert_eq!(Phase::ALL.len(), NANOS.len());
        assert!(Phase::ALL.iter().enumerate().all(|(i, &p)| p as usize == i));
    }
}
