//! What a replica's answers teach of its tokenizer: bytes per token, a mean per replica and
//! per API family (whose templates differ), learnt by the cache model from each answer's usage.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::protocol::api::Family;

/// A prompt shorter than this (in bytes, or its replica's tokens) teaches no ratio of bytes to
/// tokens: the template's own tokens would weigh too much in it.
pub(super) const MIN_RATIO_BYTES: u64 = 2048;
pub(super) const MIN_RATIO_TOKENS: u64 = 64;
/// Bytes per token (in thousandths) a sample may show: outside, the body did not hold the
/// whole prompt (a reference to a stored response) or was not text.
pub(super) const RATIO_MILLI: std::ops::RangeInclusive<u64> = 1000..=8000;
/// A mean of bytes per token (in thousandths) over about the last 8 samples.
#[derive(Default)]
pub(super) struct Ratio {
    milli: AtomicU64,
    samples: AtomicU64,
}

impl Ratio {
    /// Takes one more sample (within [`RATIO_MILLI`]) in: the new mean. Two answers at once may
    /// lose one's sample, never average with a mean not yet written (0).
    pub(super) fn learn(&self, sample: u64) -> u64 {
        let first = self.samples.fetch_add(1, Ordering::Relaxed) == 0;
        let next = match self.milli.load(Ordering::Relaxed) {
            0 => sample,
            _ if first => sample,
            mean => mean.saturating_mul(7).saturating_add(sample) / 8,
        }
        .clamp(*RATIO_MILLI.start(), *RATIO_MILLI.end());
        self.milli.store(next, Ordering::Relaxed);
        next
    }

    /// The mean, once a sample came.
    pub(super) fn get(&self) -> Option<u64> {
        (self.samples.load(Ordering::Relaxed) > 0).then(|| self.milli.load(Ordering::Relaxed))
    }
}

/// Each API family's place in [`CacheModel`]'s ratios.
pub(super) fn slot(family: Family) -> usize {
    match family {
        Family::Chat => 0,
        Family::Completions => 1,
        Family::Responses => 2,
        Family::Messages => 3,
    }
}
