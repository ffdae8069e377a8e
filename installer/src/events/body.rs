//! An Event's body, as `events.k8s.io/v1` takes it (k8s-openapi's typed object).

use std::time::SystemTime;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

use super::{NodeEvent, Regarding};

/// The Events' `reportingController` (the API wants a `domain/name`).
pub const REPORTING_CONTROLLER: &str = "aether-cni.io/installer";
/// Events about the Node (cluster-scoped) live in `default`, as the kubelet's own do.
pub const NODE_EVENTS_NAMESPACE: &str = "default";
/// The API refuses a longer note (1 kB).
pub const NOTE_MAX_BYTES: usize = 1024;
/// The API refuses a longer `reportingInstance`.
const INSTANCE_MAX_BYTES: usize = 128;

pub(crate) fn micro_time(t: SystemTime) -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::try_from(t).unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH))
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub(crate) fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The namespace an Event about `regarding` is created in.
pub fn namespace_of(regarding: &Regarding) -> String {
    match regarding {
        Regarding::Pod(pod) if !pod.namespace.is_empty() => pod.namespace.clone(),
        _ => NODE_EVENTS_NAMESPACE.to_string(),
    }
}

/// The Event to create: `name` unique in its namespace, first seen at `first`; a series when
/// the event was seen more than once by then.
pub fn event_body(
    event: &NodeEvent,
    node: &str,
    name: &str,
    first: SystemTime,
    series: Option<(i32, SystemTime)>,
) -> Event {
    let about = event.regarding();
    let regarding = match &about {
        Regarding::Pod(pod) => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(pod.namespace.clone()),
            name: Some(pod.name.clone()),
            uid: Some(pod.uid.clone()).filter(|u| !u.is_empty()),
            ..Default::default()
        },
        // The kubelet names the Node by name and uses the name as its uid (what `kubectl
        // describe node` looks for); the installer may not read the Node to learn the real one.
        Regarding::Node => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.into()),
            uid: Some(node.into()),
            ..Default::default()
        },
    };
    Event {
        metadata: ObjectMeta { name: Some(name.into()), namespace: Some(namespace_of(&about)), ..Default::default() },
        event_time: Some(micro_time(first)),
        action: Some(event.action().into()),
        reason: Some(event.reason().into()),
        note: Some(cut(&event.note(), NOTE_MAX_BYTES)),
        type_: Some(event.event_type().into()),
        regarding: Some(regarding),
        reporting_controller: Some(REPORTING_CONTROLLER.into()),
        reporting_instance: Some(cut(node, INSTANCE_MAX_BYTES)),
        series: series.map(|(count, last)| EventSeries { count, last_observed_time: micro_time(last) }),
        ..Default::default()
    }
}

/// The merge patch that brings an Event's series to `count`, last observed at `last`.
pub fn series_patch(count: i32, last: SystemTime) -> serde_json::Value {
    let series = EventSeries { count, last_observed_time: micro_time(last) };
    serde_json::json!({ "series": series })
}

/// A name unique in the namespace, as Kubernetes' recorder makes them: the object's name and
/// the time in hex.
pub fn event_name(event: &NodeEvent, node: &str, at: SystemTime) -> String {
    let object = match event.regarding() {
        Regarding::Pod(pod) => pod.name,
        Regarding::Node => node.to_string(),
    };
    let nanos = at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    // A name is at most 253 characters: the object's part is cut to leave room for the suffix.
    format!("{}.{nanos:x}", cut(&object, 200))
}
