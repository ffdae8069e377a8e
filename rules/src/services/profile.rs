//! Port profiles: which Services share a chain of their own in the layer (the one
//! decision of it, `choose_chained`, whether counted from the Services' lists or straight
//! from a layer's sorted ports), the chains' names, and the VIPs a change of that decision
//! moves.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use super::{
    ProfileChains, ServiceLayer, ServicePort, MAX_PROFILE_CHAINS, MAX_PROFILE_PORTS, MIN_SERVICES_PER_PROFILE,
    PROFILE_CHAIN_PREFIX,
};
use crate::family::Family;
use crate::model::Proto;

/// A Service's port profile: the ports it declares, each (protocol, port, has a usable
/// endpoint), sorted. Services of one profile share its chain.
pub type Profile = Vec<(Proto, u16, bool)>;

/// The Services of `family`, by VIP (sorted), each with its profile. A port listed twice
/// has an endpoint when either listing has one (as the old `service_ports` matched first).
pub fn service_profiles(layer: &ServiceLayer, family: Family) -> Vec<(IpAddr, Profile)> {
    let mut ports: Vec<&ServicePort> = layer.ports.iter().filter(|p| Family::of(p.vip) == family).collect();
    if !ports.is_sorted() {
        ports.sort();
    }
    let mut out: Vec<(IpAddr, Profile)> = Vec::new();
    for p in ports {
        match out.last_mut() {
            Some((vip, profile)) if *vip == p.vip => match profile.last_mut() {
                Some(last) if (last.0, last.1) == (p.proto, p.port) => last.2 |= p.has_endpoints,
                _ => profile.push((p.proto, p.port, p.has_endpoints)),
            },
            _ => out.push((p.vip, vec![(p.proto, p.port, p.has_endpoints)])),
        }
    }
    out
}

/// The profiles that get a chain of their own, in profile order: those of at most `MAX_PROFILE_PORTS`
/// ports that at least `MIN_SERVICES_PER_PROFILE` Services share, the `MAX_PROFILE_CHAINS`
/// most shared. Every other Service is looked up by `VIP . proto . port` (`by_key`).
pub fn chained_profiles(services: &[(IpAddr, Profile)]) -> Vec<Profile> {
    let mut counts: BTreeMap<&Profile, usize> = BTreeMap::new();
    for (_, p) in services {
        *counts.entry(p).or_default() += 1;
    }
    choose_chained(counts.into_iter().map(|(p, n)| (p.clone(), n)).collect())
}

/// The one decision of which profiles get chains, from how many Services declare each.
fn choose_chained(counts: Vec<(Profile, usize)>) -> Vec<Profile> {
    let mut shared: Vec<(Profile, usize)> =
        counts.into_iter().filter(|(p, n)| p.len() <= MAX_PROFILE_PORTS && *n >= MIN_SERVICES_PER_PROFILE).collect();
    // Most shared first; among equals, profile order (stable).
    shared.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut chained: Vec<Profile> = shared.into_iter().take(MAX_PROFILE_CHAINS).map(|(p, _)| p).collect();
    chained.sort();
    chained
}

impl ServiceLayer {
    /// The profiles of `services` (this layer's in `family`, from `service_profiles`) that get
    /// chains: as `chained` says when set (a family it does not name has none), else decided
    /// over them.
    pub(crate) fn chained_in(&self, family: Family, services: &[(IpAddr, Profile)]) -> Vec<Profile> {
        match &self.chained {
            Some(c) => c.get(&family).cloned().unwrap_or_default(),
            None => chained_profiles(services),
        }
    }

    /// The profiles that get chains in each family this layer has Services of (`chained`
    /// when set): counted over its sorted ports without a list per Service.
    pub fn profile_chains(&self) -> ProfileChains {
        if let Some(c) = &self.chained {
            return c.clone();
        }
        let mut sorted = std::borrow::Cow::Borrowed(&self.ports[..]);
        if !sorted.is_sorted() {
            sorted.to_mut().sort();
        }
        ProfileCounts::of(&sorted).chains()
    }
}

/// How many Services of each family declare each profile: what the decision of which
/// profiles get chains (`chains`) is made from. A node that decides over two whole layers on
/// every change keeps the counts of the last layer and moves them by the Services a change
/// touches (`moved`), so the decision costs what changed, not the whole layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProfileCounts(BTreeMap<Family, HashMap<Vec<u8>, usize>>);

impl ProfileCounts {
    /// Counted over `ports` (sorted by VIP): each VIP's ports are one Service's profile.
    pub fn of(ports: &[ServicePort]) -> ProfileCounts {
        let mut counts = ProfileCounts::default();
        counts.add(ports, true);
        counts
    }

    /// These counts with the Services of `gone` taken out and those of `came` put in (each
    /// sorted by VIP, every port of each of their VIPs: a Service whose ports changed is in
    /// both, with its old ports and its new ones).
    pub fn moved(&self, gone: &[ServicePort], came: &[ServicePort]) -> ProfileCounts {
        let mut counts = self.clone();
        counts.add(gone, false);
        counts.add(came, true);
        counts
    }

    /// The profiles that get chains, per family (the one decision, `choose_chained`).
    pub fn chains(&self) -> ProfileChains {
        let profile = |b: &[u8]| -> Profile {
            b.chunks(4)
                .map(|c| (if c[0] == 6 { Proto::Tcp } else { Proto::Udp }, u16::from_be_bytes([c[1], c[2]]), c[3] != 0))
                .collect()
        };
        self.0
            .iter()
            .map(|(f, c)| (*f, choose_chained(c.iter().map(|(k, n)| (profile(k), *n)).collect())))
            .filter(|(_, chained)| !chained.is_empty())
            .collect()
    }

    /// Counts each VIP's profile in `ports` once, up or down.
    fn add(&mut self, ports: &[ServicePort], up: bool) {
        let mut key: Vec<u8> = Vec::new();
        // A profile as bytes: (protocol, port, has endpoints) per port, a port listed twice
        // merged as `service_profiles` merges it.
        for (i, p) in ports.iter().enumerate() {
            let last = key.len().checked_sub(4);
            match last {
                Some(at)
                    if ports[i - 1].vip == p.vip
                        && key[at..at + 3] == [p.proto.number(), (p.port >> 8) as u8, p.port as u8] =>
                {
                    key[at + 3] |= p.has_endpoints as u8;
                }
                _ => {
                    key.extend_from_slice(&[p.proto.number(), (p.port >> 8) as u8, p.port as u8, p.has_endpoints as u8])
                }
            }
            if ports.get(i + 1).is_none_or(|n| n.vip != p.vip) {
                let family = self.0.entry(Family::of(p.vip)).or_default();
                match (family.get_mut(&key[..]), up) {
                    (Some(n), true) => *n += 1,
                    (None, true) => {
                        family.insert(key.clone(), 1);
                    }
                    (Some(n), false) if *n > 1 => *n -= 1,
                    (Some(_), false) => {
                        family.remove(&key[..]);
                    }
                    // Counted out but never counted in: the caller's layers disagree; the
                    // decision stays that of the Services counted.
                    (None, false) => {}
                }
                key.clear();
            }
        }
    }
}

/// The number a Service of `profile` has in `family`'s table under the decision `chained`: 0
/// (`by_key`) without a chain, i + 1 for the i-th chained profile (in profile order).
pub fn profile_number(chained: &ProfileChains, family: Family, profile: &Profile) -> u32 {
    chained.get(&family).map_or(0, |c| number_in(c, profile))
}

/// The number of a Service of `profile` when `chained` (sorted) get chains.
pub(super) fn number_in(chained: &[Profile], profile: &Profile) -> u32 {
    chained.binary_search(profile).map_or(0, |i| i as u32 + 1)
}

/// The Service VIPs of `layers` whose profile's number differs between two decisions (none
/// when they are equal): their map elements change with the decision. A profile that gains
/// or loses its chain moves its own Services, and renumbers those of the profiles after it.
pub fn rechained_vips(layers: [&ServiceLayer; 2], a: &ProfileChains, b: &ProfileChains) -> Vec<IpAddr> {
    if a == b {
        return Vec::new();
    }
    let mut out = Vec::new();
    for l in layers {
        for f in Family::ALL {
            let renumbered =
                service_profiles(l, f).into_iter().filter(|(_, p)| profile_number(a, f, p) != profile_number(b, f, p));
            out.extend(renumbered.map(|(vip, _)| vip));
        }
    }
    out
}

/// The name of a profile's chain, made of the profile itself (`ports_tcp80_tcp8080`; a port
/// without a usable endpoint `tcp80-noep`), so a profile's chain keeps its name whatever
/// other profiles come and go, and a change adds or removes just the chains that differ.
pub fn profile_chain(profile: &Profile) -> String {
    let mut name = PROFILE_CHAIN_PREFIX.trim_end_matches('_').to_string();
    for &(proto, port, ok) in profile {
        name.push_str(&format!("_{}{port}{}", proto.name(), if ok { "" } else { "-noep" }));
    }
    name
}
