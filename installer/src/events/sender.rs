//! The sender task: events from the bounded channel into the ledger, and the ledger's writes
//! to the API through kube's client, one per token of the bucket, each within the request
//! timeout. Whatever the API does (no answer, 401, 403, 429, a dropped connection) costs this
//! task alone: the channel is bounded, the ledger is bounded, and a write is never retried
//! without end.

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::events::v1::Event;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client, Config};
use tokio::sync::mpsc;

use super::ledger::{Ledger, Recorded, TokenBucket, Write, WriteOutcome};
use super::metrics::EventMetrics;
use super::{NodeEvent, Settings};

/// How long every write waits after the API said 401 or 403 (a token not yet mounted or
/// rotated, RBAC not yet bound), and after a 429 without Retry-After.
const PAUSE_REFUSED: Duration = Duration::from_secs(30);
const PAUSE_THROTTLED: Duration = Duration::from_secs(10);

/// Why the client cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the API server address {address:?} is not a URL: {why}")]
    Address { address: String, why: String },
    #[error("cannot make the Kubernetes client for {address}: {source}")]
    Client { address: String, source: Box<kube::Error> },
}

/// kube's client for `settings`: the token file (re-read as the kubelet rotates it), the CA
/// file, the request timeout; no retries of its own (the ledger retries, within its bounds).
pub fn client(settings: &Settings) -> Result<Client, ClientError> {
    let address = settings.api_server.clone();
    let url = address
        .parse::<hyper::Uri>()
        .map_err(|e| ClientError::Address { address: address.clone(), why: e.to_string() })?;
    let mut config = Config::new(url);
    // Re-read as the cluster's CA rotates (kube's verifier for an in-cluster CA file).
    config.root_cert_file = settings.ca_file.clone();
    config.auth_info.token_file = settings.token_file.as_ref().map(|p| p.display().to_string());
    config.connect_timeout = Some(settings.request_timeout);
    config.read_timeout = Some(settings.request_timeout);
    config.write_timeout = Some(settings.request_timeout);
    config.default_retry = false;
    Client::try_from(config).map_err(|source| ClientError::Client { address, source: Box::new(source) })
}

/// The task: runs until the channel closes (the installer stops).
pub async fn run(mut rx: mpsc::Receiver<NodeEvent>, settings: Settings, metrics: std::sync::Arc<EventMetrics>) {
    let client = match client(&settings) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("Kubernetes Events are off: {e}");
            while rx.recv().await.is_some() {
                metrics.dropped("unconfigured");
            }
            return;
        }
    };
    let mut ledger = Ledger::new(&settings.node_name, settings.ledger, settings.series_refresh, settings.series_window);
    let mut bucket = TokenBucket::new(settings.writes_per_second, Instant::now());
    let mut paused_until = Instant::now();
    loop {
        let wake = ledger.next_due().map(|due| due.max(bucket.ready_at()).max(paused_until));
        let received = match wake {
            Some(at) => tokio::select! {
                m = rx.recv() => Some(m),
                _ = tokio::time::sleep_until(at.into()) => None,
            },
            None => Some(rx.recv().await),
        };
        let mut record = |e: NodeEvent| match ledger.record(e, Instant::now(), SystemTime::now()) {
            Recorded::New => {}
            Recorded::Repeat => metrics.aggregated.inc(),
            Recorded::Full => metrics.dropped("ledger-full"),
        };
        match received {
            Some(None) => return,
            Some(Some(e)) => record(e),
            None => {}
        }
        while let Ok(e) = rx.try_recv() {
            record(e);
        }
        let now = Instant::now();
        ledger.expire(now);
        metrics.ledger.set(ledger.len() as i64);
        if now < paused_until || ledger.next_due().is_none_or(|d| d > now) || !bucket.try_take(now) {
            continue;
        }
        let Some(write) = ledger.next_write(now, SystemTime::now()) else { continue };
        let (outcome, pause) = send(&client, &write, settings.request_timeout).await;
        let result = if outcome == WriteOutcome::Done { "ok" } else { "error" };
        metrics.writes.with_label_values(&[write.verb(), result]).inc();
        if let Some(p) = pause {
            paused_until = Instant::now() + p;
        }
        if let Some(why) = ledger.finish(&write, outcome, Instant::now()) {
            metrics.dropped(why);
        }
        metrics.ledger.set(ledger.len() as i64);
    }
}

/// One write, within `timeout`: how it went, and how long every write should now wait.
async fn send(client: &Client, write: &Write, timeout: Duration) -> (WriteOutcome, Option<Duration>) {
    let call = async {
        match write {
            Write::Create { namespace, body, .. } => {
                let api: Api<Event> = Api::namespaced(client.clone(), namespace);
                api.create(&PostParams::default(), body).await.map(|_| ())
            }
            Write::Patch { namespace, name, patch, .. } => {
                let api: Api<Event> = Api::namespaced(client.clone(), namespace);
                api.patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.map(|_| ())
            }
        }
    };
    let answer = match tokio::time::timeout(timeout, call).await {
        Ok(a) => a,
        Err(_) => return (WriteOutcome::Retry, None),
    };
    match answer {
        Ok(()) => (WriteOutcome::Done, None),
        Err(kube::Error::Api(status)) => match (status.code, write) {
            (404, Write::Patch { .. }) => (WriteOutcome::Gone, None),
            (409, Write::Create { .. }) => (WriteOutcome::NameTaken, None),
            (401, _) => (WriteOutcome::Refused("unauthorized"), Some(PAUSE_REFUSED)),
            // A namespace being deleted refuses new objects with a 403: that pod's Event
            // only, not the token's rights, so nothing else waits.
            (403, _) if status.message.contains("being terminated") => (WriteOutcome::Refused("rejected"), None),
            (403, _) => (WriteOutcome::Refused("forbidden"), Some(PAUSE_REFUSED)),
            (429, _) => (WriteOutcome::Retry, Some(PAUSE_THROTTLED)),
            (c, _) if c >= 500 => (WriteOutcome::Retry, None),
            _ => (WriteOutcome::Refused("rejected"), None),
        },
        // No answer: refused or dropped connection, TLS, a body that is no Status.
        Err(e) => {
            tracing::debug!(verb = write.verb(), "an Event's write had no answer: {e}");
            (WriteOutcome::Retry, None)
        }
    }
}
