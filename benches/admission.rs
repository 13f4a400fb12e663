//! Admission under the overload lock, with 100 and with 10,000 requests queued
//! (`cargo bench --bench admission -- --quick`): one request of a new key admitted into a
//! saturated fleet's queue (its budget, its slot, the queue shown) and its client then
//! leaving (its slot taken back). Its cost must not grow with the queue: p50/p99 printed.

use std::future::Future;
use std::hint::black_box;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use inferlb::fleet::registry::Registry;
use inferlb::overload::{Admission, Overload, Pass};

const CONF: &str = "inferlb:
  listen: 127.0.0.1:9
  admin_listen: 127.0.0.1:10
  replicas:
    - {id: a, address: '127.0.0.1:9'}
  overload:
    max_running: 1
    queue_length: 20000
    queue_timeout_seconds: 3600
    key_header: x-tenant
";

/// An overload state whose one replica is full, with `queued` requests of distinct keys
/// waiting; the guard keeps the replica full.
struct Saturated {
    overload: Arc<Overload>,
    _running: inferlb::fleet::replica::InFlight,
    next_key: u64,
}

fn headers(key: u64) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    h.insert("x-tenant", format!("tenant-{key}").parse().expect("header"));
    h
}

impl Saturated {
    fn new(queued: usize) -> Saturated {
        let loaded = inferlb::conf::parse(CONF, None).expect("conf");
        let c = loaded.inferlb;
        let registry = Arc::new(Registry::new(&c.replicas, &c.upstream));
        let running = registry.all()[0].start();
        let overload = Arc::new(Overload::new(c.overload.expect("overload"), registry));
        let mut s = Saturated {
            overload,
            _running: running,
            next_key: 0,
        };
        for _ in 0..queued {
            // Polled once, the request holds its slot; dropped, it keeps it (only its own
            // wait would take it out, and the fleet never has room).
            let (admitted, _leave) = s.admit_once();
            assert!(admitted.is_pending(), "the fleet is saturated: it waits");
        }
        assert_eq!(s.overload.queue_bytes().1, queued);
        s
    }

    /// Starts admitting one request of a new key: the first poll (admission itself), and a
    /// way to make its client leave.
    fn admit_once(&mut self) -> (Poll<Admission>, impl FnOnce()) {
        self.next_key += 1;
        let who = self.overload.identify(&headers(self.next_key));
        let gone = Arc::new(tokio::sync::Notify::new());
        let left = gone.clone();
        let overload = self.overload.clone();
        let mut fut = Box::pin(async move {
            let mut pass = Pass::default();
            overload
                .admit(
                    &mut pass,
                    who,
                    100,
                    None,
                    async move { left.notified().await },
                )
                .await
        });
        let mut cx = Context::from_waker(Waker::noop());
        let first = fut.as_mut().poll(&mut cx);
        let leave = move || {
            gone.notify_one();
            let done = fut.as_mut().poll(&mut cx);
            assert_eq!(done, Poll::Ready(Admission::Gone));
        };
        (first, leave)
    }
}

/// (p50, p99) in µs of admitting then leaving, `n` times.
fn percentiles(s: &mut Saturated, n: usize) -> ((f64, f64), (f64, f64)) {
    let (mut admit, mut leave) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let t = Instant::now();
        let (first, left) = s.admit_once();
        admit.push(t.elapsed());
        assert!(first.is_pending());
        let t = Instant::now();
        left();
        leave.push(t.elapsed());
    }
    let p = |v: &mut Vec<Duration>| {
        v.sort_unstable();
        let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
        (at(0.5), at(0.99))
    };
    (p(&mut admit), p(&mut leave))
}

fn admission(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let _in = rt.enter();
    let mut group = c.benchmark_group("admission");
    let mut p99 = vec![];
    for queued in [100usize, 10_000] {
        let mut s = Saturated::new(queued);
        let ((a50, a99), (l50, l99)) = percentiles(&mut s, 20_000);
        println!(
            "{queued} queued: admission p50 {a50:.2} us, p99 {a99:.2} us; leaving p50 {l50:.2} us, p99 {l99:.2} us"
        );
        p99.push(a99);
        group.bench_with_input(BenchmarkId::new("admit_and_leave", queued), &(), |b, _| {
            b.iter(|| {
                let (first, left) = s.admit_once();
                black_box(first.is_pending());
                left();
            })
        });
        assert_eq!(s.overload.queue_bytes().1, queued, "every probe left");
    }
    println!(
        "admission p99, 10000 queued over 100 queued: {:.2}x",
        p99[1] / p99[0]
    );
    group.finish();
}

criterion_group!(benches, admission);
criterion_main!(benches);
