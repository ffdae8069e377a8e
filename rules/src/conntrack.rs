//! Conntrack's own table (ctnetlink), read and marked: before a capture is programmed in a
//! running pod whose conntrack was already on, the TCP connections it tracks were opened
//! before the capture, and are given the conntrack mark the capture never diverts
//! (`capture::PREEXISTING_CT_MARK`). A pod whose conntrack was off needs none of this: its
//! connections are marked when first seen mid-stream (docs/design.md, "Connections
//! established before the capture").

use std::io;

use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ConntrackMessage, ProtoTuple, Protocol, Tuple};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};

use crate::error::{Error, Result};
use crate::family::Family;
use crate::netlink::{Socket, NETLINK_NETFILTER};

fn conntrack_err(op: &'static str, source: io::Error) -> Error {
    Error::Conntrack { op, source }
}

fn message(family: Family, m: ConntrackMessage) -> NetfilterMessage {
    let f = match family {
        Family::Ipv4 => NetfilterProtoFamily::IPv4,
        Family::Ipv6 => NetfilterProtoFamily::IPv6,
    };
    NetfilterMessage::new(NetfilterHeader::new(f, 0, 0), m)
}

/// The original-direction tuple of a tracked TCP flow, if the entry is one.
fn tcp_tuple(entry: &NetfilterMessage) -> Option<Vec<Tuple>> {
    let netlink_packet_netfilter::NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) = &entry.inner else {
        return None;
    };
    attrs.iter().find_map(|a| match a {
        ConntrackAttribute::CtaTupleOrig(tuple)
            if tuple.iter().any(
                |t| matches!(t, Tuple::Proto(p) if p.iter().any(|p| matches!(p, ProtoTuple::Protocol(Protocol::Tcp)))),
            ) =>
        {
            Some(tuple.clone())
        }
        _ => None,
    })
}

/// Gives every TCP flow conntrack tracks in the current network namespace, in both
/// families, the conntrack mark `mark`; returns how many. An entry that ends meanwhile is
/// skipped. With conntrack off in the netns (no entries) it costs two empty dumps.
pub fn mark_tcp_flows(mark: u32) -> Result<usize> {
    let mut socket = Socket::open(NETLINK_NETFILTER).map_err(|e| conntrack_err("open", e))?;
    let mut marked = 0;
    for family in Family::ALL {
        let entries =
            socket.dump(message(family, ConntrackMessage::Get(Vec::new()))).map_err(|e| conntrack_err("dump", e))?;
        for tuple in entries.iter().filter_map(tcp_tuple) {
            // IPCTNL_MSG_CT_NEW without NLM_F_CREATE changes the existing entry.
            let update =
                ConntrackMessage::New(vec![ConntrackAttribute::CtaTupleOrig(tuple), ConntrackAttribute::CtaMark(mark)]);
            match socket.transact(message(family, update), 0) {
                Ok(()) => marked += 1,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(conntrack_err("mark", e)),
            }
        }
    }
    Ok(marked)
}
