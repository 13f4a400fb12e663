//! The exchanges this process holds: bounded by count and bytes (least recently used go
//! first), by age (the TTL, from the last use: a live chain keeps its early turns), and per
//! client key (its own least recently used go first), so one tenant cannot fill the store; the
//! shared scope of a fleet without client keys ([`SHARED`]) has no quota of its own. Pure: the
//! caller gives the time.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use lru::LruCache;

use crate::protocol::conversation::Exchange;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub max_items: usize,
    pub max_bytes: usize,
    pub ttl_seconds: u64,
    pub key_max_items: usize,
    pub key_max_bytes: usize,
}

/// The scope of every request when the fleet has no client keys: one tenant, no quota.
pub const SHARED: u64 = 0;

/// One exchange held, and whether this process made it (it is written to Redis again when
/// Redis comes back empty).
#[derive(Debug, Clone)]
pub struct Held {
    pub exchange: Arc<Exchange>,
    pub made_here: bool,
    size: usize,
    /// When it was last used (seconds), and the use's place in its scope's order.
    used_at: u64,
    use_seq: u64,
}

#[derive(Debug, Default)]
struct Quota {
    items: usize,
    bytes: usize,
    /// Its uses, least recent first, as (key, use); a use that is not its key's last is stale.
    order: VecDeque<(u64, u64)>,
}

pub struct Memory {
    bounds: Bounds,
    entries: LruCache<u64, Held>,
    bytes: usize,
    scopes: HashMap<u64, Quota>,
    uses: u64,
}

impl Memory {
    pub fn new(bounds: Bounds) -> Memory {
        Memory {
            bounds,
            entries: LruCache::unbounded(),
            bytes: 0,
            scopes: HashMap::new(),
            uses: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn expired(&self, used_at: u64, now: u64) -> bool {
        now.saturating_sub(used_at) >= self.bounds.ttl_seconds
    }

    /// The exchange under `key`, if held and not expired; it becomes the most recently used,
    /// here and in its scope, and its TTL starts again.
    pub fn get(&mut self, key: u64, now: u64) -> Option<Arc<Exchange>> {
        let used_at = self.entries.peek(&key)?.used_at;
        if self.expired(used_at, now) {
            self.remove(key);
            return None;
        }
        self.uses += 1;
        let seq = self.uses;
        let held = self.entries.get_mut(&key)?;
        held.used_at = now.max(held.used_at);
        held.use_seq = seq;
        let (scope, e) = (held.exchange.scope, held.exchange.clone());
        if let Some(q) = self.scopes.get_mut(&scope) {
            q.order.push_back((key, seq));
        }
        self.compact(scope);
        Some(e)
    }

    /// The exchange under `key`, if held and not expired, its recency unchanged.
    pub fn peek(&self, key: u64, now: u64) -> Option<Arc<Exchange>> {
        let held = self.entries.peek(&key)?;
        (!self.expired(held.used_at, now)).then(|| held.exchange.clone())
    }

    /// Holds `exchange` under `key` (replacing what it held), then evicts past the bounds:
    /// expired first, then the key's own oldest past its quota, then the least recently used.
    /// An exchange larger than its key's quota is not held at all.
    /// `used_at`: when its TTL starts (it was made, or read from Redis).
    pub fn insert(
        &mut self,
        key: u64,
        exchange: Arc<Exchange>,
        made_here: bool,
        used_at: u64,
        now: u64,
    ) {
        self.remove(key);
        let size = exchange.size();
        let too_big = size > self.bounds.max_bytes
            || (exchange.scope != SHARED && size > self.bounds.key_max_bytes);
        if too_big || self.expired(used_at, now) {
            return;
        }
        let scope = exchange.scope;
        self.uses += 1;
        let seq = self.uses;
        let q = self.scopes.entry(scope).or_default();
        q.items += 1;
        q.bytes += size;
        q.order.push_back((key, seq));
        self.bytes += size;
        self.entries.put(
            key,
            Held {
                exchange,
                made_here,
                size,
                used_at,
                use_seq: seq,
            },
        );
        self.evict(scope, now);
    }

    pub fn remove(&mut self, key: u64) -> Option<Held> {
        let held = self.entries.pop(&key)?;
        self.bytes -= held.size;
        let scope = held.exchange.scope;
        if let Some(q) = self.scopes.get_mut(&scope) {
            q.items -= 1;
            q.bytes -= held.size;
            if q.items == 0 {
                self.scopes.remove(&scope);
            }
        }
        Some(held)
    }

    fn evict(&mut self, scope: u64, now: u64) {
        // The least recently used of the whole store may have expired.
        while let Some((&k, held)) = self.entries.peek_lru() {
            if !self.expired(held.used_at, now) {
                break;
            }
            self.remove(k);
        }
        // The shared scope of a fleet without client keys has no quota of its own.
        while let Some(q) = self.scopes.get_mut(&scope).filter(|_| scope != SHARED) {
            if q.items <= self.bounds.key_max_items && q.bytes <= self.bounds.key_max_bytes {
                break;
            }
            let Some((k, seq)) = q.order.pop_front() else {
                break;
            };
            // Only its key's last use is its place in the order.
            if self.entries.peek(&k).is_some_and(|h| h.use_seq == seq) {
                self.remove(k);
            }
        }
        self.compact(scope);
        while self.entries.len() > self.bounds.max_items || self.bytes > self.bounds.max_bytes {
            let Some((&k, _)) = self.entries.peek_lru() else {
                break;
            };
            self.remove(k);
        }
    }

    /// Drops a scope's stale uses once they outnumber its live ones.
    fn compact(&mut self, scope: u64) {
        if let Some(q) = self.scopes.get_mut(&scope) {
            if q.order.len() > 2 * q.items + 16 {
                let entries = &self.entries;
                q.order
                    .retain(|(k, seq)| entries.peek(k).is_some_and(|h| h.use_seq == *seq));
            }
        }
    }

    /// Every exchange this process made, as held now, with its key: what is written to Redis
    /// again after it came back.
    pub fn made_here(&self, now: u64) -> Vec<(u64, Arc<Exchange>)> {
        self.entries
            .iter()
            .filter(|(_, h)| h.made_here && !self.expired(h.used_at, now))
            .map(|(k, h)| (*k, h.exchange.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::value::RawValue;

    fn exchange(id: &str, scope: u64, text: usize, stored_at: u64) -> Arc<Exchange> {
        let input = format!("[{{\"content\":\"{}\"}}]", "x".repeat(text));
        Arc::new(Exchange {
            id: id.into(),
            scope,
            ancestors: vec![],
            input: RawValue::from_string(input).expect("JSON"),
            response: RawValue::from_string("{}".into()).expect("JSON"),
            stored_at,
        })
    }

    fn bounds() -> Bounds {
        Bounds {
            max_items: 4,
            max_bytes: 1 << 20,
            ttl_seconds: 100,
            key_max_items: 3,
            key_max_bytes: 1 << 20,
        }
    }

    fn held(m: &mut Memory, keys: &[u64], now: u64) -> Vec<u64> {
        keys.iter()
            .copied()
            .filter(|k| m.get(*k, now).is_some())
            .collect()
    }

    #[test]
    fn the_least_recently_used_go_first_past_the_count() {
        let mut m = Memory::new(bounds());
        for k in 1..=4 {
            m.insert(k, exchange("r", k, 10, 0), true, 0, 0);
        }
        assert!(m.get(1, 1).is_some(), "1 is used again");
        m.insert(5, exchange("r", 5, 10, 0), true, 0, 1);
        assert_eq!(held(&mut m, &[1, 2, 3, 4, 5], 1), [1, 3, 4, 5]);
        assert_eq!(m.len(), 4);
    }

    #[test]
    fn bytes_are_bounded_and_counted_back_when_removed() {
        let one = exchange("r", 1, 1000, 0).size();
        let mut m = Memory::new(Bounds {
            max_bytes: 3 * one,
            ..bounds()
        });
        for k in 1..=4 {
            m.insert(k, exchange("r", k, 1000, 0), true, 0, 0);
        }
        assert_eq!(held(&mut m, &[1, 2, 3, 4], 0), [2, 3, 4]);
        assert_eq!(m.bytes(), 3 * one);
        m.remove(3);
        m.insert(2, exchange("r", 2, 1000, 0), true, 0, 0);
        assert_eq!(
            m.bytes(),
            2 * one,
            "a replaced exchange is not counted twice"
        );
    }

    #[test]
    fn an_exchange_expires_with_its_ttl() {
        let mut m = Memory::new(bounds());
        m.insert(1, exchange("r", 1, 1, 0), true, 0, 0);
        m.insert(2, exchange("r", 1, 1, 50), true, 50, 50);
        let peeked = |m: &Memory, now| {
            [1, 2]
                .into_iter()
                .filter(|k| m.peek(*k, now).is_some())
                .collect::<Vec<u64>>()
        };
        assert_eq!(peeked(&m, 99), [1, 2]);
        assert_eq!(peeked(&m, 100), [2]);
        assert!(m.get(1, 100).is_none(), "expired: removed");
        assert_eq!(peeked(&m, 150), Vec::<u64>::new());
        assert!(m.get(2, 150).is_none());
        assert!(m.is_empty() && m.bytes() == 0);
        m.insert(3, exchange("r", 1, 1, 0), true, 0, 200);
        assert!(m.get(3, 200).is_none(), "stored expired: not held");
    }

    #[test]
    fn one_key_past_its_quota_loses_its_own_oldest_not_anothers() {
        let mut m = Memory::new(Bounds {
            max_items: 10,
            ..bounds()
        });
        m.insert(100, exchange("other", 9, 1, 0), true, 0, 0);
        for k in 1..=3 {
            m.insert(k, exchange("r", 1, 1, 0), true, 0, 0);
        }
        assert!(
            m.get(1, 0).is_some(),
            "1 is used again: 2 is its key's least recent"
        );
        m.insert(4, exchange("r", 1, 1, 0), true, 0, 0);
        m.insert(5, exchange("r", 1, 1, 0), true, 0, 0);
        assert_eq!(held(&mut m, &[100, 1, 2, 3, 4, 5], 0), [100, 1, 4, 5]);
        let size = exchange("r", 1, 100, 0).size();
        let mut m = Memory::new(Bounds {
            key_max_bytes: 2 * size,
            ..bounds()
        });
        m.insert(100, exchange("other", 9, 100, 0), true, 0, 0);
        for k in 1..=3 {
            m.insert(k, exchange("r", 1, 100, 0), true, 0, 0);
        }
        assert_eq!(held(&mut m, &[100, 1, 2, 3], 0), [100, 2, 3]);
        m.insert(4, exchange("r", 1, 1000, 0), true, 0, 0);
        assert!(m.get(4, 0).is_none(), "larger than the quota: never held");
    }

    #[test]
    fn a_use_restarts_the_ttl_and_the_shared_scope_has_no_quota() {
        let mut m = Memory::new(bounds());
        m.insert(1, exchange("r", 1, 1, 0), true, 0, 0);
        assert!(m.get(1, 90).is_some());
        assert!(m.get(1, 180).is_some(), "used at 90: lives to 190");
        assert!(m.peek(1, 280).is_none());
        let mut m = Memory::new(bounds());
        for k in 1..=4 {
            m.insert(k, exchange("r", SHARED, 1, 0), true, 0, 0);
        }
        assert_eq!(m.len(), 4, "only the store's bound (4) applies");
    }

    #[test]
    fn only_what_was_made_here_is_written_again() {
        let mut m = Memory::new(bounds());
        m.insert(1, exchange("a", 1, 1, 0), true, 0, 0);
        m.insert(2, exchange("b", 1, 1, 0), false, 0, 0);
        let mine: Vec<u64> = m.made_here(1).into_iter().map(|(k, _)| k).collect();
        assert_eq!(mine, [1]);
    }
}
