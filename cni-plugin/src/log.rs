//! Logs: one line per event, to stderr and, when configured, appended to `logFile`; never to
//! stdout, which carries only the CNI result.
//!
//! Built on `tracing`: a CNI invocation runs inside one span that carries the command, the
//! pod (namespace/name), the container ID, the netns and the pid, so every line names them;
//! events add what happened as words and `key=value` fields. Two formats, as node components
//! offer them (`logFormat`):
//!
//! ```text
//! 2026-11-30T19:40:01.123456Z  INFO cni{command=ADD pod=shop/cart-0 container=abc netns=/run/netns/x pid=42}: capture programmed mode=redirect-all
//! {"timestamp":"2026-11-30T19:40:01.123456Z","level":"INFO","message":"capture programmed","mode":"redirect-all","span":{"command":"ADD",...}}
//! ```
//!
//! Values are written with `Display` (`%`), never `Debug`: an operator greps for
//! `pod=shop/cart-0`, not `Some("shop")`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;

use serde_json::Value;
use tracing::level_filters::LevelFilter;
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, Registry};

/// `logLevel` as a filter; `None` for a value that is not one of [`LEVELS`].
pub fn parse_level(s: &str) -> Option<LevelFilter> {
    match s {
        "error" => Some(LevelFilter::ERROR),
        "warn" => Some(LevelFilter::WARN),
        "info" => Some(LevelFilter::INFO),
        "debug" => Some(LevelFilter::DEBUG),
        _ => None,
    }
}

pub use aether_node::config::LogFormat as Format;

/// Where logs go and how they look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub file: Option<PathBuf>,
    pub level: LevelFilter,
    pub format: Format,
}

impl Default for Settings {
    fn default() -> Self {
        Settings { file: None, level: LevelFilter::INFO, format: Format::Text }
    }
}

impl Settings {
    /// Reads just `logFile`, `logLevel` and `logFormat` from a network configuration,
    /// leniently (a field that is missing or unusable keeps its default), so that a
    /// configuration the full parse refuses is still logged where the operator looks.
    pub fn lenient(stdin: &[u8]) -> Settings {
        let mut s = Settings::default();
        let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(stdin) else { return s };
        let text = |k: &str| map.get(k).and_then(Value::as_str);
        s.file = text("logFile").filter(|f| !f.is_empty()).map(PathBuf::from);
        if let Some(level) = text("logLevel").and_then(parse_level) {
            s.level = level;
        }
        if let Some(format) = text("logFormat").and_then(|f| f.parse().ok()) {
            s.format = format;
        }
        s
    }
}

/// Where each line goes: stderr, and the log file when there is one. Each line is one
/// `write` to a file opened for appending, so lines of plugin processes running at the same
/// time do not interleave.
struct Outputs {
    file: Option<File>,
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Outputs {
    type Writer = &'a Outputs;
    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}

impl Write for &Outputs {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let one_line = single_line(line);
        // Logging must never fail a command: a full disk or a closed stderr loses the line.
        let _ = std::io::stderr().write_all(&one_line);
        if let Some(mut f) = self.file.as_ref() {
            let _ = f.write_all(&one_line);
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One event, one line: a message that spans lines (CHECK's list of differences, a
/// ruleset) has its inner newlines written as `\n`. JSON lines are escaped already.
fn single_line(event: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let body = event.strip_suffix(b"\n").unwrap_or(event);
    if !body.contains(&b'\n') {
        return event.into();
    }
    let mut out = Vec::with_capacity(event.len() + 16);
    for &b in body {
        if b == b'\n' {
            out.extend_from_slice(b"\\n");
        } else {
            out.push(b);
        }
    }
    out.push(b'\n');
    out.into()
}

/// Installs the process's logger: RFC 3339 UTC timestamps, the level, the span (command and
/// pod), the message and its fields. A log file that cannot be opened is reported on stderr
/// and skipped.
pub fn init(settings: &Settings) {
    let file = settings.file.as_ref().and_then(|path| match OpenOptions::new().create(true).append(true).open(path) {
        Ok(f) => Some(f),
        Err(e) => {
            eprintln!("aether-cni: cannot open log file {}: {e}", path.display());
            None
        }
    });
    let base = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_target(false)
        .with_span_events(FmtSpan::NONE)
        .with_writer(Outputs { file });
    let layer: Box<dyn Layer<Registry> + Send + Sync> = match settings.format {
        Format::Text => base.boxed(),
        Format::Json => base.json().flatten_event(true).with_current_span(true).with_span_list(false).boxed(),
    };
    let subscriber = Registry::default().with(layer.with_filter(settings.level));
    // A second init in one process (tests) keeps the first logger.
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// The span of one CNI invocation, naming the command and, where known, the pod, the
/// container and its netns (a field the runtime did not pass is left out, not written as
/// empty). Entered for the whole run, so every line carries them. It is created at ERROR
/// level so that it exists whatever `logLevel` filters out.
pub fn cni_span(command: &str, pod: Option<String>, container: Option<&str>, netns: Option<&str>) -> tracing::Span {
    tracing::error_span!(
        "cni",
        command = %command,
        pod = pod.as_deref().map(display),
        container = container.map(display),
        netns = netns.map(display),
        pid = std::process::id()
    )
}

/// `namespace/name` for a log line, from what the runtime passed (`?` for a part it did
/// not); `None` when it passed neither.
pub fn pod_name(namespace: Option<&str>, name: Option<&str>) -> Option<String> {
    match (namespace, name) {
        (None, None) => None,
        (ns, n) => Some(format!("{}/{}", ns.unwrap_or("?"), n.unwrap_or("?"))),
    }
}

#[cfg(test)]
use aether_node::text::counts;
pub use aether_node::text::plural;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn lenient_settings_read_what_is_usable_and_default_the_rest() {
        let s =
            Settings::lenient(br#"{"logFile": "/tmp/x.log", "logLevel": "debug", "logFormat": "json", "bogus": 1}"#);
        assert_eq!(s, Settings { file: Some("/tmp/x.log".into()), level: LevelFilter::DEBUG, format: Format::Json });
        let s = Settings::lenient(br#"{"logFile": "/tmp/x.log", "logLevel": "loud", "logFormat": 7}"#);
        assert_eq!(s, Settings { file: Some("/tmp/x.log".into()), ..Settings::default() });
        assert_eq!(Settings::lenient(b"not json"), Settings::default());
        assert_eq!(Settings::lenient(br#"{"logFile": 3}"#), Settings::default());
    }

    #[test]
    fn an_event_is_one_line() {
        assert_eq!(&*single_line(b"a b\n"), b"a b\n");
        assert_eq!(&*single_line(b"CHECK failed: x\ny\n"), b"CHECK failed: x\\ny\n");
    }

    #[test]
    fn pods_and_counts_read_as_words() {
        assert_eq!(pod_name(Some("shop"), Some("cart-0")).as_deref(), Some("shop/cart-0"));
        assert_eq!(pod_name(None, Some("cart-0")).as_deref(), Some("?/cart-0"));
        assert_eq!(pod_name(None, None), None);
        let m: BTreeMap<String, u64> = [("external".into(), 0), ("mesh".into(), 1), ("service".into(), 2)].into();
        assert_eq!(counts(&m), "mesh:1,service:2");
        assert_eq!(counts(&[("mesh".to_string(), 0)].into()), "none");
        assert_eq!(counts(&BTreeMap::new()), "none");
    }
}
