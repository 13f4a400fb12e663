//! The failover verdict: what one failed attempt means for the request and for the replica.
//!
//! Pure: the proxy translates Pingora's error into a [`Failure`] and applies the [`Verdict`].
//! The rules, as the README's Failover section promises them:
//! - nothing reached the client yet and the replica failed (no connection, a reset or close
//!   before the answer, a 502/503 answer): demote it and try another replica;
//! - a pooled connection the replica had already closed: try again without blaming it;
//! - a replica slow to answer is still working: no retry (it would double its load), 504;
//! - once the client got a byte, or the body cannot be sent again: never retry;
//! - the client's own failure blames no replica;
//! - a request about a stored response is stateful: only the replica that stores it can serve
//!   it, so it is never sent elsewhere.

/// What went wrong with one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No connection was made: refused, timed out, no route, TLS handshake.
    Connect,
    /// A pooled connection was already closed by the replica; the replica may be fine.
    StalePooled,
    /// The replica took the request, then reset or closed before answering (or mid-answer).
    Broken,
    /// The replica said nothing for the read timeout.
    ReadTimeout,
    /// An answer with this status: a replica's 502/503, or inferlb's own (503: none live).
    Status(u16),
    /// The client hung up.
    ClientGone,
    /// The client sent something unusable.
    ClientBad,
    /// inferlb's own failure.
    Internal,
}

/// The circumstances of one failed attempt.
#[derive(Debug, Clone, Copy)]
pub struct Failed {
    pub failure: Failure,
    /// A response byte already went to the client.
    pub client_got_bytes: bool,
    /// The request body can still be sent again.
    pub body_replayable: bool,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// Attempts allowed for one request (`max_retries`).
    pub max_attempts: u32,
    /// Only this replica can serve it (a stored response).
    pub stateful: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// On a replica this request has not tried.
    Elsewhere,
    /// On the same replica, over a new connection.
    Same,
    No,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// No new requests for the replica until a health check passes.
    pub demote: bool,
    pub retry: Retry,
}

/// Whether a replica's answer with `status` is handed back or fails over: vLLM answers 503
/// while starting or overloaded and a gateway in front of it 502, so the request produced
/// nothing and vLLM's endpoints are stateless. A 500 is the replica's answer about this request.
pub fn status_fails_over(status: u16) -> bool {
    matches!(status, 502 | 503)
}

pub fn verdict(a: &Failed) -> Verdict {
    const END: Verdict = Verdict {
        demote: false,
        retry: Retry::No,
    };
    let retry_if_allowed = |retry| match retry {
        _ if a.attempt >= a.max_attempts => Retry::No,
        Retry::Elsewhere if a.stateful => Retry::No,
        retry => retry,
    };
    match a.failure {
        // Nothing was sent: demoting is always right, retrying even after the client got
        // bytes cannot happen (there are none before a connection).
        Failure::Connect => Verdict {
            demote: true,
            retry: retry_if_allowed(Retry::Elsewhere),
        },
        _ if a.client_got_bytes || !a.body_replayable => END,
        Failure::ClientGone | Failure::ClientBad | Failure::Internal => END,
        Failure::ReadTimeout => END,
        Failure::StalePooled => Verdict {
            demote: false,
            retry: retry_if_allowed(Retry::Same),
        },
        Failure::Broken => Verdict {
            demote: true,
            retry: retry_if_allowed(Retry::Elsewhere),
        },
        Failure::Status(code) if status_fails_over(code) => Verdict {
            demote: true,
            retry: retry_if_allowed(Retry::Elsewhere),
        },
        Failure::Status(_) => END,
    }
}

/// The status the client gets when the request ends in `failure` before any byte was
/// written; `None` when there is nobody to answer.
pub fn final_status(failure: Failure) -> Option<u16> {
    match failure {
        Failure::Status(code) => Some(code),
        Failure::ReadTimeout => Some(504),
        Failure::Connect | Failure::StalePooled | Failure::Broken => Some(502),
        Failure::ClientGone => None,
        Failure::ClientBad => Some(400),
        Failure::Internal => Some(500),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEMOTE_RETRY: Verdict = Verdict {
        demote: true,
        retry: Retry::Elsewhere,
    };
    const DEMOTE_END: Verdict = Verdict {
        demote: true,
        retry: Retry::No,
    };
    const END: Verdict = Verdict {
        demote: false,
        retry: Retry::No,
    };
    const SAME: Verdict = Verdict {
        demote: false,
        retry: Retry::Same,
    };

    /// (what failed, client got bytes, body replayable, attempt of 4) → verdict, final status.
    type Row = (Failure, bool, bool, u32, Verdict, Option<u16>, &'static str);

    fn attempt(failure: Failure, client_got_bytes: bool, body_replayable: bool, n: u32) -> Failed {
        Failed {
            failure,
            client_got_bytes,
            body_replayable,
            attempt: n,
            max_attempts: 4,
            stateful: false,
        }
    }

    #[test]
    fn every_failover_rule_of_the_readme() {
        use Failure::*;
        #[rustfmt::skip]
        let rows: &[Row] = &[
            (Connect, false, true, 1, DEMOTE_RETRY, Some(502), "refused/reset/timed-out connect fails over"),
            (Connect, false, true, 4, DEMOTE_END, Some(502), "the last attempt still demotes"),
            (Connect, false, false, 1, DEMOTE_RETRY, Some(502), "nothing was sent: the body is intact"),
            (Broken, false, true, 1, DEMOTE_RETRY, Some(502), "reset/closed before any byte fails over"),
            (Broken, false, true, 4, DEMOTE_END, Some(502), "…but not past max_retries"),
            (Status(503), false, true, 1, DEMOTE_RETRY, Some(503), "503 (starting, overloaded) fails over"),
            (Status(502), false, true, 2, DEMOTE_RETRY, Some(502), "502 (a gateway's) fails over"),
            (Status(503), false, true, 4, DEMOTE_END, Some(503), "the last 503 goes back as it is"),
            (Status(500), false, true, 1, END, Some(500), "500 is the replica's answer"),
            (ReadTimeout, false, true, 1, END, Some(504), "slow is still working: no retry, 504"),
            (Broken, true, true, 1, END, Some(502), "a stream cut after the first byte is never retried"),
            (Status(503), true, true, 1, END, Some(503), "nor is anything after the first byte"),
            (Broken, false, false, 1, END, Some(502), "a large chunked body already consumed cannot be re-sent"),
            (StalePooled, false, true, 1, SAME, Some(502), "a stale pooled connection: retry, no blame"),
            (StalePooled, true, true, 1, END, Some(502), "…unless the client got bytes"),
            (ClientGone, false, true, 1, END, None, "a client that hung up blames no replica"),
            (ClientBad, false, true, 1, END, Some(400), "nor does a bad request"),
            (Internal, false, true, 1, END, Some(500), "nor does inferlb's own failure"),
        ];
        for &(failure, client_got_bytes, body_replayable, n, want, status, why) in rows {
            let a = attempt(failure, client_got_bytes, body_replayable, n);
            assert_eq!(verdict(&a), want, "{why}: {a:?}");
            assert_eq!(final_status(failure), status, "{why}");
        }
    }

    #[test]
    fn a_stored_response_never_fails_over_but_its_replica_is_still_demoted() {
        use Failure::*;
        for (failure, want) in [
            (Connect, DEMOTE_END),
            (Broken, DEMOTE_END),
            (Status(503), DEMOTE_END),
            (ReadTimeout, END),
            (StalePooled, SAME),
        ] {
            let a = Failed {
                stateful: true,
                ..attempt(failure, false, true, 1)
            };
            assert_eq!(verdict(&a), want, "{failure:?}");
        }
    }

    #[test]
    fn only_502_and_503_answers_fail_over() {
        for code in [200, 400, 404, 429, 500, 501, 504] {
            assert!(!status_fails_over(code), "{code}");
        }
        assert!(status_fails_over(502) && status_fails_over(503));
    }
}
