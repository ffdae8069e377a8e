//! The change between two stored layers cut down to what it touches (`narrowed`), and the
//! caches in front of it: the VIPs a change touched, and each layer's profile counts.

use std::sync::Arc;

use aether_rules::services as layer;

use super::StoredLayer;

/// Two stored layers (lists sorted) cut down to the Service VIPs and mesh VIPs whose
/// elements differ, everything else kept: the change between the cut layers is the whole
/// ones' and costs what changed. A VIP's elements depend on its ports and on which profiles
/// have chains, decided over the whole layer: each cut keeps its whole layer's decision, and
/// the VIPs of a profile that gained or lost its chain.
pub(in crate::services) fn narrowed(
    old: &StoredLayer,
    new: &StoredLayer,
) -> (layer::ServiceLayer, layer::ServiceLayer) {
    let mut vips: Vec<std::net::IpAddr> = match touched_between(old, new) {
        // Only the VIPs the change touched can differ: each compared, not the 20,000 ports.
        Some(touched) => touched
            .into_iter()
            .filter(|&v| {
                let (o, n) = (&old.layer.ports, &new.layer.ports);
                o[layer::ports_of(o, v)] != n[layer::ports_of(n, v)]
            })
            .collect(),
        None => {
            let (gone, came) = sorted_difference(&old.layer.ports, &new.layer.ports);
            gone.iter().chain(&came).map(|p| p.vip).collect()
        }
    };
    vips.sort_unstable();
    vips.dedup();
    let (old_chains, new_chains) = decisions(old, new, &vips);
    let (old_id, new_id) = (old.id(), new.id());
    let (old, new) = (&old.layer, &new.layer);
    vips.extend(layer::rechained_vips([old, new], &old_chains, &new_chains));
    vips.sort_unstable();
    vips.dedup();
    let (mesh_gone, mesh_came) = sorted_difference(&old.mesh_vips, &new.mesh_vips);
    let mut mesh: Vec<std::net::IpAddr> = mesh_gone.into_iter().chain(mesh_came).collect();
    mesh.sort_unstable();
    let cut = |l: &layer::ServiceLayer, chained: layer::ProfileChains, id| layer::ServiceLayer {
        mode: l.mode,
        ranges: l.ranges.clone(),
        mesh_vips: l.mesh_vips.iter().filter(|a| mesh.binary_search(a).is_ok()).copied().collect(),
        ports: vips.iter().flat_map(|&v| l.ports[layer::ports_of(&l.ports, v)].iter().copied()).collect(),
        dialled_timeout_secs: l.dialled_timeout_secs,
        divert_mark: l.divert_mark,
        chained: Some(chained),
        identity: Some(id),
    };
    (cut(old, old_chains, old_id), cut(new, new_chains, new_id))
}

/// The VIPs whose ports a change may have changed, recorded by the apply that made the
/// layer of digest `.1` from the one of digest `.0` (`note_touched`): a cache in front of
/// `narrowed`'s comparison of every port, which then compares only these. Process-wide (the
/// apply's tour may run on another thread), the last few changes.
type Touched = (u64, u64, Vec<std::net::IpAddr>);
static TOUCHED: std::sync::Mutex<Vec<Touched>> = std::sync::Mutex::new(Vec::new());
const TOUCHED_KEPT: usize = 4;

/// Records that every VIP whose ports differ between `old` and `new` is among `touched`.
pub(in crate::services) fn note_touched(old: &StoredLayer, new: &StoredLayer, touched: Vec<std::net::IpAddr>) {
    let mut kept = TOUCHED.lock().unwrap_or_else(|p| p.into_inner());
    kept.retain(|(o, n, _)| (*o, *n) != (old.digest, new.digest));
    kept.push((old.digest, new.digest, touched));
    let excess = kept.len().saturating_sub(TOUCHED_KEPT);
    kept.drain(..excess);
}

fn touched_between(old: &StoredLayer, new: &StoredLayer) -> Option<Vec<std::net::IpAddr>> {
    let kept = TOUCHED.lock().unwrap_or_else(|p| p.into_inner());
    kept.iter().find(|(o, n, _)| (*o, *n) == (old.digest, new.digest)).map(|(_, _, t)| t.clone())
}

/// The profile counts of the stored layers last decided over, by content digest: a cache in
/// front of the one decision (`ProfileCounts::chains`). The long-lived applier decides over
/// two whole layers on every change (a fifth of its CPU for a change at 10,000 Services, in
/// every pod's place), and the budget's estimate asks for the same two as the apply: a layer
/// is counted in full once, and one that a change makes from a counted layer is counted by
/// the Services the change touches. Process-wide: a one-shot process applies one document.
static COUNTED: std::sync::Mutex<Vec<(u64, Arc<layer::ProfileCounts>)>> = std::sync::Mutex::new(Vec::new());
/// Layers remembered: the two of a change, and the two before.
const COUNTED_KEPT: usize = 4;

/// Which profiles get chains in `old` and in `new`, whose Services differ only at `touched`
/// (sorted VIPs).
fn decisions(
    old: &StoredLayer,
    new: &StoredLayer,
    touched: &[std::net::IpAddr],
) -> (layer::ProfileChains, layer::ProfileChains) {
    // (A stored layer's lists are sorted, `StoredLayer::with_file`; `narrowed` relies on it.)
    if old.layer.chained.is_some() || new.layer.chained.is_some() {
        return (old.layer.profile_chains(), new.layer.profile_chains());
    }
    let mut counted = COUNTED.lock().unwrap_or_else(|p| p.into_inner());
    let find = |counted: &[(u64, Arc<layer::ProfileCounts>)], l: &StoredLayer| {
        counted.iter().find(|(d, _)| *d == l.digest).map(|(_, c)| c.clone())
    };
    let old_counts = find(&counted, old).unwrap_or_else(|| Arc::new(layer::ProfileCounts::of(&old.layer.ports)));
    let new_counts = find(&counted, new).unwrap_or_else(|| {
        let of = |l: &layer::ServiceLayer| -> Vec<layer::ServicePort> {
            touched.iter().flat_map(|&v| l.ports[layer::ports_of(&l.ports, v)].iter().copied()).collect()
        };
        Arc::new(old_counts.moved(&of(&old.layer), &of(&new.layer)))
    });
    for (l, c) in [(old, &old_counts), (new, &new_counts)] {
        counted.retain(|(d, _)| *d != l.digest);
        counted.push((l.digest, c.clone()));
    }
    let excess = counted.len().saturating_sub(COUNTED_KEPT);
    counted.drain(..excess);
    (old_counts.chains(), new_counts.chains())
}

/// (in `a` only, in `b` only) of two sorted lists.
fn sorted_difference<T: Ord + Copy>(a: &[T], b: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut only_a, mut only_b) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Equal => (i, j) = (i + 1, j + 1),
            std::cmp::Ordering::Less => {
                only_a.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                only_b.push(b[j]);
                j += 1;
            }
        }
    }
    only_a.extend_from_slice(&a[i..]);
    only_b.extend_from_slice(&b[j..]);
    (only_a, only_b)
}
