//! What programming Service layers will charge to this process's memory cgroup, and the
//! refusal of work that would cross its limit (`crate::memcg`). Every path that programs
//! layers outside ADD asks here first: `services apply` and the installer's applier before
//! they store anything, the reconciler before a repair or an in-place capture.
//!
//! The estimate is the elements the work adds (a pod rebuilt adds its whole layer, one sent
//! the change adds the change's, one that holds the layer nothing) times the bytes one
//! element costs, measured once per process on the running kernel: a known layer loaded
//! into a private throwaway netns, this process's cgroup usage read before and after.
//! Elements removed are not counted back: they were charged to whoever added them (ADD's
//! runtime, an earlier installer), not necessarily to this cgroup.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::OnceLock;

use aether_rules::model::Proto;
use aether_rules::services::{self as layer, LayerChange, LayerMode, ServiceLayer, ServicePort};

use super::{ServicesDir, ServicesError};
use crate::memcg::{self, Memcg, OverBudget, Reading};

/// Used when the measurement cannot be made (no private netns, an unreadable cgroup):
/// above every figure measured on the kernels we test (docs/operating.md, "Memory"), so
/// the fallback refuses early rather than late.
pub const FALLBACK_PER_ELEMENT: u64 = 512;

/// The nftables elements `l` puts in the kernel, per pod: what its sets and its verdict map
/// hold, an interval set's range counted twice (its start and its end are elements).
/// Counted from the lists, without building the tables (`ServiceLayer::element_count`; a
/// test holds it equal to what `services_tables` builds).
pub fn layer_elements(l: &ServiceLayer) -> u64 {
    l.element_count().map_or(0, |n| n as u64)
}

/// At least `layer_elements(l)`, counted without grouping its ports into profiles
/// (`ServiceLayer::element_bound`): what a check made for every change can afford.
pub(super) fn layer_bound(l: &ServiceLayer) -> u64 {
    l.element_bound().map_or(0, |n| n as u64)
}

/// This process's memory cgroup and the bytes an element costs, found on first need.
fn own_memcg() -> Option<&'static Memcg> {
    static OWN: OnceLock<Option<Memcg>> = OnceLock::new();
    OWN.get_or_init(|| match Memcg::own() {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!("this process's memory cgroup cannot be found, so the Service layer's work is not held to a memory limit: {e}");
            None
        }
    })
    .as_ref()
}

/// The bytes of kernel memory one element of the layer costs on this kernel, measured once
/// per process (`measure`), or `FALLBACK_PER_ELEMENT` when it cannot be.
pub fn per_element(memcg: &Memcg) -> u64 {
    *MEASURED.get_or_init(|| match sample_fits(memcg).and_then(|()| measure(memcg)) {
        Ok(m) => {
            tracing::info!(bytes = m, "kernel memory per Service-layer element, measured on this kernel");
            m
        }
        Err(why) => {
            tracing::warn!("kernel memory per Service-layer element cannot be measured ({why}); {FALLBACK_PER_ELEMENT} bytes assumed");
            FALLBACK_PER_ELEMENT
        }
    })
}

/// `per_element`'s measure, once made (made only once some limit binds this process).
static MEASURED: OnceLock<u64> = OnceLock::new();

/// Elements added per family in the measurement: large enough that the memory cgroup's
/// charge batching (64 pages per CPU) is a small part of the delta.
const SAMPLE_ELEMENTS: u64 = 32_768;

/// Whether the measure's sample (two families' elements, charged for a moment) fits under
/// the limit now, at a generous 128 bytes an element: never OOM-killed by the measure itself.
fn sample_fits(memcg: &Memcg) -> Result<(), String> {
    let reading = memcg.read().map_err(|e| e.to_string())?;
    memcg::fits(&reading, 2 * SAMPLE_ELEMENTS, 128)
        .map_err(|over| format!("its sample does not fit: {} of {} bytes in use", over.in_use, over.limit))
}

/// A layer of `v4` IPv4 and `v6` IPv6 Services, two TCP ports each with endpoints, the
/// second port each Service's own: no port profile shared, so every Service is a map element
/// and two keyed ports (the layer's costliest form, and a sample of few Services).
fn sample_layer(v4: usize, v6: usize) -> ServiceLayer {
    let mut l = ServiceLayer::new(LayerMode::Refuse);
    l.ranges = vec!["10.96.0.0/12".parse().expect("a range"), "fd00:96::/108".parse().expect("a range")];
    let v4s = (0..v4).map(|i| IpAddr::V4(Ipv4Addr::from(0x0a60_0000u32 + 10 + i as u32)));
    let v6s =
        (0..v6).map(|i| IpAddr::V6(Ipv6Addr::from(0xfd00_0096_0000_0000_0000_0000_0000_0000u128 + 10 + i as u128)));
    for (i, vip) in v4s.chain(v6s).enumerate() {
        for port in [80, 1000 + (i % 60_000) as u16] {
            l.ports.push(ServicePort { vip, proto: Proto::Tcp, port, has_endpoints: true });
        }
    }
    l.ports.sort();
    l
}

/// Loads a sample layer into a private netns, one Service of each family first, then the
/// element changes that add the rest, one family at a time, reading this cgroup's kernel
/// memory around each (its whole usage where the kernel's is not told apart: each change is
/// encoded before the first read and let go of after the second, so the process's heap
/// stays still between them); the larger of the two families' bytes per element (an IPv6 key
/// is larger). One family's sample at a time is held in the process's memory.
fn measure(memcg: &Memcg) -> Result<u64, String> {
    let per_service = layer_elements(&sample_layer(1000, 0)).saturating_sub(layer_elements(&sample_layer(0, 0))) / 1000;
    let n = (SAMPLE_ELEMENTS / per_service.max(1)) as usize + 1;
    let kernel_apart = matches!(memcg.kernel_usage(), Ok(Some(_)));
    let usage = || match kernel_apart {
        true => memcg.kernel_usage().map(Option::unwrap_or_default).map_err(|e| e.to_string()),
        false => memcg.read().map(|r| r.usage).map_err(|e| e.to_string()),
    };
    let first = sample_layer(1, 1);
    aether_netns::run_in_private(|| -> Result<u64, String> {
        layer::rebuild(&first).map_err(|e| e.to_string())?;
        let mut worst = 0;
        // Each family's Services added to what the netns holds (the other family's stay).
        for big in [(n, 1), (1, n)] {
            let (added, encoded) = {
                let change = LayerChange::between(&first, &sample_layer(big.0, big.1))
                    .map_err(|e| e.to_string())?
                    .ok_or("the sample's change is not an element change")?;
                (change.added() as u64, change.encode())
            };
            let before = usage()?;
            encoded.send().map_err(|e| e.to_string())?;
            let after = usage()?;
            drop(encoded);
            let per = after.saturating_sub(before) / added.max(1);
            // Less than a key and its hash node cannot be: something else was freed meanwhile.
            if per < 16 {
                return Err(format!("{} bytes charged for {added} elements", after.saturating_sub(before)));
            }
            worst = worst.max(per);
        }
        Ok(worst)
    })
    .map_err(|e| e.to_string())?
}

/// What this process may still charge: its cgroup's reading and the bytes per element;
/// `None` when no limit binds it (nothing to check).
pub(super) fn budget() -> Option<(Reading, u64)> {
    // A test's negative control: the check skipped, to show the work killed without it.
    if crate::state::fails_here("memory-budget") {
        return None;
    }
    let memcg = own_memcg()?;
    let reading = match memcg.read() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(
                "the memory cgroup cannot be read, so the Service layer's work is not held to its limit: {e}"
            );
            return None;
        }
    };
    reading.limit?;
    Some((reading, per_element(memcg)))
}

/// For a long-lived process, at its start: the bytes per element measured now, while its
/// usage is low, if a limit binds it (else on first need).
pub fn prepare() {
    let _ = budget();
}

/// Whether `pods` whole layers of the stored snapshot fit (a repair, an in-place capture).
pub fn layers_fit(dir: &ServicesDir, pods: u64) -> Result<(), ServicesError> {
    let Some((reading, per)) = budget() else { return Ok(()) };
    let elements = match dir.stored_layer() {
        Ok(Some(s)) => layer_elements(&s.layer),
        _ => return Ok(()),
    };
    memcg::fits(&reading, pods * elements, per).map_err(ServicesError::OverBudget)
}

/// What parsing and applying a document holds of this process's own memory at its peak,
/// beyond its text: per JSON object (a Service, a port: what is read from it, the layer, each
/// pod's messages) and per byte (names copied). Measured in the installer's peak RSS over its
/// usage before, fresh, whole snapshots into 2 to 20 pods: 20,000 Services of short names
/// (3.3 MiB, 60,001 objects) 15.1 MiB, of 500-character names (12.8 MiB) 24.1 MiB, 40,000
/// (6.5 MiB) 29.4 MiB, the text included: about 1 byte a byte and 200 a object. These are
/// above each of those figures less its text.
const PARSE_PER_OBJECT: u64 = 256;
const PARSE_BYTES_PER_BYTE_DIVISOR: u64 = 4;

/// A need under this is not checked: a look at the cgroup costs about what a small change
/// costs, and the headroom covers it.
const DOCUMENT_CHECK_FROM: u64 = 1 << 20;

/// Before a document's body is read into one buffer of its declared `bytes`: whether this
/// process's own memory can hold it. A process killed while it reads helps no pod; refused,
/// it tells the agent what to raise. Only when some limit binds this process.
pub fn body_fits(bytes: u64) -> Result<(), OverBudget> {
    own_fits(bytes, memcg::Charge::DocumentRead { bytes, whole: true })
}

/// A body sent without its length, `read` bytes of it arrived: whether its buffer may grow
/// to `buffer` bytes.
pub fn body_grows(read: u64, buffer: u64) -> Result<(), OverBudget> {
    own_fits(buffer, memcg::Charge::DocumentRead { bytes: read, whole: false })
}

/// Before `text` is parsed: whether parsing and applying it fits in this process's own
/// memory (the kernel work it asks for is checked after, by `apply_fits`).
pub fn document_fits(text: &[u8]) -> Result<(), OverBudget> {
    let bytes = text.len() as u64;
    // At most one object per two bytes: a text this short needs less than the check's floor.
    if bytes / PARSE_BYTES_PER_BYTE_DIVISOR + bytes / 2 * PARSE_PER_OBJECT < DOCUMENT_CHECK_FROM {
        return Ok(());
    }
    let objects = text.iter().filter(|&&b| b == b'{').count() as u64;
    let needed = bytes / PARSE_BYTES_PER_BYTE_DIVISOR + objects.saturating_mul(PARSE_PER_OBJECT);
    own_fits(needed, memcg::Charge::DocumentParse { bytes, objects })
}

/// What a change holds of this process's own memory per byte of the stored document it reads
/// (the text, the snapshot parsed from it or its index, the document the change makes).
/// Measured in a fresh installer's first change, its peak RSS over its usage before: 3.8 to
/// 4.8 times, over 20,000 and 40,000 Services of short names (3.3, 6.5 MiB) and 20,000 of
/// 500-character names (12.8 MiB).
const STORED_PER_BYTE: u64 = 5;

/// Before the stored document of `bytes` (its journal included) is read from the files for a
/// change (the long-lived applier keeps it in memory between changes; a one-shot reads it
/// each time): whether this process's own memory holds that.
pub fn stored_fits(bytes: u64) -> Result<(), OverBudget> {
    own_fits(bytes.saturating_mul(STORED_PER_BYTE), memcg::Charge::StoredRead { bytes })
}

fn own_fits(needed: u64, charge: memcg::Charge) -> Result<(), OverBudget> {
    if needed < DOCUMENT_CHECK_FROM || crate::state::fails_here("memory-budget") {
        return Ok(());
    }
    let Some(memcg) = own_memcg() else { return Ok(()) };
    match memcg.read() {
        Ok(reading) => memcg::own_fits(&reading, needed, charge),
        Err(_) => Ok(()),
    }
}

/// Work of a pod smaller than this is not checked again on its own: a look at the cgroup
/// costs about what a small change costs the kernel, and the estimate made before the apply
/// and the headroom cover it. A rebuild (10,000 Services: about 30,000 elements) is checked.
const POD_CHECK_FROM: u64 = 256 << 10;

/// During an apply, before one pod is sent `elements`: whether they still fit (the estimate
/// made before the apply can be wrong; a pod refused here keeps its whole layer). Only when
/// some limit bound this process at the apply's start (the measure was made then).
pub(super) fn pod_fits(elements: u64) -> Result<(), OverBudget> {
    let (Some(memcg), Some(&per)) = (own_memcg(), MEASURED.get()) else { return Ok(()) };
    if crate::state::fails_here("memory-budget") {
        return Ok(());
    }
    if elements.saturating_mul(per) < POD_CHECK_FROM {
        return Ok(());
    }
    match memcg.read() {
        Ok(reading) => memcg::fits(&reading, elements, per),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the tables hold, an interval set's elements twice.
    fn built(l: &ServiceLayer) -> u64 {
        layer::services_tables(l)
            .unwrap()
            .iter()
            .flat_map(|t| &t.sets)
            .map(|s| s.elements.len() as u64 * if s.interval { 2 } else { 1 })
            .sum()
    }

    #[test]
    fn layer_elements_is_what_the_tables_hold() {
        let mut l = sample_layer(300, 200);
        assert_eq!(layer_elements(&l), built(&l));
        // Services without endpoints, mesh VIPs, a UDP port, overlapping ranges, count mode.
        for (i, p) in l.ports.iter_mut().enumerate() {
            p.has_endpoints = i % 3 != 0;
            if i % 7 == 0 {
                p.proto = Proto::Udp;
            }
        }
        l.ports.sort();
        l.mesh_vips = l.ports.iter().step_by(5).map(|p| p.vip).collect();
        l.mesh_vips.sort();
        l.mesh_vips.dedup();
        l.ranges.push("10.96.0.0/16".parse().unwrap());
        l.ranges.push("192.168.7.7/32".parse().unwrap());
        assert_eq!(layer_elements(&l), built(&l));
        l.mode = LayerMode::Count;
        assert_eq!(layer_elements(&l), built(&l));
        let v4 = sample_layer(40, 0);
        let v4 = ServiceLayer { ranges: vec!["10.96.0.0/12".parse().unwrap()], ..v4 };
        assert_eq!(layer_elements(&v4), built(&v4));
        l.mode = LayerMode::Off;
        assert_eq!(layer_elements(&l), 0);
        // The count can fail: one Service more is more elements.
        assert!(layer_elements(&sample_layer(301, 200)) > layer_elements(&sample_layer(300, 200)));
    }

    #[test]
    fn the_quick_bound_is_at_least_what_the_tables_hold() {
        let families = |l: &ServiceLayer| l.families().len() as u64;
        // No profile shared: every port keyed, the bound within a chain per family of the count.
        let unshared = sample_layer(300, 200);
        let (count, bound) = (built(&unshared), layer_bound(&unshared));
        assert!(bound >= count, "{bound} < {count}");
        assert!(bound - count <= families(&unshared) * (layer::MAX_PROFILE_CHAINS as u64 + 1), "{bound} vs {count}");
        // Profiles shared (chained, one element a Service), with the chains decided or given,
        // mesh VIPs listed twice, ports unsorted, and no endpoints for some.
        let mut shared = sample_layer(300, 200);
        for (i, p) in shared.ports.iter_mut().enumerate() {
            p.port = if i % 2 == 0 { 80 } else { 8080 };
            p.has_endpoints = i % 10 != 0;
        }
        shared.ports.sort();
        shared.mesh_vips = shared.ports.iter().step_by(9).map(|p| p.vip).collect();
        let mut layers = vec![shared.clone()];
        layers.push(ServiceLayer { chained: Some(shared.profile_chains()), ..shared.clone() });
        let mut unsorted = shared.clone();
        unsorted.ports.reverse();
        layers.push(unsorted);
        layers.push(ServiceLayer { mode: LayerMode::Count, ..shared.clone() });
        for l in &layers {
            let (count, bound) = (built(l), layer_bound(l));
            assert!(bound >= count, "{bound} < {count}");
            assert!(bound <= count + l.ports.len() as u64 + families(l) * (layer::MAX_PROFILE_CHAINS as u64 + 1));
        }
        assert!(built(&shared) < built(&unshared), "the shared layer is chained");
        assert_eq!(layer_bound(&ServiceLayer { mode: LayerMode::Off, ..shared }), 0);
    }
}
