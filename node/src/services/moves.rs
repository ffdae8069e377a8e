//! `pods.moves`: the pods an apply's element changes moved, in one file written once per
//! apply, instead of each pod's file under `pods/` rewritten after every change (a hundred
//! small writes per change on a node of a hundred pods, where the kernel's own work per pod
//! is a few microseconds).
//!
//! Each line is `<what the pod's own file says> -> <what the pod holds now>`, both as the pod
//! file writes them (`PodHolds`). A line counts only while the pod's file still says exactly
//! its left side: whoever writes a pod's file afterwards (a rebuild, ADD, a repair, DEL's
//! removal, a release that knows nothing of this file) makes it say something else, and the
//! line is then no longer read. The left side can never come back: it names a generation
//! older than the one the line moved the pod to, and stored generations only grow.
//!
//! Written whole, atomically, under the exclusive services lock, by the apply engine alone.
//! A line lost (the file removed, unreadable, or a line torn) leaves the pod's file, which
//! names an older layer: the pod is rebuilt or compared in full, never taken as holding a
//! layer it does not.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::engine::PodHolds;
use super::{FileId, ServicesDir, ServicesError};

/// The file's name under `services/` (beside `pods/`, whose unknown files are pruned).
pub(super) const MOVES: &str = "pods.moves";

/// The moves as read: by netns key, (the pod file's content, what the pod holds).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Moves(HashMap<String, (PodHolds, PodHolds)>);

impl Moves {
    /// All or nothing: a text that is not whole (its last line without its newline) or has a
    /// line that does not read as one pod's move moves no pod (their files stand).
    pub(super) fn parse(text: &str) -> Moves {
        let Some(body) = text.strip_suffix('\n') else { return Moves::default() };
        let moves: Option<HashMap<String, (PodHolds, PodHolds)>> = body
            .split('\n')
            .map(|line| {
                let (base, now) = line.split_once(" -> ")?;
                let (base, now) = (PodHolds::parse(&format!("{base}\n"))?, PodHolds::parse(&format!("{now}\n"))?);
                (base.netns == now.netns).then(|| (base.netns.clone(), (base, now)))
            })
            .collect();
        Moves(moves.unwrap_or_default())
    }

    /// The file's content for `moves` (each a pod's file and what it holds now).
    pub(super) fn encode(moves: &[(PodHolds, PodHolds)]) -> Vec<u8> {
        use std::fmt::Write;
        let mut out = String::with_capacity(moves.len() * 96);
        for (base, now) in moves {
            // `PodHolds`'s text is one line with its newline (the left side's taken off).
            let _ = write!(out, "{base}");
            out.pop();
            let _ = write!(out, " -> {now}");
        }
        out.into_bytes()
    }

    /// What a pod whose file says `file` holds: the line's right side when its left side is
    /// exactly `file`, else `file` itself.
    pub(super) fn fold(&self, file: PodHolds) -> PodHolds {
        match self.0.get(&file.netns) {
            Some((base, now)) if *base == file => now.clone(),
            _ => file,
        }
    }
}

/// The file as last read, by its path and identity: every pod's look reads it, and it
/// changes once per apply.
static READ: Mutex<Option<(std::path::PathBuf, FileId, Arc<Moves>)>> = Mutex::new(None);

impl ServicesDir {
    /// The moves as they stand (none when the file is absent or unreadable).
    pub(super) fn moves(&self) -> Arc<Moves> {
        let path = self.root.join(MOVES);
        let Some(id) = FileId::of(&path) else { return Arc::default() };
        let mut read = READ.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((p, i, m)) = read.as_ref() {
            if *p == path && *i == id {
                return m.clone();
            }
        }
        let Ok(Some(text)) = self.read(MOVES) else { return Arc::default() };
        let moves = Arc::new(Moves::parse(&String::from_utf8_lossy(&text)));
        // The identity read before the text: a file replaced in between is read again next time.
        *read = Some((path, id, moves.clone()));
        moves
    }

    /// Writes the moves of an apply (every pod whose file does not say what it holds), or
    /// removes the file when there are none.
    pub(super) fn write_moves(&self, moves: &[(PodHolds, PodHolds)]) -> Result<(), ServicesError> {
        if moves.is_empty() {
            return self.remove(MOVES);
        }
        self.write_atomic(MOVES, &Moves::encode(moves))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holds(generation: u64, netns: &str, run: Option<(u32, u32)>) -> PodHolds {
        PodHolds { applied_run: run, ..PodHolds::for_key_of(generation, 0xd16e57 + generation, netns.into(), 0xae71) }
    }

    #[test]
    fn a_move_counts_only_while_the_pods_file_says_what_it_moved_from() {
        let (a5, a7) = (holds(5, "4:100", None), holds(7, "4:100", Some((10, 12))));
        let (b5, b6) = (holds(5, "4:101", None), holds(6, "4:101", Some((3, 3))));
        let moves = Moves::parse(
            &String::from_utf8(Moves::encode(&[(a5.clone(), a7.clone()), (b5.clone(), b6.clone())])).unwrap(),
        );
        assert_eq!(moves.0.len(), 2, "{moves:?}");
        assert_eq!(moves.fold(a5.clone()), a7, "the file it moved from");
        assert_eq!(moves.fold(b5), b6);
        // Written since by someone else (a rebuild, ADD, a repair): the file stands.
        let rebuilt = holds(8, "4:100", None);
        assert_eq!(moves.fold(rebuilt.clone()), rebuilt);
        // The same generation under another mark, or another run: not what it moved from.
        let other_mark = PodHolds { divert_mark: 0x1, ..a5.clone() };
        assert_eq!(moves.fold(other_mark.clone()), other_mark);
        // Another netns (no line of its own).
        let c = holds(5, "4:102", None);
        assert_eq!(moves.fold(c.clone()), c);
    }

    #[test]
    fn a_file_torn_or_with_a_foreign_line_moves_no_pod() {
        let (a5, a7) = (holds(5, "4:100", None), holds(7, "4:100", Some((10, 12))));
        let (b5, b6) = (holds(5, "4:101", None), holds(6, "4:101", None));
        let whole = String::from_utf8(Moves::encode(&[(a5.clone(), a7.clone()), (b5.clone(), b6.clone())])).unwrap();
        let two_netns = format!("{} -> {}", a5.to_string().trim_end(), holds(9, "4:999", None));
        for (what, text) in [
            // Cut short, also where the rest still reads as a mark (`0xae`).
            ("torn", whole[..whole.len() - 1].to_string()),
            ("torn in its mark", whole[..whole.len() - 3].to_string()),
            ("a line of two netns", format!("{whole}{two_netns}\n")),
            ("a line without its arrow", format!("{whole}garbage\n")),
        ] {
            let moves = Moves::parse(&text);
            assert_eq!(moves, Moves::default(), "{what}: {text:?}");
            assert_eq!(moves.fold(a5.clone()), a5, "{what}");
        }
        // Control: the whole text moves both.
        let moves = Moves::parse(&whole);
        assert_eq!((moves.fold(a5), moves.fold(b5)), (a7, b6));
    }
}
