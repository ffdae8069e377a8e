//! The address families capture speaks. Each family a pod has gets its own nftables table
//! (`table ip` / `table ip6`, as kube-proxy's nftables mode runs one proxier per family)
//! and its own policy rule and route; one builder makes both.

use std::fmt;
use std::net::IpAddr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    /// Both families, IPv4 first: the order tables are sent in and listed.
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    /// The family of an address.
    pub fn of(addr: IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::Ipv4,
            IpAddr::V6(_) => Family::Ipv6,
        }
    }

    /// `NFPROTO_IPV4` / `NFPROTO_IPV6`: an nftables table's family, and the family a tproxy
    /// or NAT expression names.
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Ipv4 => libc::NFPROTO_IPV4 as u8,
            Family::Ipv6 => libc::NFPROTO_IPV6 as u8,
        }
    }

    /// nft's keyword for the table family (`table ip`, `table ip6`) and for the address
    /// header match (`ip daddr`, `ip6 daddr`).
    pub fn nft_name(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }

    /// Every destination of the family, as `ip route` writes it.
    pub fn any(self) -> &'static str {
        match self {
            Family::Ipv4 => "0.0.0.0/0",
            Family::Ipv6 => "::/0",
        }
    }

    /// Bytes in an address of the family.
    pub fn addr_len(self) -> u32 {
        match self {
            Family::Ipv4 => 4,
            Family::Ipv6 => 16,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::Ipv4 => "IPv4",
            Family::Ipv6 => "IPv6",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_the_kernels() {
        assert_eq!((Family::Ipv4.nfproto(), Family::Ipv6.nfproto()), (2, 10));
        assert_eq!(Family::of("::1".parse().unwrap()), Family::Ipv6);
        assert_eq!(Family::of("10.0.0.1".parse().unwrap()), Family::Ipv4);
    }
}
