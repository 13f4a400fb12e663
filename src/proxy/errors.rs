//! Pingora's errors in inferlb's terms: the [`Failure`] the verdict reads, and a short reason
//! for logs and metric labels.

use pingora_core::{Error, ErrorSource, ErrorType};
use pingora_error::RetryType;

use super::failover::Failure;

/// Where the error was seen.
#[derive(Debug, Clone, Copy)]
pub enum Seen {
    /// While talking to a replica (`error_while_proxy`): an error of unknown source is the
    /// replica's. `client_reused` is Pingora's flag of the same name.
    Proxying { client_reused: bool },
    /// At the end of the request (`fail_to_proxy`).
    Final,
}

pub fn failure_of(e: &Error, seen: Seen) -> Failure {
    let upstream = match (e.esource(), seen) {
        (ErrorSource::Upstream, _) => true,
        (ErrorSource::Downstream, _) => false,
        (_, Seen::Proxying { .. }) => true,
        (_, Seen::Final) => false,
    };
    match e.etype() {
        ErrorType::HTTPStatus(code) => Failure::Status(*code),
        ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed
            if e.esource() == &ErrorSource::Downstream =>
        {
            Failure::ClientGone
        }
        _ if e.esource() == &ErrorSource::Downstream => Failure::ClientBad,
        ErrorType::ReadTimedout if upstream => Failure::ReadTimeout,
        _ if !upstream => Failure::Internal,
        _ if matches!(
            seen,
            Seen::Proxying {
                client_reused: true
            }
        ) && matches!(e.retry, RetryType::ReusedOnly) =>
        {
            Failure::StalePooled
        }
        ErrorType::ConnectRefused
        | ErrorType::ConnectTimedout
        | ErrorType::ConnectNoRoute
        | ErrorType::ConnectError
        | ErrorType::TLSHandshakeFailure
        | ErrorType::InvalidCert => Failure::Connect,
        _ => Failure::Broken,
    }
}

/// A short name for why an upstream attempt failed, for logs and metric labels.
pub fn reason(e: &Error) -> &'static str {
    match e.etype() {
        ErrorType::ConnectRefused => "connect_refused",
        ErrorType::ConnectTimedout => "connect_timeout",
        ErrorType::ConnectNoRoute => "connect_no_route",
        // A certificate that does not check out, or no common protocol or cipher.
        ErrorType::TLSHandshakeFailure | ErrorType::InvalidCert => "tls_handshake",
        ErrorType::ConnectError | ErrorType::SocketError => "connect_error",
        ErrorType::ReadTimedout => "read_timeout",
        ErrorType::WriteTimedout => "write_timeout",
        ErrorType::ConnectionClosed => "connection_closed",
        ErrorType::ReadError | ErrorType::WriteError => "reset",
        ErrorType::HTTPStatus(502) => "http_502",
        ErrorType::HTTPStatus(503) => "http_503",
        ErrorType::HTTPStatus(_) => "http_status",
        _ => "upstream_error",
    }
}
