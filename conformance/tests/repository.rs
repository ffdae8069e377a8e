//! The repository reads on its own: every relative link in README.md and docs/*.md resolves
//! to a file (and heading) inside the repository, and no file refers to work-item numbers or
//! to places outside the repository that a reader of a clone cannot open.
//!
//! Each check runs first on a small text made to fail it (its negative control), so a check
//! that can no longer fail is caught too.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace").to_path_buf()
}

/// README.md and every page under docs/.
fn documents() -> Vec<PathBuf> {
    let root = repo();
    let mut docs = vec![root.join("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    assert!(!pages.is_empty(), "docs/ has no pages");
    docs.extend(pages);
    docs
}

/// Markdown with fenced code blocks blanked out (their lines kept, so line numbers hold).
fn outside_code_blocks(text: &str) -> Vec<(usize, String)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((i + 1, strip_code_spans(line)));
        }
    }
    lines
}

/// A line without its `code spans` (a path in backticks is text, not a link).
fn strip_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// The targets of `[text](target)`, `![alt](target)` and `[label]: target` links, by line.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in outside_code_blocks(text) {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("").trim_matches(['<', '>']);
            found.push((n, target.to_string()));
            rest = &after[end..];
        }
        let t = line.trim_start();
        if let (true, Some(close)) = (t.starts_with('['), t.find("]:")) {
            if !t[..close].contains("](") {
                found.push((n, t[close + 2..].split_whitespace().next().unwrap_or("").to_string()));
            }
        }
    }
    found
}

/// The anchors GitHub makes for a page's headings: lower case, punctuation dropped, spaces
/// as hyphens, a repeated heading numbered `-1`, `-2`...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line) in outside_code_blocks(text) {
        let Some(title) = line.strip_prefix('#').map(|t| t.trim_start_matches('#')) else { continue };
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut name = slug.clone();
        let mut n = 0;
        while seen.contains(&name) {
            n += 1;
            name = format!("{slug}-{n}");
        }
        seen.insert(name);
    }
    seen
}

/// What is wrong with `target`, a link in `doc` (a file inside `root`, whose text is
/// `doc_text`), if anything.
fn broken(root: &Path, doc: &Path, doc_text: &str, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("an empty link".into());
    }
    if target.contains("://") || target.starts_with("mailto:") {
        return None; // outside the repository by design, and named as such
    }
    if target.starts_with('/') {
        return Some("an absolute path: it names a file on one machine, not in the repository".into());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    if path.is_empty() {
        let anchor = anchor.unwrap_or_default();
        return (!anchors(doc_text).contains(anchor))
            .then(|| format!("this page has no heading whose anchor is #{anchor}"));
    }
    let file = doc.parent().unwrap().join(path);
    // Resolved by hand, not canonicalize(): a symlink out of the repository must not pass.
    let mut inside = PathBuf::new();
    for c in file.strip_prefix(root).ok()?.components() {
        match c {
            Component::Normal(p) => inside.push(p),
            Component::CurDir => {}
            Component::ParentDir => {
                if !inside.pop() {
                    return Some("it leads outside the repository".into());
                }
            }
            _ => return Some("not a plain relative path".into()),
        }
    }
    if inside.starts_with("target") {
        return Some("target/ is build output, absent from a clone".into());
    }
    let full = root.join(&inside);
    if !full.exists() {
        return Some(format!("{} does not exist", inside.display()));
    }
    if let Some(anchor) = anchor {
        if full.extension().is_some_and(|e| e == "md") {
            let text = std::fs::read_to_string(&full).ok()?;
            if !anchors(&text).contains(anchor) {
                return Some(format!("{} has no heading whose anchor is #{anchor}", inside.display()));
            }
        }
    }
    None
}

fn broken_links(root: &Path, doc: &Path, text: &str) -> Vec<String> {
    links(text)
        .into_iter()
        .filter_map(|(line, target)| {
            broken(root, doc, text, &target).map(|why| format!("{}:{line}: ({target}): {why}", doc.display()))
        })
        .collect()
}

#[test]
fn every_relative_link_in_readme_and_docs_resolves_inside_the_repository() {
    let root = repo();

    // The negative control: a page with one link of each broken kind, and good ones.
    let control_doc = root.join("docs").join("control.md");
    let control = "# A page\n\n## The second part\n\n\
        [ok](design.md) [ok](#the-second-part) [ok](../README.md#aether-cni) [ok](https://example.org/x)\n\
        `[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n\
        [gone](nowhere.md) [out](../../elsewhere/spec.md) [abs](/etc/passwd) [anchor](design.md#no-such-heading)\n\
        [self](#no-such-part) [built](../target/release/aether-cni)\n\
        [label]: ../../outside.md\n";
    let found = broken_links(&root, &control_doc, control);
    assert_eq!(
        found.len(),
        7,
        "the control page has 7 broken links and 4 good ones, the checker found:\n{}",
        found.join("\n")
    );

    let mut problems = Vec::new();
    let mut count = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        count += links(&text).len();
        problems.extend(broken_links(&root, &doc, &text));
    }
    assert!(count > 20, "only {count} links found in README.md and docs/: is the link reader broken?");
    assert!(problems.is_empty(), "links that do not resolve inside the repository:\n{}", problems.join("\n"));
}

/// What in `line` refers to a work item by its number (the word "issue" or "item" followed
/// by a number, in prose or in a name) or to a place outside the repository (the workplace's
/// shared directory, its absolute paths, its specification file), if anything.
fn outside_reference(line: &str) -> Option<String> {
    let lower = line.to_lowercase();
    for word in ["issue", "item"] {
        let mut from = 0;
        while let Some(at) = lower[from..].find(word) {
            let start = from + at;
            let before = lower[..start].chars().next_back();
            let mut rest = lower[start + word.len()..].chars().peekable();
            if rest.peek() == Some(&'s') {
                rest.next();
            }
            while matches!(rest.peek(), Some(' ' | '_' | '#' | '-')) {
                rest.next();
            }
            let word_starts = !before.is_some_and(|c| c.is_alphanumeric());
            if word_starts && rest.peek().is_some_and(|c| c.is_ascii_digit()) {
                return Some(line[start..].chars().take(word.len() + 4).collect());
            }
            from = start + word.len();
        }
    }
    let outside = [concat!("..", "/shared"), concat!("/wo", "rk/"), concat!("DES", "IGN.md")];
    outside.into_iter().find(|o| line.contains(o)).map(str::to_string)
}

/// Every file of the repository as text (build output, git's own files and binary files
/// aside), with its path inside the repository.
fn repository_texts() -> Vec<(PathBuf, String)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            let name = e.file_name();
            let kind = e.file_type().unwrap();
            if kind.is_dir() {
                if rel == Path::new("target") || name == ".git" || rel.starts_with("charts/tests/__pycache__") {
                    continue;
                }
                walk(root, &path, out);
            } else if kind.is_file() && name != ".git" {
                if let Ok(text) = String::from_utf8(std::fs::read(&path).unwrap()) {
                    out.push((rel, text));
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo(), &repo(), &mut out);
    out
}

#[test]
fn no_file_refers_to_work_item_numbers_or_outside_the_repository() {
    // The negative control: each kind of reference is found, and plain text is not.
    // (Spelt in pieces, so that this file does not fail its own check.)
    for bad in [
        concat!("as iss", "ue 11 measured"),
        concat!("(Iss", "ue 12 it", "em 6)"),
        concat!("fn iss", "ue9_it", "em2_a_record() {"),
        concat!("see iss", "ues #4"),
        concat!("It", "em 2: a DEL killed"),
        concat!("the spec in ../sh", "ared/reference/"),
        concat!("/wo", "rk/main/README.md"),
        concat!("(DES", "IGN.md \"The pod ruleset\")"),
    ] {
        assert!(outside_reference(bad).is_some(), "not caught: {bad:?}");
    }
    for good in ["an issue with the kernel", "each item of 4 bytes", "tissue 5", "containers/podman#12083"] {
        assert_eq!(outside_reference(good), None, "caught in plain text: {good:?}");
    }

    let files = repository_texts();
    assert!(files.iter().any(|(p, _)| p == Path::new("README.md")), "the walk missed README.md");
    assert!(files.len() > 100, "only {} text files found: is the walk broken?", files.len());
    let mut problems = Vec::new();
    for (path, text) in &files {
        for (n, line) in text.lines().enumerate() {
            if let Some(what) = outside_reference(line) {
                problems.push(format!("{}:{}: {what:?} in {:?}", path.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "say what changed and why instead of a work item's number, and link only to what a clone has:\n{}",
        problems.join("\n")
    );
}
