//! One link to the cluster's Redis (or Valkey), for everything the instances share: the
//! cluster's state (`crate::cluster`) and the overload budgets (`crate::overload::shared`).
//!
//! - **One outage state** ([`machine`]): connected, down since a time, or reconnecting with a
//!   backoff from 250 ms to 2 s. A keeper task ([`Keeper`]) makes every connection; a call
//!   that gets no answer within its lane's bound, or whose connection broke, takes the whole
//!   link down (it is one Redis), and every call fails at once, without waiting, until the
//!   keeper is connected again. Each transition is logged once, counted in
//!   `inferlb_redis_transitions_total{to}` and shown in `inferlb_redis_up`; never one line per
//!   failed call.
//! - **Lanes** ([`Lane`]): each has its own multiplexed connection and its own round-trip
//!   bound, so a large write on one lane never waits in front of a small one on another (Redis
//!   reads each connection apart and serves the others between the reads of a large command).
//!   Pins, drains, replicas and load go on [`Lane::Control`], the budgets on
//!   [`Lane::Budgets`], saved prefix indexes (and later the Responses store) on [`Lane::Bulk`].
//!   A new lane is one variant.
//! - **Channels** ([`Channel`]): the pub/sub channels, each with its versioned name (see
//!   [`Channel::name`]), followed through a [`Subscription`].
//!
//! Versioning: a key or channel whose content holds prompt hashes carries the hash version
//! (`inferlb:v2:...`); any other carries the version of its own format after its subject
//! (`inferlb:load:v1`, `inferlb:overload:v1:...`). A change of format takes a new version (a
//! name an older version's patterns do not match), so instances of two versions during a
//! rolling upgrade ignore each other's messages rather than misread them; a name whose format
//! is unchanged keeps it, so what Redis holds (drains, replicas added at runtime) outlives the
//! upgrade.

pub mod machine;
mod metrics;
#[cfg(test)]
mod tests;

use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use pingora_core::server::ShutdownWatch;
use pingora_core::services::background::BackgroundService;
use redis::aio::MultiplexedConnection;
use redis::{Cmd, FromRedisValue, Pipeline};
use tokio::sync::{watch, Notify};

use crate::conf::ClusterConf;
use crate::protocol::api::prompt::HASH_VERSION;
use machine::{Event, Machine, Transition};
pub use metrics::METRICS;

/// A kind of traffic, with its own connection and round-trip bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Small messages that must not wait: pins, drains, replicas, load, and the bootstrap's
    /// reads.
    Control,
    /// The overload budgets' exchange every 200 ms.
    Budgets,
    /// Large values and long scans: saved prefix indexes (hundreds of kilobytes), and the
    /// deletion of a restarted replica's pins.
    Bulk,
}

impl Lane {
    /// Every lane, each with a connection of its own.
    pub const ALL: [Lane; 3] = [Lane::Control, Lane::Budgets, Lane::Bulk];

    /// How long a round trip on this lane may take; slower counts as Redis being down.
    pub fn bound(self) -> Duration {
        match self {
            Lane::Control => Duration::from_secs(1),
            Lane::Budgets => Duration::from_millis(500),
            // A large value takes its time to send: megabytes over a slow network.
            Lane::Bulk => Duration::from_secs(5),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Lane::Control => "control",
            Lane::Budgets => "budgets",
            Lane::Bulk => "bulk",
        }
    }

    fn index(self) -> usize {
        Lane::ALL.iter().position(|l| *l == self).unwrap_or(0)
    }
}

/// A pub/sub channel, and what it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// Pins and prompts prefilled: prompt hashes, so named with the hash version.
    Pins,
    /// Drains and undrains, replicas added and removed: the operator's changes to replicas.
    Replicas,
    /// Each instance's load per replica, as it changes and as snapshots.
    Load,
}

impl Channel {
    pub const ALL: [Channel; 3] = [Channel::Pins, Channel::Replicas, Channel::Load];

    /// Its versioned name (see the module's versioning rule). `inferlb:drains`, which carried
    /// drains, replicas and load before, is no longer used: an instance of an older version
    /// neither hears nor is heard on these.
    pub fn name(self) -> &'static str {
        static PINS: LazyLock<String> = LazyLock::new(|| format!("inferlb:v{HASH_VERSION}:pins"));
        match self {
            Channel::Pins => PINS.as_str(),
            Channel::Replicas => "inferlb:replicas:v1",
            Channel::Load => "inferlb:load:v1",
        }
    }

    pub fn from_name(name: &str) -> Option<Channel> {
        Channel::ALL.into_iter().find(|c| c.name() == name)
    }

    /// The lane its messages are published on.
    pub fn lane(self) -> Lane {
        Lane::Control
    }
}

/// Why a call did not get its answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failed {
    /// The link is down: nothing was sent.
    Down,
    /// No answer within the lane's bound. On the control lane the link is down now; on
    /// another lane only this call failed (a slow budget exchange or a large write is no
    /// outage, and must not take the pins and drains down with it).
    Slow(Lane),
    /// The connection broke, or none could be made: the link is down now.
    Broken(String),
    /// Redis answered with an error (the link stays up).
    Refused(String),
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failed::Down => write!(f, "the link to redis is down"),
            Failed::Slow(lane) => write!(
                f,
                "no answer on the {} lane within {:?}",
                lane.name(),
                lane.bound()
            ),
            Failed::Broken(e) => write!(f, "{e}"),
            Failed::Refused(e) => write!(f, "redis refused: {e}"),
        }
    }
}

impl std::error::Error for Failed {}

impl Failed {
    fn from_redis(e: redis::RedisError) -> Failed {
        let outage = e.kind() == redis::ErrorKind::Io
            || e.is_connection_dropped()
            || e.is_unrecoverable_error();
        if outage {
            Failed::Broken(e.to_string())
        } else {
            Failed::Refused(e.to_string())
        }
    }

    /// Whether it says the link is down, rather than one call failing: Redis refusing a
    /// command, or a lane other than control answering late.
    pub fn is_outage(&self) -> bool {
        match self {
            Failed::Down | Failed::Broken(_) => true,
            Failed::Slow(lane) => *lane == Lane::Control,
            Failed::Refused(_) => false,
        }
    }
}

/// Where the link stands, as its users follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    pub up: bool,
    /// Counts the connections made: a user that sees it change missed what was said meanwhile.
    pub generation: u64,
}

struct Inner {
    machine: Machine,
    generation: u64,
    /// One connection per lane, in [`Lane::ALL`]'s order; empty while the link is down.
    lanes: Vec<MultiplexedConnection>,
}

pub struct Link {
    conf: ClusterConf,
    inner: Mutex<Inner>,
    /// Woken when a call failed: the keeper looks again.
    failed: Notify,
    status: watch::Sender<Status>,
}

impl Link {
    /// A link to the cluster's Redis, down until its [`Keeper`] runs and connects.
    pub fn new(conf: ClusterConf) -> Arc<Link> {
        METRICS.up.set(0);
        let status = Status {
            up: false,
            generation: 0,
        };
        Arc::new(Link {
            conf,
            inner: Mutex::new(Inner {
                machine: Machine::new(),
                generation: 0,
                lanes: Vec::new(),
            }),
            failed: Notify::new(),
            status: watch::Sender::new(status),
        })
    }

    /// The task that connects, and reconnects after an outage.
    pub fn keeper(self: &Arc<Self>) -> Keeper {
        Keeper(self.clone())
    }

    pub fn instance(&self) -> &str {
        &self.conf.instance_id
    }

    pub fn is_up(&self) -> bool {
        self.status.borrow().up
    }

    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.subscribe()
    }

    /// A lane's connection and the generation it belongs to, if the link is up.
    fn connection(&self, lane: Lane) -> Result<(u64, MultiplexedConnection), Failed> {
        let inner = self.inner.lock().map_err(|_| Failed::Down)?;
        match inner.lanes.get(lane.index()) {
            Some(c) if inner.machine.is_up() => Ok((inner.generation, c.clone())),
            _ => Err(Failed::Down),
        }
    }

    /// One command on `lane`, bounded by the lane's bound.
    pub async fn query<T: FromRedisValue>(&self, lane: Lane, cmd: &Cmd) -> Result<T, Failed> {
        let (generation, mut conn) = self.connection(lane)?;
        let answer = tokio::time::timeout(lane.bound(), cmd.query_async(&mut conn)).await;
        self.settle(lane, generation, answer)
    }

    /// A pipeline on `lane`, bounded by the lane's bound as a whole.
    pub async fn pipe<T: FromRedisValue>(&self, lane: Lane, pipe: &Pipeline) -> Result<T, Failed> {
        let (generation, mut conn) = self.connection(lane)?;
        let answer = tokio::time::timeout(lane.bound(), pipe.query_async(&mut conn)).await;
        self.settle(lane, generation, answer)
    }

    fn settle<T>(
        &self,
        lane: Lane,
        generation: u64,
        answer: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T, Failed> {
        let failed = match answer {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => Failed::from_redis(e),
            Err(_) => Failed::Slow(lane),
        };
        if failed.is_outage() {
            self.fail(generation, &failed);
        }
        Err(failed)
    }

    /// A call on the connections of `generation` failed: the link is down, unless it was
    /// replaced since (a late failure of connections already let go).
    fn fail(&self, generation: u64, failed: &Failed) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        // Connections let go already (an outage said, or replaced since): nothing new.
        if inner.generation != generation || !inner.machine.is_up() {
            return;
        }
        let transition = inner.machine.on(Event::Failed, Instant::now());
        inner.lanes.clear();
        drop(inner);
        self.announce(transition, &failed.to_string());
        self.status.send_replace(Status {
            up: false,
            generation,
        });
        self.failed.notify_one();
    }

    /// Logs and counts a transition: one line each.
    fn announce(&self, transition: Option<Transition>, reason: &str) {
        let Some(t) = transition else {
            return;
        };
        let to = match t {
            Transition::Down => "down",
            Transition::Up { .. } => "up",
        };
        METRICS.up.set(i64::from(to == "up"));
        METRICS.transitions.with_label_values(&[to]).inc();
        log::warn!("{}", machine::line(t, &self.conf.instance_id, reason));
    }

    /// Subscribes to `channels` on a connection of its own, bounded by the control lane's
    /// bound; the subscription ends (and the link goes down) when that connection breaks.
    pub async fn subscribe(self: &Arc<Self>, channels: &[Channel]) -> Result<Subscription, Failed> {
        let (generation, _) = self.connection(Lane::Control)?;
        let bound = Lane::Control.bound();
        let subscribed = tokio::time::timeout(bound, async {
            let client = self.conf.client()?;
            let mut pubsub = client.get_async_pubsub().await?;
            let names: Vec<&str> = channels.iter().map(|c| c.name()).collect();
            pubsub.subscribe(names).await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
        .await;
        let pubsub = self.settle(Lane::Control, generation, subscribed)?;
        Ok(Subscription {
            link: self.clone(),
            generation,
            messages: pubsub.into_on_message(),
        })
    }

    /// Makes every lane's connection, each within the control lane's bound.
    async fn connect(&self) -> Result<Vec<MultiplexedConnection>, Failed> {
        let client = self
            .conf
            .client()
            .map_err(|e| Failed::Broken(e.to_string()))?;
        let bound = Lane::Control.bound();
        // The lanes' bounds are kept here, not by the connection (its default would cut every
        // answer at 500 ms).
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(bound))
            .set_response_timeout(None);
        let connecting = Lane::ALL.map(|_| {
            let (client, config) = (&client, &config);
            async move {
                match tokio::time::timeout(
                    bound,
                    client.get_multiplexed_async_connection_with_config(config),
                )
                .await
                {
                    Ok(Ok(c)) => Ok(c),
                    Ok(Err(e)) => Err(Failed::Broken(e.to_string())),
                    Err(_) => Err(Failed::Slow(Lane::Control)),
                }
            }
        });
        futures::future::try_join_all(connecting).await
    }

    /// Connects when an attempt is due, and waits while the link is up; until `shutdown`.
    async fn keep(&self, shutdown: &mut ShutdownWatch) {
        loop {
            let due = match self.inner.lock() {
                Ok(inner) => inner.machine.due(),
                Err(_) => return,
            };
            match due {
                None => tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = self.failed.notified() => continue,
                },
                Some(at) => tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = tokio::time::sleep_until(at.into()) => {}
                },
            }
            if let Ok(mut inner) = self.inner.lock() {
                inner.machine.on(Event::Attempt, Instant::now());
            }
            let connected = self.connect().await;
            let Ok(mut inner) = self.inner.lock() else {
                return;
            };
            match connected {
                Ok(lanes) => {
                    inner.generation += 1;
                    inner.lanes = lanes;
                    let transition = inner.machine.on(Event::Connected, Instant::now());
                    let generation = inner.generation;
                    drop(inner);
                    self.announce(transition, "");
                    self.status.send_replace(Status {
                        up: true,
                        generation,
                    });
                }
                Err(e) => {
                    let transition = inner.machine.on(Event::Failed, Instant::now());
                    drop(inner);
                    self.announce(transition, &e.to_string());
                }
            }
        }
    }
}

/// The background service that keeps the link connected.
pub struct Keeper(Arc<Link>);

#[async_trait]
impl BackgroundService for Keeper {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        self.0.keep(&mut shutdown).await;
    }
}

impl Keeper {
    /// Runs it on the current runtime, until `shutdown` (for tests and tools).
    pub async fn run(&self, mut shutdown: ShutdownWatch) {
        self.0.keep(&mut shutdown).await;
    }
}

/// Messages on the channels subscribed to, in the order Redis sent them.
pub struct Subscription {
    link: Arc<Link>,
    generation: u64,
    messages: redis::aio::PubSubStream,
}

impl Subscription {
    /// The next message: its channel and its payload. An error when the connection broke
    /// (the link is down then).
    pub async fn next(&mut self) -> Result<(Channel, String), Failed> {
        loop {
            let Some(m) = self.messages.next().await else {
                let failed = Failed::Broken("the subscription's connection closed".into());
                self.link.fail(self.generation, &failed);
                return Err(failed);
            };
            if let Some(channel) = Channel::from_name(m.get_channel_name()) {
                return Ok((channel, m.get_payload().unwrap_or_default()));
            }
        }
    }
}

/// Waits until the link is up, and returns its generation.
pub async fn up(status: &mut watch::Receiver<Status>) -> u64 {
    loop {
        let s = *status.borrow_and_update();
        if s.up {
            return s.generation;
        }
        if status.changed().await.is_err() {
            // The link is gone: it never comes up again.
            std::future::pending::<()>().await;
        }
    }
}
