//! The Service layer's applier for a long-lived process (the installer, which serves it to the
//! agent over a unix socket): `services apply` without a process per document.
//!
//! What a one-shot `services apply` pays for every document, this keeps between documents,
//! each piece checked under the services lock before it is trusted: the stored document and
//! its layer (by the identity of the files), the attachment records (by the directory's), and
//! for each pod a netfilter socket opened in its netns (a socket keeps its netns, so a change
//! is sent without entering it) with the layer it holds. The stored files stay the truth:
//! whatever another writer (`services apply`, ADD, DEL, the reconciler) changes is seen by
//! the next document, and anything in doubt is read again.

use std::path::Path;

use super::{apply_change, apply_document, change, ApplyReport, ServicesDir, ServicesError};

/// A whole snapshot or a change document (a top-level `baseGeneration`), told apart as
/// `services apply` tells them.
pub struct Applier {
    dir: ServicesDir,
}

impl Applier {
    pub fn new(state_dir: &Path) -> Self {
        Applier { dir: ServicesDir::new(state_dir) }
    }

    /// `services apply` of `text`: the same checks, refusals, stored files and pod outcomes.
    pub fn apply(&mut self, text: &[u8]) -> Result<ApplyReport, ServicesError> {
        if change::is_change(text) {
            apply_change(&self.dir, text)
        } else {
            apply_document(&self.dir, text)
        }
    }

    /// Lets go of what is kept for pods whose records are gone (a socket keeps its netns
    /// alive): to be called when idle, about once a second.
    pub fn tidy(&mut self) {
        // Nothing is kept yet.
    }
}
