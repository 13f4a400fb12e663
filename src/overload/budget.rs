//! Per-key budgets: requests inside inferlb at once, and tokens over a sliding window (kept in
//! ten slices, so a key regains its budget a slice at a time). Pure: the caller passes `now`.
//!
//! Not for admission by load (see `policy`) nor ordering (see `queue`).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::conf::overload::Budget;

const SLICES: usize = 10;
/// Where keys go when the table is full of keys with requests in flight.
const OVERFLOW: u64 = 0;

/// Why a key is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    Concurrency,
    TokensPerMinute,
}

#[derive(Debug)]
struct Use {
    concurrent: u32,
    /// Tokens charged in each slice; `slices[(epoch % SLICES)]` is the slice `epoch`.
    slices: [u64; SLICES],
    /// The newest slice charged.
    epoch: u64,
    /// When it was last used, its place in [`Budgets::idle`] while it has no request in flight.
    stamp: u64,
}

impl Use {
    fn new(stamp: u64) -> Use {
        Use {
            concurrent: 0,
            slices: [0; SLICES],
            epoch: 0,
            stamp,
        }
    }

    /// Forgets slices older than the window ending in slice `epoch`.
    fn advance(&mut self, epoch: u64) {
        if epoch <= self.epoch {
            return;
        }
        let gone = (epoch - self.epoch).min(SLICES as u64);
        for e in 0..gone {
            self.slices[((self.epoch + 1 + e) % SLICES as u64) as usize] = 0;
        }
        self.epoch = epoch;
    }

    fn used(&self) -> u64 {
        self.slices.iter().sum()
    }

    fn idle(&self) -> bool {
        self.concurrent == 0 && self.used() == 0
    }
}

/// What the other instances of a cluster use of a key's budget, as last read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Remote {
    pub tokens: u64,
    pub concurrent: u32,
}

/// Every key's use, for at most `max_keys` keys: clients choose keys when no key list is set,
/// so the least recently used key without a request in flight makes room for a new one.
#[derive(Debug)]
pub struct Budgets {
    window: Duration,
    origin: Instant,
    max_keys: usize,
    keys: HashMap<u64, Use>,
    /// The keys without a request in flight, least recently used first: stamp → key.
    idle: BTreeMap<u64, u64>,
    /// Where keys are counted together while the table is full of keys in flight.
    overflow: Use,
    next_stamp: u64,
    /// Tokens charged since the last [`Budgets::take_pending`], by key (for sharing); only
    /// keys in `keys`, so bounded with them.
    pending: HashMap<u64, i64>,
    /// The other instances' use, by key.
    remote: HashMap<u64, Remote>,
}

impl Budgets {
    pub fn new(window: Duration, origin: Instant, max_keys: usize) -> Budgets {
        Budgets {
            window,
            origin,
            max_keys: max_keys.max(1),
            keys: HashMap::new(),
            idle: BTreeMap::new(),
            overflow: Use::new(0),
            next_stamp: 0,
            pending: HashMap::new(),
            remote: HashMap::new(),
        }
    }

    fn slice(&self) -> Duration {
        self.window / SLICES as u32
    }

    fn epoch(&self, now: Instant) -> u64 {
        let nanos = self.slice().as_nanos().max(1);
        (now.saturating_duration_since(self.origin).as_nanos() / nanos) as u64
    }

    /// The entry `key` is counted under, marked as just used: its own (made when new, room
    /// made first when the table is full by forgetting the least recently used key without a
    /// request in flight), or the shared overflow entry when every key has one in flight.
    fn entry(&mut self, key: u64, now: Instant) -> (u64, &mut Use) {
        let epoch = self.epoch(now);
        if !self.keys.contains_key(&key) && self.keys.len() >= self.max_keys {
            if let Some((_, old)) = self.idle.pop_first() {
                self.keys.remove(&old);
                // Its tokens not yet shared go with it: a bound, not a ledger.
                self.pending.remove(&old);
            }
        }
        if !self.keys.contains_key(&key) && self.keys.len() >= self.max_keys {
            self.overflow.advance(epoch);
            return (OVERFLOW, &mut self.overflow);
        }
        // Stamps start at 1: the overflow entry's 0 is never in `idle`.
        self.next_stamp += 1;
        let stamp = self.next_stamp;
        let u = self.keys.entry(key).or_insert_with(|| Use::new(stamp));
        u.advance(epoch);
        if u.concurrent == 0 {
            self.idle.remove(&u.stamp);
            self.idle.insert(stamp, key);
        }
        u.stamp = stamp;
        (key, u)
    }

    /// Whether `key` may start a request of `tokens` (prompt, estimated) now; when not, why
    /// and how long until it may. A key whose window is empty may always start one: a prompt
    /// larger than the whole budget must not be refused forever.
    pub fn check(
        &mut self,
        key: u64,
        budget: Budget,
        tokens: u64,
        now: Instant,
    ) -> Result<(), (Over, Duration)> {
        let slice = self.slice();
        let into = now.saturating_duration_since(self.origin).as_nanos() % slice.as_nanos().max(1);
        let to_next_slice = slice.saturating_sub(Duration::from_nanos(into as u64));
        let window = self.window;
        let remote = self.remote.get(&key).copied().unwrap_or_default();
        let (_, u) = self.entry(key, now);
        let concurrent = u.concurrent.saturating_add(remote.concurrent);
        if budget.max_concurrent.is_some_and(|m| concurrent >= m) {
            return Err((Over::Concurrency, Duration::from_secs(1)));
        }
        let Some(per_minute) = budget.tokens_per_minute else {
            return Ok(());
        };
        let limit = (per_minute as u128 * window.as_millis() / 60_000) as u64;
        // The other instances' part leaves their windows as it may: only ours is timed.
        let used = u.used() + remote.tokens;
        if used == 0 || used + tokens <= limit.max(1) {
            return Ok(());
        }
        // The oldest slices leave first: wait until enough of them have.
        let mut freed = 0;
        for age in (0..SLICES as u64).rev() {
            let e = u.epoch.saturating_sub(age);
            if age > u.epoch {
                continue;
            }
            freed += u.slices[(e % SLICES as u64) as usize];
            if used - freed + tokens <= limit || freed == used {
                // Slice `e` leaves the window when slice `e + SLICES` begins.
                let leaves = slice * ((SLICES as u64 - age) as u32 - 1);
                let wait = to_next_slice + leaves;
                return Err((Over::TokensPerMinute, wait));
            }
        }
        Err((Over::TokensPerMinute, window))
    }

    /// A request of `key` starts: counted as concurrent, its `tokens` charged.
    pub fn start(&mut self, key: u64, tokens: u64, now: Instant) {
        let (key, u) = self.entry(key, now);
        let newly = (u.concurrent == 0 && key != OVERFLOW).then_some(u.stamp);
        u.concurrent += 1;
        let at = (u.epoch % SLICES as u64) as usize;
        u.slices[at] = u.slices[at].saturating_add(tokens);
        if let Some(stamp) = newly {
            // In flight: never forgotten until it ends.
            self.idle.remove(&stamp);
        }
        *self.pending.entry(key).or_default() += tokens as i64;
    }

    /// Adds (or, for an overestimate, takes back) tokens of `key` now.
    pub fn charge(&mut self, key: u64, tokens: i64, now: Instant) {
        let (key, u) = self.entry(key, now);
        let at = (u.epoch % SLICES as u64) as usize;
        if tokens >= 0 {
            u.slices[at] = u.slices[at].saturating_add(tokens as u64);
        } else {
            u.slices[at] = u.slices[at].saturating_sub(tokens.unsigned_abs());
        }
        *self.pending.entry(key).or_default() += tokens;
    }

    /// A request of `key` ended.
    pub fn end(&mut self, key: u64) {
        let Some(u) = self.keys.get_mut(&key) else {
            self.overflow.concurrent = self.overflow.concurrent.saturating_sub(1);
            return;
        };
        let was = u.concurrent;
        u.concurrent = was.saturating_sub(1);
        if was == 1 {
            self.idle.insert(u.stamp, key);
        }
    }

    /// Tokens charged (or given back) by key since the last call.
    pub fn take_pending(&mut self) -> Vec<(u64, i64)> {
        self.pending.drain().filter(|(_, t)| *t != 0).collect()
    }

    /// Each key in use (requests here now, or tokens in its window) and its requests here.
    pub fn concurrency(&self) -> Vec<(u64, u32)> {
        let all = self.keys.iter().chain([(&OVERFLOW, &self.overflow)]);
        let busy = all.filter(|(_, u)| !u.idle());
        busy.map(|(k, u)| (*k, u.concurrent)).collect()
    }

    /// What the other instances use now; keys absent use nothing elsewhere.
    pub fn set_remote(&mut self, remote: HashMap<u64, Remote>) {
        self.remote = remote;
    }

    /// Keys tracked now.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TPM: Budget = Budget {
        max_concurrent: None,
        tokens_per_minute: Some(60_000),
    };

    #[test]
    fn concurrency_counts_requests_until_they_end() {
        let t0 = Instant::now();
        let mut b = Budgets::new(Duration::from_secs(60), t0, 100);
        let two = Budget {
            max_concurrent: Some(2),
            tokens_per_minute: None,
        };
        for _ in 0..2 {
            assert_eq!(b.check(1, two, 10, t0), Ok(()));
            b.start(1, 10, t0);
        }
        assert_eq!(
            b.check(1, two, 10, t0).map_err(|e| e.0),
            Err(Over::Concurrency)
        );
        assert_eq!(b.check(2, two, 10, t0), Ok(()), "another key is unaffected");
        b.end(1);
        assert_eq!(b.check(1, two, 10, t0), Ok(()));
    }

    #[test]
    fn a_token_window_refuses_then_recovers_as_slices_leave() {
        let t0 = Instant::now();
        // 60k tokens a minute over a 2 s window: 2000 tokens a window, 200 ms slices.
        let mut b = Budgets::new(Duration::from_secs(2), t0, 100);
        b.start(1, 1500, t0);
        b.end(1);
        let (why, wait) = b.check(1, TPM, 800, t0).expect_err("over");
        assert_eq!(why, Over::TokensPerMinute);
        assert!(
            wait <= Duration::from_secs(2) && wait > Duration::from_millis(1500),
            "{wait:?}"
        );
        assert_eq!(b.check(1, TPM, 400, t0), Ok(()), "what fits passes");
        assert_eq!(
            b.check(2, TPM, 800, t0),
            Ok(()),
            "another key is unaffected"
        );
        assert!(b
            .check(1, TPM, 800, t0 + wait - Duration::from_millis(1))
            .is_err());
        assert_eq!(b.check(1, TPM, 800, t0 + wait), Ok(()), "recovered");
    }

    #[test]
    fn completion_tokens_count_and_an_overestimate_is_taken_back() {
        let t0 = Instant::now();
        let mut b = Budgets::new(Duration::from_secs(60), t0, 100);
        b.start(1, 50_000, t0);
        b.charge(1, 9_000, t0);
        assert!(b.check(1, TPM, 2_000, t0).is_err());
        b.charge(1, -10_000, t0);
        assert_eq!(b.check(1, TPM, 2_000, t0), Ok(()));
    }

    #[test]
    fn a_prompt_larger_than_the_budget_passes_into_an_empty_window_only() {
        let t0 = Instant::now();
        let mut b = Budgets::new(Duration::from_secs(60), t0, 100);
        assert_eq!(b.check(1, TPM, 100_000, t0), Ok(()));
        b.start(1, 100_000, t0);
        let (_, wait) = b.check(1, TPM, 100_000, t0).expect_err("over");
        assert!(wait <= Duration::from_secs(60), "{wait:?}");
        let later = t0 + Duration::from_secs(61);
        assert_eq!(b.check(1, TPM, 100_000, later), Ok(()));
    }

    #[test]
    fn other_instances_use_counts_against_the_same_budget() {
        let t0 = Instant::now();
        let mut b = Budgets::new(Duration::from_secs(60), t0, 100);
        let both = Budget {
            max_concurrent: Some(2),
            tokens_per_minute: Some(60_000),
        };
        b.start(1, 100, t0);
        b.charge(1, -40, t0);
        assert_eq!(b.take_pending(), vec![(1, 60)]);
        assert!(b.take_pending().is_empty(), "taken");
        let remote = Remote {
            tokens: 59_000,
            concurrent: 1,
        };
        b.set_remote(HashMap::from([(1, remote)]));
        assert_eq!(
            b.check(1, both, 10, t0).map_err(|e| e.0),
            Err(Over::Concurrency)
        );
        b.end(1);
        assert_eq!(
            b.check(1, both, 5_000, t0).map_err(|e| e.0),
            Err(Over::TokensPerMinute)
        );
        assert_eq!(b.check(1, both, 500, t0), Ok(()));
        b.set_remote(HashMap::new());
        assert_eq!(
            b.check(1, both, 5_000, t0),
            Ok(()),
            "gone: local counts only"
        );
    }

    #[test]
    fn the_table_keeps_at_most_max_keys_forgetting_the_least_recently_used_never_one_in_flight() {
        const MAX: usize = 100_000;
        let t0 = Instant::now();
        let mut b = Budgets::new(Duration::from_secs(1), t0, MAX);
        let busy = u64::MAX;
        b.start(busy, 1, t0);
        for k in 1..=MAX as u64 {
            b.start(k, 1, t0);
            b.end(k);
            // Key 1 stays the most recently used but one.
            b.charge(1, 1, t0);
        }
        assert_eq!((b.len(), b.pending.len()), (MAX, MAX));
        let mut in_flight = b.concurrency();
        in_flight.retain(|(_, n)| *n > 0);
        assert_eq!(in_flight, vec![(busy, 1)]);
        let later = t0 + Duration::from_secs(5);
        for k in MAX as u64 + 1..=MAX as u64 + 10 {
            b.start(k, 1, later);
            b.end(k);
            assert!(b.len() <= MAX && b.pending.len() <= MAX);
        }
        assert!(b.keys.contains_key(&busy), "in flight: kept");
        assert!(b.keys.contains_key(&1), "recently used: kept");
        assert!(
            !b.keys.contains_key(&2),
            "the least recently used: forgotten"
        );
        assert!(!b.pending.contains_key(&2));
        b.end(busy);
        assert_eq!(b.keys[&busy].concurrent, 0);
    }

    #[test]
    fn a_table_full_of_keys_in_flight_counts_new_keys_together() {
        let t0 = Instant::now();
        let mut b = Budgets::new(Duration::from_secs(60), t0, 3);
        for k in 1..=3 {
            b.start(k, 1, t0);
        }
        b.start(9, 5, t0);
        assert_eq!(b.len(), 3, "no room: counted under the overflow entry");
        assert_eq!(b.overflow.concurrent, 1);
        b.end(9);
        assert_eq!(b.overflow.concurrent, 0);
        b.end(1);
        b.start(10, 1, t0);
        assert!(b.keys.contains_key(&10) && !b.keys.contains_key(&1));
        assert_eq!(b.len(), 3);
        for k in 2..=3 {
            assert_eq!(b.keys[&k].concurrent, 1, "key {k} kept");
        }
    }
}
