//! Choosing without a warm replica: the least busy, round-robin, and rendezvous hashing.

use super::Candidate;

/// The available replica with the fewest requests in flight; ties go round by `tick`, so a
/// burst that arrives at once alternates instead of piling onto the first id.
pub fn least_busy<'c, 'a>(available: &[&'c Candidate<'a>], tick: u64) -> &'c Candidate<'a> {
    let least = available.iter().map(|c| c.in_flight).min().unwrap_or(0);
    let tied: Vec<&&Candidate<'a>> = available.iter().filter(|c| c.in_flight == least).collect();
    tied[(tick % tied.len() as u64) as usize]
}

/// A plain counter over the available replicas.
pub fn round_robin<'c, 'a>(available: &[&'c Candidate<'a>], tick: u64) -> &'c Candidate<'a> {
    available[(tick % available.len() as u64) as usize]
}

/// Rendezvous hashing: the key stays on its replica while others come and go.
pub fn rendezvous<'c, 'a>(available: &[&'c Candidate<'a>], key: u64) -> &'c Candidate<'a> {
    let weight = |c: &Candidate<'a>| {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&key.to_le_bytes());
        h.update(c.id.as_bytes());
        h.digest()
    };
    let mut best = available[0];
    for c in &available[1..] {
        if weight(c) > weight(best) {
            best = c;
        }
    }
    best
}
