//! The Events' metrics, registered in the installer's registry (`serve::Metrics`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::{IntCounterVec, IntGauge, Opts, Registry};

/// Every why an Event is dropped, for the metric's series.
pub const DROP_WHYS: [&str; 8] =
    ["queue-full", "ledger-full", "stopped", "unanswered", "forbidden", "unauthorized", "rejected", "unconfigured"];

/// At most one log line about dropped Events per this long.
const DROP_LOG_EVERY: Duration = Duration::from_secs(60);

pub struct EventMetrics {
    /// API writes by verb (create, patch) and result (ok, error).
    pub writes: IntCounterVec,
    /// Events dropped, by why.
    pub drops: IntCounterVec,
    /// Occurrences folded into an Event already known (no write of their own).
    pub aggregated: prometheus::IntCounter,
    /// Distinct Events remembered now.
    pub ledger: IntGauge,
    /// Drops since the last log line, and when that line was.
    unlogged: AtomicU64,
    logged_at: Mutex<Option<Instant>>,
}

impl EventMetrics {
    pub fn new() -> Self {
        let writes = IntCounterVec::new(
            Opts::new(
                "aether_cni_installer_event_writes_total",
                "Kubernetes API writes of Events (events.k8s.io/v1), by verb (create: a new Event; patch: a repeat's series count) and result (ok, error).",
            ),
            &["verb", "result"],
        )
        .unwrap();
        let drops = IntCounterVec::new(
            Opts::new(
                "aether_cni_installer_events_dropped_total",
                "Events not written, by why: queue-full (the sender is behind), ledger-full (too many Events still to write), stopped, unanswered (no answer, a 5xx or a 429, after retries), forbidden (403), unauthorized (401), rejected (the API refused the body), unconfigured (no client: see the log).",
            ),
            &["why"],
        )
        .unwrap();
        let aggregated = prometheus::IntCounter::new(
            "aether_cni_installer_events_aggregated_total",
            "Occurrences folded into an Event already written or pending (its series count), without a write of their own.",
        )
        .unwrap();
        let ledger = IntGauge::new(
            "aether_cni_installer_events_remembered",
            "Distinct Events (pod or node, reason) remembered for aggregation.",
        )
        .unwrap();
        for why in DROP_WHYS {
            drops.with_label_values(&[why]);
        }
        for verb in ["create", "patch"] {
            for result in ["ok", "error"] {
                writes.with_label_values(&[verb, result]);
            }
        }
        EventMetrics { writes, drops, aggregated, ledger, unlogged: AtomicU64::new(0), logged_at: Mutex::new(None) }
    }

    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.writes.clone()))?;
        registry.register(Box::new(self.drops.clone()))?;
        registry.register(Box::new(self.aggregated.clone()))?;
        registry.register(Box::new(self.ledger.clone()))?;
        Ok(())
    }

    /// One Event dropped: counted, and logged at most once a minute (with how many since).
    pub fn dropped(&self, why: &'static str) {
        self.drops.with_label_values(&[why]).inc();
        let n = self.unlogged.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let mut at = self.logged_at.lock().unwrap_or_else(|e| e.into_inner());
        if at.is_none_or(|t| now.saturating_duration_since(t) >= DROP_LOG_EVERY) {
            *at = Some(now);
            self.unlogged.fetch_sub(n, Ordering::Relaxed);
            tracing::warn!(
                why,
                "Kubernetes Events dropped: {n} since the last such line (aether_cni_installer_events_dropped_total); \
                 the node's work goes on without them"
            );
        }
    }

    pub fn dropped_total(&self) -> u64 {
        DROP_WHYS.iter().map(|w| self.drops.with_label_values(&[w]).get()).sum()
    }
}

impl Default for EventMetrics {
    fn default() -> Self {
        Self::new()
    }
}
