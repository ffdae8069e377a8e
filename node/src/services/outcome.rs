//! What an apply did to each pod (`ApplyReport`), as `services apply` and the installer's
//! socket answer it: made by the engine, told by the apply.

use aether_rules::services::Applied;
use serde_json::Value;

use crate::PodError;

/// One pod's outcome in an apply.
#[derive(Debug)]
pub struct PodOutcome {
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    /// `Err(PodError::Gone)`: the netns is gone, the pod was skipped, which is not a failure.
    pub result: Result<Applied, PodError>,
}

impl PodOutcome {
    /// The pod's netns is gone: skipped, not failed.
    pub fn vanished(&self) -> bool {
        matches!(self.result, Err(PodError::Gone(_)))
    }
}

#[derive(Debug)]
pub struct ApplyReport {
    pub generation: u64,
    pub pods: Vec<PodOutcome>,
    /// What was wrong but did not stop the apply (e.g. a stored snapshot that no longer
    /// parses, replaced by this one).
    pub warnings: Vec<String>,
}

impl ApplyReport {
    pub fn failed(&self) -> bool {
        self.pods.iter().any(|p| p.result.is_err() && !p.vanished())
    }

    pub fn to_json(&self) -> Value {
        serde_json::to_value(self.view()).expect("a report serializes")
    }

    /// `to_json` as pretty text (what `services apply` prints), written without building
    /// the JSON value first (the installer answers one for every change).
    pub fn to_pretty_text(&self) -> String {
        serde_json::to_string_pretty(&self.view()).expect("a report serializes")
    }

    /// The pods by the first word of their result, `elements=98 rebuilt=2`; `none`.
    pub fn pods_by_result(&self) -> String {
        let mut by: std::collections::BTreeMap<&str, usize> = Default::default();
        for p in &self.pods {
            let word = match &p.result {
                Ok(a) => describe_word(a),
                Err(_) if p.vanished() => "skipped",
                Err(_) => "failed",
            };
            *by.entry(word).or_default() += 1;
        }
        if by.is_empty() {
            return "none".into();
        }
        by.iter().map(|(k, n)| format!("{k}={n}")).collect::<Vec<_>>().join(" ")
    }

    fn view(&self) -> ReportView<'_> {
        let pods = self
            .pods
            .iter()
            .map(|p| {
                let (result, reason, error) = match &p.result {
                    Ok(a) => (describe(a), None, None),
                    Err(e) if p.vanished() => ("skipped".into(), Some(e.to_string()), None),
                    Err(e) => ("failed".into(), None, Some(e.to_string())),
                };
                PodView { container_id: &p.container_id, error, ifname: &p.ifname, netns: &p.netns, reason, result }
            })
            .collect();
        ReportView { generation: self.generation, pods, warnings: &self.warnings }
    }
}

/// The report as JSON. Members in the order a JSON object value keeps them (by name), so
/// the text is the same whether written from this or from `to_json`'s value.
#[derive(serde::Serialize)]
struct ReportView<'a> {
    generation: u64,
    pods: Vec<PodView<'a>>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

#[derive(serde::Serialize)]
struct PodView<'a> {
    #[serde(rename = "containerID")]
    container_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    ifname: &'a str,
    netns: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    result: String,
}

/// The first word of `describe` (all of it but for an element change), without making text.
fn describe_word(a: &Applied) -> &'static str {
    match a {
        Applied::Rebuilt => "rebuilt",
        Applied::Elements { .. } => "elements",
        Applied::Unchanged => "unchanged",
        Applied::Removed(true) => "removed",
        Applied::Removed(false) => "off",
    }
}

pub(super) fn describe(a: &Applied) -> String {
    match a {
        Applied::Elements { added, removed } => format!("elements +{added} -{removed}"),
        a => describe_word(a).into(),
    }
}
