//! The reconciler's metrics, registered in the installer's registry (`serve::Metrics`).

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::{action_kind, Action, Leftover, Outcome, PassReport, PodState};

pub struct ReconcileMetrics {
    /// Pods by state in the last pass.
    pub pods: IntGaugeVec,
    /// Actions by kind (restart, capture, repair, repair-services, migrate, collect) and outcome (done, failed).
    pub actions: IntCounterVec,
    /// Leftovers collected, by why (sandbox-gone, netns-gone).
    pub leftovers: IntCounterVec,
    pub pass_seconds: Histogram,
    pub last_pass: IntGauge,
    /// 1 when the last pass read the runtime's pod list: 0 means missed pods cannot be seen.
    pub runtime_up: IntGauge,
    pub passes: IntCounterVec,
    /// Refusals by kind, counted once when each starts.
    pub refusals: IntCounterVec,
    /// 1 while the runtime's list is suspect (see `plan::suspect_list`).
    pub runtime_suspect: IntGauge,
}

impl ReconcileMetrics {
    pub fn new() -> Self {
        let pods = IntGaugeVec::new(
            Opts::new(
                "aether_cni_reconciler_pods",
                "Pods by state in the reconciler's last pass: captured, missed (no capture, should have one), drifted (its netns differs from its record), excluded (namespace), disabled (capture off), invalid (annotations ADD refuses), host-network, not-ready, unverifiable, leftover.",
            ),
            &["state"],
        )
        .unwrap();
        let actions = IntCounterVec::new(
            Opts::new(
                "aether_cni_reconciler_actions_total",
                "Reconciler actions by kind (restart: sandbox stopped through the CRI; capture: missed pod captured in place; repair: drift repaired to the record; repair-services: a Service layer rebuilt to the stored snapshot; migrate: a pod's capture ruleset of an earlier release replaced with the current one; collect: leftover record collected) and outcome (done; failed; moot: nothing left to do when it came to it, the record gone or changed, the layer found as stored; refused: the netns is another record's).",
            ),
            &["kind", "outcome"],
        )
        .unwrap();
        let leftovers = IntCounterVec::new(
            Opts::new(
                "aether_cni_reconciler_leftovers_collected_total",
                "Attachment records collected as GC collects them, by why: sandbox-gone (the runtime no longer has it) or netns-gone.",
            ),
            &["why"],
        )
        .unwrap();
        let pass_seconds = Histogram::with_opts(
            HistogramOpts::new("aether_cni_reconciler_pass_seconds", "Wall time of one reconciler pass.")
                .buckets(vec![0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]),
        )
        .unwrap();
        let last_pass = IntGauge::new(
            "aether_cni_reconciler_last_pass_timestamp_seconds",
            "When the reconciler's last pass ended (Unix time; 0: none yet).",
        )
        .unwrap();
        let runtime_up = IntGauge::new(
            "aether_cni_reconciler_runtime_up",
            "1 when the last pass read the runtime's pod list over the CRI socket; 0: missed pods cannot be seen (drift and leftovers are still handled).",
        )
        .unwrap();
        let passes = IntCounterVec::new(
            Opts::new("aether_cni_reconciler_passes_total", "Reconciler passes, by trigger (period, ready, start)."),
            &["trigger"],
        )
        .unwrap();
        let refusals = IntCounterVec::new(
            Opts::new(
                "aether_cni_reconciler_refusals_total",
                "Things the reconciler refused to do, counted once when each starts, by kind (suspect-list: the runtime's pod list is not believed; netns-owned: a sandbox names a netns another record owns; drift-fought: a pod repaired too often in a window, backed off).",
            ),
            &["kind"],
        )
        .unwrap();
        let runtime_suspect = IntGauge::new(
            "aether_cni_reconciler_runtime_list_suspect",
            "1 when the last pass did not believe the runtime's pod list (empty, or lacking most pods whose netns lives): nothing is collected or restarted from it.",
        )
        .unwrap();
        for kind in super::REFUSAL_KINDS {
            refusals.with_label_values(&[kind]);
        }
        for s in PodState::ALL {
            pods.with_label_values(&[s.name()]);
        }
        for kind in ["restart", "capture", "repair", "repair-services", "migrate", "collect"] {
            for outcome in Outcome::NAMES {
                actions.with_label_values(&[kind, outcome]);
            }
        }
        for why in ["sandbox-gone", "netns-gone"] {
            leftovers.with_label_values(&[why]);
        }
        ReconcileMetrics {
            pods,
            actions,
            leftovers,
            pass_seconds,
            last_pass,
            runtime_up,
            passes,
            refusals,
            runtime_suspect,
        }
    }

    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.pods.clone()))?;
        registry.register(Box::new(self.actions.clone()))?;
        registry.register(Box::new(self.leftovers.clone()))?;
        registry.register(Box::new(self.pass_seconds.clone()))?;
        registry.register(Box::new(self.last_pass.clone()))?;
        registry.register(Box::new(self.runtime_up.clone()))?;
        registry.register(Box::new(self.passes.clone()))?;
        registry.register(Box::new(self.refusals.clone()))?;
        registry.register(Box::new(self.runtime_suspect.clone()))?;
        Ok(())
    }

    pub fn observe(&self, report: &PassReport, trigger: &str) {
        for s in PodState::ALL {
            self.pods.with_label_values(&[s.name()]).set(report.count(s) as i64);
        }
        for (action, outcome) in &report.actions {
            let done = matches!(outcome, Outcome::Done);
            self.actions.with_label_values(&[action_kind(action), outcome.name()]).inc();
            if let (Action::Collect { why, .. }, true) = (action, done) {
                let why = match why {
                    Leftover::SandboxGone => "sandbox-gone",
                    Leftover::NetnsGone(_) => "netns-gone",
                };
                self.leftovers.with_label_values(&[why]).inc();
            }
        }
        self.pass_seconds.observe(report.took.as_secs_f64());
        let at = report.finished.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.last_pass.set(at as i64);
        self.runtime_up.set(i64::from(report.runtime_unseen.is_none()));
        self.passes.with_label_values(&[trigger]).inc();
        for r in report.refusals.iter().filter(|r| r.new) {
            self.refusals.with_label_values(&[r.kind]).inc();
        }
        self.runtime_suspect.set(i64::from(report.refusals.iter().any(|r| r.kind == "suspect-list")));
    }
}

impl Default for ReconcileMetrics {
    fn default() -> Self {
        Self::new()
    }
}
