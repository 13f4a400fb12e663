//! The bottom layer: what inferlb reports about itself. Imports nothing from the crate.

pub mod access;
pub mod metrics;
