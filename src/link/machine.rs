//! The link's outage state: connected, down since a time (the next attempt due later, with a
//! backoff that doubles from 250 ms to 2 s), or reconnecting. Pure: the caller hands in the
//! events and the time, and logs the transitions it is given, one line each; a call failing
//! while the link is already down is no transition, so an outage is said once, however many
//! calls fail in it.

use std::time::{Duration, Instant};

/// The first wait before trying again after an outage begins.
pub const BACKOFF_MIN: Duration = Duration::from_millis(250);
/// The longest wait between two attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Never connected: the first attempt is due.
    Starting,
    /// Connected since then.
    Connected { since: Instant },
    /// Down since `since`; the next attempt is due at `retry_at`.
    Down { since: Instant, retry_at: Instant },
    /// An attempt is under way; down since `since` (None: never connected yet).
    Reconnecting { since: Option<Instant> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// An attempt to connect begins (the keeper checks [`Machine::due`] first).
    Attempt,
    /// An attempt succeeded: every lane has its connection.
    Connected,
    /// A call or an attempt failed: no answer within its bound, or the connection broke.
    Failed,
}

/// A change worth one log line (and one count in the metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The link went down (or could not come up at the start).
    Down,
    /// The link is up; `down_for`: how long the outage lasted (None: the first connection).
    Up { down_for: Option<Duration> },
}

#[derive(Debug, Clone)]
pub struct Machine {
    state: State,
    backoff: Duration,
}

impl Default for Machine {
    fn default() -> Self {
        Machine::new()
    }
}

impl Machine {
    pub fn new() -> Machine {
        Machine {
            state: State::Starting,
            backoff: BACKOFF_MIN,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn is_up(&self) -> bool {
        matches!(self.state, State::Connected { .. })
    }

    /// When the next attempt to connect is due: None while connected or while one is under
    /// way.
    pub fn due(&self) -> Option<Instant> {
        match self.state {
            State::Down { retry_at, .. } => Some(retry_at),
            State::Starting => Some(Instant::now()),
            State::Connected { .. } | State::Reconnecting { .. } => None,
        }
    }

    /// The next state after `event` at `now`, and the transition to log, if it is one.
    pub fn on(&mut self, event: Event, now: Instant) -> Option<Transition> {
        let (next, transition) = match (self.state, event) {
            (State::Starting, Event::Attempt) => (State::Reconnecting { since: None }, None),
            (State::Down { since, retry_at }, Event::Attempt) if now >= retry_at => {
                (State::Reconnecting { since: Some(since) }, None)
            }
            // Not due yet, or already connected or connecting: nothing to do.
            (s, Event::Attempt) => (s, None),
            (State::Connected { since }, Event::Connected) => (State::Connected { since }, None),
            (
                State::Starting | State::Down { .. } | State::Reconnecting { .. },
                Event::Connected,
            ) => {
                let down_for = match self.state {
                    State::Down { since, .. } | State::Reconnecting { since: Some(since) } => {
                        Some(now.saturating_duration_since(since))
                    }
                    _ => None,
                };
                self.backoff = BACKOFF_MIN;
                (
                    State::Connected { since: now },
                    Some(Transition::Up { down_for }),
                )
            }
            // A new outage (or none at the start): said once, retried after the shortest wait.
            (State::Connected { .. } | State::Starting, Event::Failed) => {
                self.backoff = BACKOFF_MIN;
                let down = State::Down {
                    since: now,
                    retry_at: now + self.backoff,
                };
                (down, Some(Transition::Down))
            }
            (State::Reconnecting { since: None }, Event::Failed) => {
                // The first attempt of all failed: the outage begins now, and is said once.
                let down = State::Down {
                    since: now,
                    retry_at: now + self.backoff,
                };
                (down, Some(Transition::Down))
            }
            // The outage goes on: the next attempt waits twice as long.
            (State::Reconnecting { since: Some(since) }, Event::Failed) => {
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                let down = State::Down {
                    since,
                    retry_at: now + self.backoff,
                };
                (down, None)
            }
            // Another call failing in the same outage.
            (s @ State::Down { .. }, Event::Failed) => (s, None),
        };
        self.state = next;
        transition
    }
}

/// The log line of a transition (`reason`: what failed, for a [`Transition::Down`]).
pub fn line(transition: Transition, instance: &str, reason: &str) -> String {
    match transition {
        Transition::Down => format!(
            "redis link: redis unreachable ({reason}); the cluster's state and budgets go on \
             alone, retrying"
        ),
        Transition::Up { down_for: None } => {
            format!("redis link: connected to redis as {instance}")
        }
        Transition::Up { down_for: Some(d) } => format!(
            "redis link: connected to redis as {instance} again, after {:.1} s away",
            d.as_secs_f64()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn an_outage_is_one_transition_down_and_one_up_however_many_calls_fail() {
        let t0 = Instant::now();
        let mut m = Machine::new();
        assert_eq!(m.state(), State::Starting);
        assert!(m.due().is_some());
        assert_eq!(m.on(Event::Attempt, t0), None);
        assert_eq!(m.state(), State::Reconnecting { since: None });
        assert_eq!(
            m.on(Event::Connected, t0 + ms(5)),
            Some(Transition::Up { down_for: None })
        );
        assert!(m.is_up() && m.due().is_none());
        // Connected again (a second report): nothing new.
        assert_eq!(m.on(Event::Connected, t0 + ms(6)), None);

        // An outage at 1 s: one transition, whatever else fails in it.
        let down = t0 + ms(1000);
        let mut said = vec![m.on(Event::Failed, down)];
        for i in 1..50 {
            said.push(m.on(Event::Failed, down + ms(i)));
        }
        assert_eq!(said.iter().flatten().count(), 1);
        assert_eq!(said[0], Some(Transition::Down));
        assert_eq!(
            m.state(),
            State::Down {
                since: down,
                retry_at: down + BACKOFF_MIN
            }
        );
        // An attempt before it is due does nothing.
        assert_eq!(m.on(Event::Attempt, down + ms(100)), None);
        assert!(matches!(m.state(), State::Down { .. }));

        // Attempts fail: each waits twice as long as the one before, up to the longest wait;
        // none of them is a transition.
        let mut now = down + BACKOFF_MIN;
        let mut waits = vec![];
        for _ in 0..6 {
            assert_eq!(m.on(Event::Attempt, now), None);
            assert_eq!(m.state(), State::Reconnecting { since: Some(down) });
            assert_eq!(m.on(Event::Failed, now), None);
            let State::Down { since, retry_at } = m.state() else {
                panic!("{:?}", m.state());
            };
            assert_eq!(since, down, "the outage began once");
            waits.push(retry_at - now);
            now = retry_at;
        }
        assert_eq!(
            waits,
            vec![ms(500), ms(1000), ms(2000), ms(2000), ms(2000), ms(2000)]
        );

        // Back: one transition up, saying how long it was away; the backoff starts over.
        assert_eq!(m.on(Event::Attempt, now), None);
        let back = now + ms(3);
        assert_eq!(
            m.on(Event::Connected, back),
            Some(Transition::Up {
                down_for: Some(back - down)
            })
        );
        assert_eq!(m.on(Event::Failed, back + ms(10)), Some(Transition::Down));
        assert_eq!(
            m.due(),
            Some(back + ms(10) + BACKOFF_MIN),
            "a new outage retries after the shortest wait"
        );
    }

    #[test]
    fn a_link_that_never_came_up_says_so_once() {
        let t0 = Instant::now();
        let mut m = Machine::new();
        m.on(Event::Attempt, t0);
        assert_eq!(m.on(Event::Failed, t0 + ms(1)), Some(Transition::Down));
        let mut said = 0;
        let mut now = t0 + ms(1);
        for _ in 0..10 {
            now = m.due().expect("an attempt is due");
            said += m.on(Event::Attempt, now).is_some() as usize;
            said += m.on(Event::Failed, now).is_some() as usize;
        }
        assert_eq!(said, 0);
        assert_eq!(
            m.on(Event::Connected, now),
            Some(Transition::Up {
                down_for: Some(now - (t0 + ms(1)))
            })
        );
    }

    /// A flapping Redis: every transition is said once, and only transitions are.
    #[test]
    fn each_transition_is_one_log_line() {
        let t0 = Instant::now();
        let mut m = Machine::new();
        let mut lines = vec![];
        let mut now = t0;
        let mut step = |m: &mut Machine, e: Event, now: Instant| {
            if let Some(t) = m.on(e, now) {
                lines.push(line(t, "lb-a", "connection refused"));
            }
        };
        for cycle in 0..3 {
            step(&mut m, Event::Attempt, now);
            step(&mut m, Event::Connected, now);
            for _ in 0..20 {
                step(&mut m, Event::Failed, now);
            }
            // Two failed attempts in each outage after the first.
            for _ in 0..cycle {
                now = m.due().expect("due");
                step(&mut m, Event::Attempt, now);
                step(&mut m, Event::Failed, now);
            }
            now = m.due().expect("due");
        }
        assert_eq!(lines.len(), 6, "{lines:#?}");
        for (i, l) in lines.iter().enumerate() {
            let up = i % 2 == 0;
            assert_eq!(l.contains("connected to redis as lb-a"), up, "{l}");
            assert_eq!(
                l.contains("redis unreachable (connection refused)"),
                !up,
                "{l}"
            );
        }
        assert!(!lines[0].contains("again"));
        assert!(lines[2].contains("again, after"));
    }
}
