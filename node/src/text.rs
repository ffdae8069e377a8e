//! How values are shown to people: bounded echoes of what a stranger sent, counts in words.

use std::collections::BTreeMap;

/// At most `max` characters of `text`, with how much was left out: what an error may echo of
/// a value a stranger sent (a huge value is never echoed whole).
pub fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((cut, _)) => format!("{}... ({} bytes in all)", &text[..cut], text.len()),
    }
}

/// Counters as one token for a `key=value` field: the non-zero ones as `mesh:1,service:2`,
/// `none` when there are none.
pub fn counts(map: &BTreeMap<String, u64>) -> String {
    let nonzero: Vec<String> = map.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}:{v}")).collect();
    if nonzero.is_empty() {
        return "none".into();
    }
    nonzero.join(",")
}

/// `1 difference`, `3 differences`: counts in words an operator reads.
pub fn plural(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}
