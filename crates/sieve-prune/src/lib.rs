//! Pruning, activation thresholds, calibration and packing.
