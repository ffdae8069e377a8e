//! Logs go to stderr and, when configured, to a file; never to stdout, which carries only
//! the CNI result.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

static FILE: Mutex<Option<File>> = Mutex::new(None);
static LEVEL: Mutex<u8> = Mutex::new(2);

#[allow(dead_code)] // Error is for failures that end a command; not every build has one yet
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Error = 0,
    Warn = 1,
    Info = 2,
    Debug = 3,
}

/// Points logging at `file` (appended to; a file that cannot be opened is reported on
/// stderr and skipped: logging must never fail a pod).
pub fn init(file: Option<&Path>, level: &str) {
    *LEVEL.lock().unwrap() = match level {
        "error" => 0,
        "warn" => 1,
        "debug" => 3,
        _ => 2,
    };
    if let Some(path) = file {
        match OpenOptions::new().create(true).append(true).open(path) {
            Ok(f) => *FILE.lock().unwrap() = Some(f),
            Err(e) => eprintln!("aether-cni: cannot open log file {}: {e}", path.display()),
        }
    }
}

pub fn log(level: Level, msg: std::fmt::Arguments) {
    if level as u8 > *LEVEL.lock().unwrap() {
        return;
    }
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let line = format!("{secs:.3} {:?} pid={} {msg}\n", level, std::process::id());
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(f) = FILE.lock().unwrap().as_mut() {
        let _ = f.write_all(line.as_bytes());
    }
}

#[macro_export]
macro_rules! info { ($($t:tt)*) => { $crate::log::log($crate::log::Level::Info, format_args!($($t)*)) } }
#[macro_export]
macro_rules! warn { ($($t:tt)*) => { $crate::log::log($crate::log::Level::Warn, format_args!($($t)*)) } }
#[macro_export]
macro_rules! debug { ($($t:tt)*) => { $crate::log::log($crate::log::Level::Debug, format_args!($($t)*)) } }
