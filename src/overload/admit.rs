//! Admitting one request: its key's budget first ([`budget`](super::budget)); then to a
//! replica at once when one has room, or a wait in the queue until the pump lets it go, it is
//! pushed out, the wait bound passes or its client leaves; and the 429 a refused request is
//! answered, with how long to wait before trying again.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use super::metrics::METRICS;
use super::queue::{Full, Pushed};
use super::{budget, policy};
use super::{Admission, Overload, Pass, State, TooMany, Verdict, Waiter, Who};
use crate::conf::overload::Budget;

/// What admission decided under its first lock: an answer at once, or a place in the queue.
enum Entered {
    Done(Admission),
    /// Queued under this id; its verdict comes on this channel.
    Queued(u64, oneshot::Receiver<Verdict>),
}

impl Overload {
    /// Admits a request of about `tokens` prompt tokens for `model`'s replicas: at once, after
    /// waiting in the queue, or not (429). `gone` completes when the client hangs up.
    pub async fn admit(
        self: &Arc<Self>,
        pass: &mut Pass,
        who: Who,
        tokens: u64,
        model: Option<&str>,
        gone: impl Future<Output = ()>,
    ) -> Admission {
        let Who {
            key,
            label,
            class,
            budget,
        } = who;
        *pass = Pass {
            owner: Some(self.clone()),
            key,
            label,
            tokens,
            ..Pass::default()
        };
        let class_name = self.conf.classes[class].as_str();
        self.keep_sharing();
        let now = Instant::now();
        let (id, rx) = match self.enter(pass, budget, class, class_name, model, now) {
            Entered::Done(admission) => return admission,
            Entered::Queued(id, rx) => (id, rx),
        };
        self.keep_pumping();
        // Its replicas may have room while other models' requests wait.
        self.pump();
        self.wait(pass, id, rx, class_name, now, gone).await
    }

    /// Under one lock: the key's budget is checked and charged, then the request goes at once
    /// when the queue is empty and a replica has room, or takes a slot in the queue (pushing
    /// out another), or is refused.
    fn enter(
        &self,
        pass: &mut Pass,
        budget: Budget,
        class: usize,
        class_name: &str,
        model: Option<&str>,
        now: Instant,
    ) -> Entered {
        let (key, tokens) = (pass.key, pass.tokens);
        let mut s = self.lock();
        if let Err((over, wait)) = s.budgets.check(key, budget, tokens, now) {
            let reason = match over {
                budget::Over::Concurrency => "concurrency",
                budget::Over::TokensPerMinute => "tokens_per_minute",
            };
            let wait = wait.as_secs_f64().ceil().max(1.0) as u64;
            return Entered::Done(Admission::Refused(self.refuse(pass, &mut s, reason, wait)));
        }
        s.budgets.start(key, tokens, now);
        pass.counted = true;
        METRICS
            .tokens
            .with_label_values(&[pass.label(), "prompt"])
            .inc_by(tokens);
        let go_now = !self.conf.limits_load() || {
            let mut fleet = self.replica_loads(model, &s.transit);
            s.queue.is_empty() && self.limits.place(&mut fleet, tokens)
        };
        if go_now {
            let model = model.map(Arc::from);
            pass.ticket = Some(Self::let_go(&mut s, tokens, model, now));
            pass.note = Some("-");
            METRICS
                .queue_wait
                .with_label_values(&[class_name])
                .observe(0.0);
            return Entered::Done(Admission::Go);
        }
        let (tx, rx) = oneshot::channel();
        let waiter = Waiter {
            tx,
            model: model.map(Arc::from),
        };
        let id = match s.queue.push(key, class, tokens, waiter) {
            Pushed::Queued(id) => id,
            Pushed::Evicted(id, out) => {
                let _ = out.item.tx.send(Verdict::PushedOut);
                id
            }
            Pushed::Refused(why, _) => {
                let reason = match why {
                    Full::Queue => "queue_full",
                    Full::KeyShare => "key_share",
                };
                let wait = self.retry_after(&mut s, now);
                return Entered::Done(Admission::Refused(self.refuse(pass, &mut s, reason, wait)));
            }
        };
        METRICS.saturated.set(1);
        self.show(&s);
        Entered::Queued(id, rx)
    }

    /// Waits in the queue (entry `id`, queued at `now`) for its verdict, the wait bound or its
    /// client leaving, whichever comes first; then answers under the lock.
    async fn wait(
        &self,
        pass: &mut Pass,
        id: u64,
        mut rx: oneshot::Receiver<Verdict>,
        class_name: &str,
        now: Instant,
        gone: impl Future<Output = ()>,
    ) -> Admission {
        let (waited, answered) = tokio::select! {
            v = &mut rx => (None, v.ok()),
            _ = tokio::time::sleep(self.conf.queue_timeout) => (Some("queue_timeout"), None),
            _ = gone => (Some("client_gone"), None),
        };
        let waited_for = now.elapsed();
        pass.waited = Some(waited_for);
        let mut s = self.lock();
        // Under the lock an entry is either still queued or was answered (the pump and a
        // push-out send while they hold it): a verdict is never lost.
        let left = waited.filter(|_| s.queue.remove(id).is_some());
        let verdict = answered.or_else(|| rx.try_recv().ok());
        self.show(&s);
        if waited == Some("client_gone") {
            if left.is_some() {
                METRICS.abandoned.with_label_values(&[class_name]).inc();
            }
            if let Some(Verdict::Go(ticket)) = verdict {
                pass.ticket = Some(ticket);
            }
            // It never ran: its tokens go back (its place, when the pass ends).
            s.budgets
                .charge(pass.key, -(pass.tokens as i64), Instant::now());
            pass.note = Some("client_gone");
            return Admission::Gone;
        }
        let reason = match verdict {
            Some(Verdict::Go(ticket)) => {
                pass.ticket = Some(ticket);
                pass.note = Some("queued");
                let q = METRICS.queue_wait.with_label_values(&[class_name]);
                q.observe(waited_for.as_secs_f64());
                return Admission::Go;
            }
            Some(Verdict::PushedOut) => "pushed_out",
            None => "queue_timeout",
        };
        let wait = self.retry_after(&mut s, Instant::now());
        Admission::Refused(self.refuse(pass, &mut s, reason, wait))
    }

    fn refuse(&self, pass: &mut Pass, s: &mut State, reason: &'static str, wait: u64) -> TooMany {
        if pass.counted {
            // It never ran: its key gets its place and its tokens back.
            pass.counted = false;
            s.budgets.end(pass.key);
            s.budgets
                .charge(pass.key, -(pass.tokens as i64), Instant::now());
        }
        pass.note = Some(reason);
        METRICS
            .rejected
            .with_label_values(&[pass.label(), reason])
            .inc();
        let message = match reason {
            "concurrency" => "too many requests of this key at once".to_string(),
            "tokens_per_minute" => "this key's tokens per minute are used up".to_string(),
            "key_share" => "this key holds its share of the queue".to_string(),
            "queue_timeout" => "the replicas are saturated and the request waited too long".into(),
            _ => "the replicas are saturated and the queue is full".to_string(),
        };
        TooMany {
            reason,
            retry_after: wait,
            message: format!("{message}; retry after {wait} s"),
        }
    }

    fn retry_after(&self, s: &mut State, now: Instant) -> u64 {
        let ahead = s.queue.len();
        let rate = s.drain.per_second(now);
        policy::retry_after(ahead, rate, self.conf.queue_timeout)
    }
}
