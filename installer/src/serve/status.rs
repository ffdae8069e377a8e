//! What the installer's HTTP face reports: readiness (each not-ready reason) and the
//! installer's metrics registry, shared by the installer's loops and read by the server.

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::error::Reason;

/// What a listener answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Face {
    /// `/healthz`, `/readyz` and `/metrics` (loopback: the kubelet's probes).
    Probes,
    /// `/metrics` only (the node's address: Prometheus).
    Metrics,
    /// `POST /services/apply` (the node agent, on a unix socket: `services_socket`).
    Services,
}

impl Face {
    pub const ALL: [Face; 3] = [Face::Probes, Face::Metrics, Face::Services];

    pub fn name(self) -> &'static str {
        match self {
            Face::Probes => "probes",
            Face::Metrics => "metrics",
            Face::Services => "services",
        }
    }
}

/// What the HTTP face reports: the installation's status as last published (its marker
/// written first), so `/readyz` never says ready while CNI STATUS says not, nor the reverse.
#[derive(Debug, Default, Clone)]
pub struct Status {
    pub not_ready: BTreeMap<Reason, String>,
}

impl Status {
    /// The `/readyz` body and the marker's content: one `reason: detail` line each.
    pub fn describe(&self) -> String {
        self.not_ready.iter().map(|(r, why)| format!("{}: {why}\n", r.name())).collect()
    }
}

pub struct Metrics {
    registry: Registry,
    pub installs: IntCounterVec,
    pub repairs: IntCounterVec,
    pub errors: IntCounterVec,
    pub ready: IntGauge,
    pub not_ready: IntGaugeVec,
    pub last_error: IntGaugeVec,
    pub last_error_time: IntGauge,
    pub repair_seconds: Histogram,
    /// The reconciler's (registered here, observed by its thread).
    pub reconcile: crate::reconcile::metrics::ReconcileMetrics,
    /// Open HTTP connections, by listener (`probes`, `metrics`).
    pub http_connections: IntGaugeVec,
    /// HTTP connections closed by the connection limit, by listener and how: `refused` (the
    /// newcomer, closed at once) or `evicted` (an older one that had not sent its request).
    pub http_limited: IntCounterVec,
    /// Failed accepts (out of file descriptors, aborted connections...), by listener.
    pub http_accept_errors: IntCounterVec,
    /// The Service layer's socket (registered here, observed by its applier thread).
    pub services: std::sync::Arc<crate::services_socket::ServicesMetrics>,
    /// Kubernetes Events (registered here, observed by their sender task).
    pub events: std::sync::Arc<crate::events::EventMetrics>,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let installs = IntCounterVec::new(
            Opts::new(
                "aether_cni_installer_installs_total",
                "Files written on a node that did not have them yet (what: binary or conflist).",
            ),
            &["what"],
        )
        .unwrap();
        let repairs = IntCounterVec::new(
            Opts::new("aether_cni_installer_repairs_total", "Files rewritten after they were installed, because they were changed or removed, or the primary configuration changed (what: binary or conflist)."),
            &["what"],
        )
        .unwrap();
        let errors = IntCounterVec::new(
            Opts::new(
                "aether_cni_installer_errors_total",
                "Reconcile passes that ended in an error, by not-ready reason.",
            ),
            &["reason"],
        )
        .unwrap();
        let ready = IntGauge::new(
            "aether_cni_installer_ready",
            "1 when the plugin is installed, chained and the kernel checks pass.",
        )
        .unwrap();
        let not_ready = IntGaugeVec::new(
            Opts::new("aether_cni_installer_not_ready", "1 for each reason the node is not ready."),
            &["reason"],
        )
        .unwrap();
        let last_error = IntGaugeVec::new(
            Opts::new(
                "aether_cni_installer_last_error",
                "The last error, as a label (one series; 1 while it is the latest).",
            ),
            &["reason", "message"],
        )
        .unwrap();
        let last_error_time = IntGauge::new(
            "aether_cni_installer_last_error_timestamp_seconds",
            "When the last error happened (Unix time; 0: never).",
        )
        .unwrap();
        let repair_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "aether_cni_installer_repair_seconds",
                "From a change seen in the conf or bin directory to the file written back.",
            )
            .buckets(vec![0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0]),
        )
        .unwrap();
        let http_connections = IntGaugeVec::new(
            Opts::new("aether_cni_installer_http_connections", "Open HTTP connections, by listener."),
            &["listener"],
        )
        .unwrap();
        let http_limited = IntCounterVec::new(
            Opts::new(
                "aether_cni_installer_http_connections_limited_total",
                "HTTP connections closed by the connection limit: the newcomer (refused) or an older one that had not sent its request (evicted).",
            ),
            &["listener", "how"],
        )
        .unwrap();
        let http_accept_errors = IntCounterVec::new(
            Opts::new(
                "aether_cni_installer_http_accept_errors_total",
                "Failed accepts of HTTP connections (out of file descriptors, aborted connections...), retried.",
            ),
            &["listener"],
        )
        .unwrap();
        for c in [
            Box::new(installs.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(repairs.clone()),
            Box::new(errors.clone()),
            Box::new(ready.clone()),
            Box::new(not_ready.clone()),
            Box::new(last_error.clone()),
            Box::new(last_error_time.clone()),
            Box::new(repair_seconds.clone()),
            Box::new(http_connections.clone()),
            Box::new(http_limited.clone()),
            Box::new(http_accept_errors.clone()),
        ] {
            registry.register(c).unwrap();
        }
        for what in ["binary", "conflist"] {
            installs.with_label_values(&[what]);
            repairs.with_label_values(&[what]);
        }
        for r in Reason::ALL {
            not_ready.with_label_values(&[r.name()]);
        }
        let reconcile = crate::reconcile::metrics::ReconcileMetrics::new();
        reconcile.register(&registry).unwrap();
        let services = std::sync::Arc::new(crate::services_socket::ServicesMetrics::new());
        services.register(&registry).unwrap();
        let events = std::sync::Arc::new(crate::events::EventMetrics::new());
        events.register(&registry).unwrap();
        for face in Face::ALL {
            http_connections.with_label_values(&[face.name()]);
            http_accept_errors.with_label_values(&[face.name()]);
            for how in ["refused", "evicted"] {
                http_limited.with_label_values(&[face.name(), how]);
            }
        }
        Metrics {
            registry,
            installs,
            repairs,
            errors,
            ready,
            not_ready,
            last_error,
            last_error_time,
            repair_seconds,
            reconcile,
            http_connections,
            http_limited,
            http_accept_errors,
            services,
            events,
        }
    }

    /// Mirrors `status` into the gauges.
    pub fn set_status(&self, status: &Status) {
        self.ready.set(i64::from(status.not_ready.is_empty()));
        for r in Reason::ALL {
            self.not_ready.with_label_values(&[r.name()]).set(i64::from(status.not_ready.contains_key(&r)));
        }
    }

    pub fn record_error(&self, reason: Reason, message: &str) {
        self.errors.with_label_values(&[reason.name()]).inc();
        self.last_error.reset();
        let short: String = message.chars().take(200).collect();
        self.last_error.with_label_values(&[reason.name(), &short]).set(1);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.last_error_time.set(now as i64);
    }

    /// The installer's metrics in Prometheus text.
    pub fn encode(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut out).expect("text encoding into memory");
        String::from_utf8(out).expect("the text encoder writes UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The shared state the HTTP thread reads.
pub struct Shared {
    pub status: Mutex<Status>,
    pub metrics: Metrics,
    /// Kubernetes Events: off until `daemon::run` starts them.
    pub events: crate::events::Events,
}

impl Shared {
    /// Not ready (`starting`) until the first pass ends.
    pub fn new() -> Shared {
        let mut status = Status::default();
        status.not_ready.insert(Reason::Starting, "the first pass has not finished".into());
        let metrics = Metrics::new();
        let events = crate::events::Events::new(metrics.events.clone());
        Shared { status: Mutex::new(status), metrics, events }
    }
}

impl Default for Shared {
    fn default() -> Self {
        Self::new()
    }
}
