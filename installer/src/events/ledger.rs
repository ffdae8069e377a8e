//! Aggregation and pacing, as pure code over explicit times (the sender task drives them):
//! the ledger keeps one Event per (subject, reason), creates it once and writes its repeats as
//! a series count, as Kubernetes' recorder does; the token bucket spaces the API writes.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::events::v1::Event;

use super::body::{event_body, event_name, namespace_of, series_patch};
use super::NodeEvent;

/// Attempts at one write the API did not answer (unreachable, timed out, 5xx) before the
/// Event is dropped.
pub const MAX_ATTEMPTS: u32 = 3;

type Key = (String, &'static str);

#[derive(Debug)]
struct Entry {
    event: NodeEvent,
    /// The Event's name once created.
    name: Option<String>,
    first: SystemTime,
    last: SystemTime,
    /// Occurrences seen, and as the API knows them.
    count: u32,
    sent: u32,
    last_seen: Instant,
    /// No series write before this (the refresh period after the last one).
    refresh_at: Instant,
    /// No write at all before this (backoff after a failure).
    not_before: Instant,
    failures: u32,
    in_flight: bool,
    /// Arrival order: the oldest due Event is written first.
    seq: u64,
}

impl Entry {
    /// When this entry wants a write, if it does.
    fn due(&self) -> Option<Instant> {
        if self.in_flight {
            return None;
        }
        match &self.name {
            None => Some(self.not_before),
            Some(_) if self.count > self.sent => {
                // The second occurrence is written at once; later ones at the refresh period.
                Some(if self.sent <= 1 { self.not_before } else { self.not_before.max(self.refresh_at) })
            }
            Some(_) => None,
        }
    }
}

/// One API write the ledger wants.
#[derive(Debug, Clone)]
pub enum Write {
    Create { key: Key, namespace: String, body: Box<Event>, count: u32 },
    Patch { key: Key, namespace: String, name: String, patch: serde_json::Value, count: u32 },
}

impl Write {
    pub fn key(&self) -> &Key {
        match self {
            Write::Create { key, .. } | Write::Patch { key, .. } => key,
        }
    }

    pub fn verb(&self) -> &'static str {
        match self {
            Write::Create { .. } => "create",
            Write::Patch { .. } => "patch",
        }
    }
}

/// How the API answered a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOutcome {
    Done,
    /// 404 on a patch: the Event expired (the API keeps Events an hour): created again.
    Gone,
    /// 409 on a create: the name is taken; created again under a new one.
    NameTaken,
    /// No answer, or one worth retrying (timeout, 5xx, 429): retried after a backoff, up to
    /// [`MAX_ATTEMPTS`].
    Retry,
    /// The API refused it for good (403, 422...): dropped, for this why (a metric label).
    Refused(&'static str),
}

/// What [`Ledger::record`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    New,
    Repeat,
    /// The ledger is full of Events still to be written: dropped.
    Full,
}

pub struct Ledger {
    entries: HashMap<Key, Entry>,
    capacity: usize,
    refresh: Duration,
    window: Duration,
    node: String,
    seq: u64,
}

impl Ledger {
    pub fn new(node: &str, capacity: usize, refresh: Duration, window: Duration) -> Ledger {
        Ledger { entries: HashMap::new(), capacity: capacity.max(1), refresh, window, node: node.to_string(), seq: 0 }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// An occurrence of `event`: a new Event, or one more of a known one (its note updated).
    pub fn record(&mut self, event: NodeEvent, now: Instant, wall: SystemTime) -> Recorded {
        let key = event.key();
        if let Some(e) = self.entries.get_mut(&key) {
            e.count += 1;
            e.last = wall;
            e.last_seen = now;
            e.event = event;
            return Recorded::Repeat;
        }
        if self.entries.len() >= self.capacity && !self.evict_one() {
            return Recorded::Full;
        }
        self.seq += 1;
        let entry = Entry {
            event,
            name: None,
            first: wall,
            last: wall,
            count: 1,
            sent: 0,
            last_seen: now,
            refresh_at: now,
            not_before: now,
            failures: 0,
            in_flight: false,
            seq: self.seq,
        };
        self.entries.insert(key, entry);
        Recorded::New
    }

    /// Makes room by forgetting the Event seen longest ago among those with nothing left to
    /// write; false when every one still has something to write.
    fn evict_one(&mut self) -> bool {
        let oldest = self
            .entries
            .iter()
            .filter(|(_, e)| e.due().is_none() && !e.in_flight)
            .min_by_key(|(_, e)| e.last_seen)
            .map(|(k, _)| k.clone());
        match oldest {
            Some(k) => self.entries.remove(&k).is_some(),
            None => false,
        }
    }

    /// Forgets the Events not seen for the series window that have nothing left to write
    /// (a later occurrence makes a new Event, as Kubernetes' recorder does).
    pub fn expire(&mut self, now: Instant) {
        let window = self.window;
        self.entries
            .retain(|_, e| e.in_flight || e.due().is_some() || now.saturating_duration_since(e.last_seen) < window);
    }

    /// The earliest time a write is due, if any is.
    pub fn next_due(&self) -> Option<Instant> {
        self.entries.values().filter_map(Entry::due).min()
    }

    /// The write due now that arrived first, marked in flight until [`Ledger::finish`].
    pub fn next_write(&mut self, now: Instant, wall: SystemTime) -> Option<Write> {
        let (key, entry) =
            self.entries.iter_mut().filter(|(_, e)| e.due().is_some_and(|d| d <= now)).min_by_key(|(_, e)| e.seq)?;
        entry.in_flight = true;
        let (key, count) = (key.clone(), entry.count);
        let namespace = namespace_of(&entry.event.regarding());
        let count_i32 = i32::try_from(count).unwrap_or(i32::MAX);
        Some(match &entry.name {
            None => {
                let name = event_name(&entry.event, &self.node, wall);
                let series = (count > 1).then_some((count_i32, entry.last));
                let body = event_body(&entry.event, &self.node, &name, entry.first, series);
                Write::Create { key, namespace, body: Box::new(body), count }
            }
            Some(name) => {
                Write::Patch { key, namespace, name: name.clone(), patch: series_patch(count_i32, entry.last), count }
            }
        })
    }

    /// The API's answer to `write`; `Some(why)` when the Event was dropped.
    pub fn finish(&mut self, write: &Write, outcome: WriteOutcome, now: Instant) -> Option<&'static str> {
        let entry = self.entries.get_mut(write.key())?;
        entry.in_flight = false;
        match outcome {
            WriteOutcome::Done => {
                if let Write::Create { body, .. } = write {
                    entry.name = body.metadata.name.clone();
                }
                entry.sent = match write {
                    Write::Create { count, .. } | Write::Patch { count, .. } => *count,
                };
                entry.failures = 0;
                entry.refresh_at = now + self.refresh;
                None
            }
            WriteOutcome::Gone | WriteOutcome::NameTaken => {
                entry.name = None;
                None
            }
            WriteOutcome::Retry => {
                entry.failures += 1;
                if entry.failures >= MAX_ATTEMPTS {
                    self.entries.remove(write.key());
                    return Some("unanswered");
                }
                entry.not_before = now + Duration::from_secs(1 << entry.failures);
                None
            }
            WriteOutcome::Refused(why) => {
                self.entries.remove(write.key());
                Some(why)
            }
        }
    }
}

/// At most `rate` writes per second, one at a time (a burst of one: never more than one write
/// in any 1/rate interval).
#[derive(Debug)]
pub struct TokenBucket {
    interval: Duration,
    next: Instant,
}

impl TokenBucket {
    pub fn new(rate: f64, now: Instant) -> TokenBucket {
        let rate = if rate.is_finite() && rate > 0.0 { rate } else { 1.0 };
        TokenBucket { interval: Duration::from_secs_f64(1.0 / rate), next: now }
    }

    /// Takes the token if it is there.
    pub fn try_take(&mut self, now: Instant) -> bool {
        if now < self.next {
            return false;
        }
        self.next = now + self.interval;
        true
    }

    /// When the next token is there.
    pub fn ready_at(&self) -> Instant {
        self.next
    }
}
