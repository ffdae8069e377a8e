//! The installer's readiness and its metrics, and the HTTP face that serves them:
//! `/healthz` (the process runs), `/readyz` (200, or 503 naming each not-ready reason),
//! `/metrics` (Prometheus text 0.0.4: the installer's own metrics, then the Service layer's
//! node counters rendered by the plugin).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::{Error, NodeChecks};

/// Why the node is not ready, one per part of the installation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// The installer has not finished its first pass.
    Starting,
    /// The binary is not (yet) in the CNI bin directory.
    Binary,
    /// No usable primary configuration to chain onto (missing, invalid, outranked...).
    Primary,
    /// The plugin's parser refuses the entry (a node setting, or the list's cniVersion).
    Entry,
    /// The chained conflist could not be written.
    Chain,
    /// doctor's kernel checks fail.
    Kernel,
    /// Stopped: the entry and binary were removed.
    Uninstalled,
}

impl Reason {
    pub const ALL: [Reason; 7] = [
        Reason::Starting,
        Reason::Binary,
        Reason::Primary,
        Reason::Entry,
        Reason::Chain,
        Reason::Kernel,
        Reason::Uninstalled,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Reason::Starting => "starting",
            Reason::Binary => "binary",
            Reason::Primary => "primary",
            Reason::Entry => "entry",
            Reason::Chain => "chain",
            Reason::Kernel => "kernel",
            Reason::Uninstalled => "uninstalled",
        }
    }
}

/// What the HTTP face reports; the reconcile loop updates it.
#[derive(Debug, Default)]
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
        for c in [
            Box::new(installs.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(repairs.clone()),
            Box::new(errors.clone()),
            Box::new(ready.clone()),
            Box::new(not_ready.clone()),
            Box::new(last_error.clone()),
            Box::new(last_error_time.clone()),
            Box::new(repair_seconds.clone()),
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
}

impl Shared {
    /// Not ready (`starting`) until the first pass ends.
    pub fn new() -> Shared {
        let mut status = Status::default();
        status.not_ready.insert(Reason::Starting, "the first pass has not finished".into());
        Shared { status: Mutex::new(status), metrics: Metrics::new() }
    }
}

impl Default for Shared {
    fn default() -> Self {
        Self::new()
    }
}

/// Binds `addr` now (so a bad address fails before anything is installed) and serves on a
/// thread of its own until `stop` is called on the returned handle.
pub fn start(addr: SocketAddr, shared: Arc<Shared>, hooks: Arc<dyn NodeChecks>) -> Result<Server, Error> {
    let server = tiny_http::Server::http(addr).map_err(|e| Error::Listen { addr, why: e.to_string() })?;
    let server = Arc::new(server);
    let bound = server.server_addr().to_ip().unwrap_or(addr);
    let s = server.clone();
    let thread = std::thread::Builder::new()
        .name("installer-http".into())
        .spawn(move || {
            for request in s.incoming_requests() {
                let answer = {
                    let (shared, hooks) = (shared.clone(), hooks.clone());
                    move |request: tiny_http::Request| {
                        let (code, ctype, body) = respond(request.url(), &shared, hooks.as_ref());
                        let header = tiny_http::Header::from_bytes("Content-Type", ctype).expect("a valid header");
                        let response =
                            tiny_http::Response::from_string(body).with_status_code(code).with_header(header);
                        let _ = request.respond(response);
                    }
                };
                // A scrape reads every pod's counters (it may take a while on a busy node):
                // on a thread of its own, so the kubelet's probes are never queued behind it.
                if request.url().starts_with("/metrics") {
                    let _ = std::thread::Builder::new().name("installer-scrape".into()).spawn(move || answer(request));
                } else {
                    answer(request);
                }
            }
        })
        .map_err(|e| Error::Listen { addr, why: e.to_string() })?;
    Ok(Server { server, thread: Some(thread), addr: bound })
}

fn respond(url: &str, shared: &Shared, hooks: &dyn NodeChecks) -> (u16, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    match url.split('?').next().unwrap_or("") {
        "/healthz" => (200, TEXT, "ok\n".into()),
        "/readyz" => {
            let status = shared.status.lock().unwrap();
            if status.not_ready.is_empty() {
                (200, TEXT, "ready\n".into())
            } else {
                (503, TEXT, status.describe())
            }
        }
        "/metrics" => {
            let mut body = shared.metrics.encode();
            let up = match hooks.node_counters() {
                Ok(text) => {
                    body.push_str(text.trim_end());
                    body.push('\n');
                    1
                }
                Err(e) => {
                    body.push_str(&format!(
                        "# the Service layer's node counters are unavailable: {}\n",
                        e.to_string().replace('\n', " ")
                    ));
                    0
                }
            };
            body.push_str("# HELP aether_cni_installer_node_counters_up 1 when the Service layer's node counters could be read.\n");
            body.push_str("# TYPE aether_cni_installer_node_counters_up gauge\n");
            body.push_str(&format!("aether_cni_installer_node_counters_up {up}\n"));
            (200, "text/plain; version=0.0.4; charset=utf-8", body)
        }
        _ => (404, TEXT, "not found: try /healthz, /readyz or /metrics\n".into()),
    }
}

pub struct Server {
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
