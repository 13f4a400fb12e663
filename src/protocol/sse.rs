//! Server-sent events as they pass a proxy: bytes in, whole events out, each with its blank
//! line, as soon as that line arrives. What is not whole yet waits; nothing is parsed.

use bytes::Bytes;

/// The part of a stream whose event has not ended yet.
#[derive(Debug, Default)]
pub struct Events {
    pending: Vec<u8>,
}

impl Events {
    /// The whole events `chunk` completes, if any; the rest waits for its end.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<Vec<u8>> {
        // Only the new bytes (and the three before them) can hold a new blank line.
        let from = self.pending.len().saturating_sub(3);
        self.pending.extend_from_slice(chunk);
        let end = last_boundary(&self.pending[from..])? + from;
        let rest = self.pending.split_off(end);
        Some(std::mem::replace(&mut self.pending, rest))
    }

    /// What is left once the stream ended (an event without its blank line), as it came.
    pub fn finish(&mut self) -> Bytes {
        Bytes::from(std::mem::take(&mut self.pending))
    }

    /// Bytes of an event not yet whole.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }
}

/// The end of the last whole event in `buf` (past its blank line).
fn last_boundary(buf: &[u8]) -> Option<usize> {
    let lf = memchr::memmem::rfind(buf, b"\n\n").map(|i| i + 2);
    let crlf = memchr::memmem::rfind(buf, b"\r\n\r\n").map(|i| i + 4);
    lf.max(crlf)
}

/// Whole events, each with its blank line.
pub fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let lf = memchr::memmem::find(rest, b"\n\n").map(|i| i + 2);
        let crlf = memchr::memmem::find(rest, b"\r\n\r\n").map(|i| i + 4);
        let end = match (lf, crlf) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(rest.len()),
        };
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_come_out_whole_wherever_the_chunks_cut() {
        let stream = b"data: a\n\ndata: b\r\n\r\ndata: c\n\n";
        for cut in 0..stream.len() {
            let mut e = Events::default();
            let mut out = e.feed(&stream[..cut]).unwrap_or_default();
            out.extend(e.feed(&stream[cut..]).unwrap_or_default());
            assert_eq!(out, stream, "cut {cut}");
            assert_eq!(
                split_events(&out).collect::<Vec<_>>(),
                vec![&b"data: a\n\n"[..], b"data: b\r\n\r\n", b"data: c\n\n"]
            );
        }
        let mut e = Events::default();
        assert_eq!(e.feed(b"data: unended"), None);
        assert_eq!(e.pending_len(), 13);
        assert_eq!(&e.finish()[..], b"data: unended");
    }
}
