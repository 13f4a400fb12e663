//! How far a replica's prefill has gone into what this process queued there: a fluid queue
//! with a learnt rate (the arithmetic alone; `load` keeps one per replica, locked with its
//! queue counts).

use std::time::Instant;

/// How far a replica's prefill has gone into the requests this process queued on it, as a
/// fluid queue: the uncached tokens of that queue it had done at the last arrival or first
/// byte, and its prefill rate since. Each event settles what was done then, at most the queue
/// as it stood, so time the replica spent with nothing of ours to prefill is not credited to
/// a request that arrives later; a first byte takes its request's tokens off what was done.
#[derive(Default)]
pub(super) struct Progress {
    pub(super) done: u64,
    pub(super) at: Option<Instant>,
    /// The replica's last prefill rates (uncached tokens a second), each from a request that
    /// found nothing of ours left to prefill there; the median is the rate, so one sample
    /// far off (a prompt the cache model took for uncached and the replica held) moves it
    /// little.
    rates: [f64; RATE_SAMPLES],
    samples: usize,
}

/// The prefill rates a replica's median is taken over.
pub(super) const RATE_SAMPLES: usize = 9;

/// A request's first byte also takes a decode step and the network: a prefill shorter than
/// this says more of those than of the rate.
const MIN_RATE_SAMPLE_TOKENS: u64 = 1024;

/// Less progress than this is not credited: over the few milliseconds a burst takes to
/// arrive, what the rate says is done tells more of when each request reached this process
/// than of the replica, and it is this process's alone. Instances of a cluster routing one
/// burst together split it by their ranks among equal queues; a credit of a few tokens made
/// the queues unequal, alike for all of them, and sent their requests to the same replica
/// (a 16-request burst over three instances split 9/7, not 8/8). About 34 ms of prefill at
/// 30,000 tokens a second.
pub(super) const MIN_CREDIT_TOKENS: u64 = 1024;

impl Progress {
    /// The rate: the median of the samples; 0 until one has come.
    pub(super) fn rate(&self) -> f64 {
        let n = self.samples.min(RATE_SAMPLES);
        let mut r = self.rates[..n].to_vec();
        r.sort_by(f64::total_cmp);
        r.get(n / 2).copied().unwrap_or(0.0)
    }

    /// Of `queued` tokens (the queue since the last event), how many are done at `now`.
    pub(super) fn done_by(&self, queued: u64, now: Instant) -> u64 {
        let elapsed = self
            .at
            .map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64());
        prefilled_meanwhile(self.rate(), elapsed, self.done, queued)
    }

    /// The queue changes at `now` from `queued` tokens: what was done is settled first.
    /// Gives whether nothing of the queue was left to prefill.
    pub(super) fn settle(&mut self, queued: u64, now: Instant) -> bool {
        self.done = self.done_by(queued, now);
        self.at = Some(now);
        self.done >= queued
    }

    /// A request that found nothing of ours left to prefill had its `tokens` done in `seconds`.
    pub(super) fn learn(&mut self, tokens: u64, seconds: f64) {
        if tokens < MIN_RATE_SAMPLE_TOKENS || seconds <= 0.0 {
            return;
        }
        self.rates[self.samples % RATE_SAMPLES] = tokens as f64 / seconds;
        self.samples = self.samples.wrapping_add(1);
    }
}

/// What is taken off a queue of which `done` tokens are done: nothing below
/// [`MIN_CREDIT_TOKENS`].
pub(super) fn credit(done: u64) -> u64 {
    if done < MIN_CREDIT_TOKENS {
        0
    } else {
        done
    }
}

/// Of `queued` uncached tokens, with `done` of them done at the last event, how many are
/// done after `elapsed` more seconds at `tokens_per_s`: at most the queue. The queue counts
/// each request whole until its first byte; without this a replica half way through a long
/// prefill looks as busy as when it began, and a continuation leaves its holder for a queue
/// that is nearly over.
fn prefilled_meanwhile(tokens_per_s: f64, elapsed: f64, done: u64, queued: u64) -> u64 {
    let more = if tokens_per_s > 0.0 && elapsed > 0.0 {
        (tokens_per_s * elapsed).min(u64::MAX as f64) as u64
    } else {
        0
    };
    done.saturating_add(more).min(queued)
}

#[cfg(test)]
mod tests {
    use super::{credit, prefilled_meanwhile, Progress, MIN_CREDIT_TOKENS, RATE_SAMPLES};

    #[test]
    fn a_queue_is_credited_the_work_done_since_its_last_event_at_most_the_queue() {
        // (tokens a second, seconds since the last event, done then, queued) → done now
        let rows: &[(f64, f64, u64, u64, u64)] = &[
            // the rate unknown: what was settled only
            (0.0, 1.0, 0, 40_000, 0),
            (0.0, 1.0, 5_000, 40_000, 5_000),
            // half a 40k prefill done
            (20_000.0, 1.0, 0, 40_000, 20_000),
            (20_000.0, 1.0, 10_000, 40_000, 30_000),
            // never more than the queue
            (20_000.0, 10.0, 0, 40_000, 40_000),
            // no time, or a rate that is not a number
            (20_000.0, 0.0, 0, 40_000, 0),
            (f64::NAN, 1.0, 0, 40_000, 0),
            (f64::INFINITY, 1.0, 0, 40_000, 40_000),
        ];
        for &(rate, seconds, done, queued, want) in rows {
            assert_eq!(
                prefilled_meanwhile(rate, seconds, done, queued),
                want,
                "{rate} t/s, {seconds} s, {done} done, {queued} queued"
            );
        }
    }

    #[test]
    fn progress_below_a_thousand_tokens_is_not_credited() {
        // done → taken off the queue
        let rows: &[(u64, u64)] = &[
            (0, 0),
            (30, 0),
            (MIN_CREDIT_TOKENS - 1, 0),
            (MIN_CREDIT_TOKENS, MIN_CREDIT_TOKENS),
            (30_000, 30_000),
        ];
        for &(done, want) in rows {
            assert_eq!(credit(done), want, "{done} done");
        }
    }

    #[test]
    fn the_rate_is_the_median_of_long_enough_prefills() {
        let mut p = Progress::default();
        // (tokens, seconds) → the rate after it
        let rows: &[(u64, f64, f64, &str)] = &[
            (512, 0.01, 0.0, "a short prefill says little of the rate"),
            (20_000, 1.0, 20_000.0, "the first sample"),
            (40_000, 0.0, 20_000.0, "no time: no sample"),
            (30_000, 1.0, 30_000.0, "the median of two: the upper"),
            (24_000, 1.0, 24_000.0, "of three"),
            (
                800_000,
                1.0,
                30_000.0,
                "one far off moves it to a neighbour, not to it",
            ),
        ];
        for &(tokens, seconds, want, why) in rows {
            p.learn(tokens, seconds);
            assert_eq!(p.rate(), want, "{why}");
        }
        for _ in 0..RATE_SAMPLES {
            p.learn(10_000, 1.0);
        }
        assert_eq!(p.rate(), 10_000.0, "the oldest samples go");
    }
}
