//! Which addresses a replica may have (`admin.allowed_networks`): a replica added through the
//! admin API, found by DNS or shared by another instance must not turn inferlb into a way in to
//! the cloud's metadata service or a host's link-local neighbours.
//!
//! The rule: an address must be inside an allowed network, and the always-refused ranges below
//! (link-local, the unspecified address, the cloud metadata addresses) win over any allowed
//! network less specific than themselves, so `0.0.0.0/0` does not open 169.254.169.254; only an
//! entry at least as specific (`169.254.169.254/32`) does. An IPv4 address carried in IPv6
//! (`::ffff:a.b.c.d`, and the NAT64 prefix `64:ff9b::/96`) is judged as that IPv4 address.
//!
//! Pure: parsing and judging, no I/O. Where the checks run: `config` (conf replicas), `admin`
//! (runtime adds), `discovery` (DNS answers) and the proxy's `upstream_peer` (every attempt).

use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;

/// The default `admin.allowed_networks`: loopback and the private ranges (RFC 1918, IPv6 ULA).
/// Not CGNAT's 100.64.0.0/10: clouds keep their own services in it (Alibaba's metadata and DNS
/// at 100.100.x.x); an operator whose replicas live there (Tailscale, some pod networks) adds it.
pub const DEFAULT_ALLOWED: &[&str] = &[
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
];

/// Refused inside any allowed network less specific than the entry itself.
const REFUSED: &[(&str, &str)] = &[
    (
        "0.0.0.0/8",
        "the unspecified address (a connection to it reaches this host)",
    ),
    (
        "::/128",
        "the unspecified address (a connection to it reaches this host)",
    ),
    ("169.254.0.0/16", "link-local"),
    ("fe80::/10", "link-local"),
    ("169.254.169.254/32", "a cloud metadata address"),
    ("fd00:ec2::254/128", "a cloud metadata address (AWS, IPv6)"),
    ("100.100.100.200/32", "a cloud metadata address (Alibaba)"),
];

/// The allowed networks and the always-refused ones.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Networks {
    allowed: Vec<IpNet>,
    refused: Vec<(IpNet, &'static str)>,
}

impl Default for Networks {
    fn default() -> Self {
        let defaults: Vec<String> = DEFAULT_ALLOWED.iter().map(|s| s.to_string()).collect();
        Networks::parse(&defaults).unwrap_or_else(|_| Networks {
            allowed: vec![],
            refused: refused(),
        })
    }
}

fn refused() -> Vec<(IpNet, &'static str)> {
    REFUSED
        .iter()
        .filter_map(|(net, why)| net.parse().ok().map(|n| (n, *why)))
        .collect()
}

/// One entry: a CIDR (`10.0.0.0/8`) or a single address (`10.1.2.3`, meaning /32 or /128).
fn parse_net(entry: &str) -> Result<IpNet, String> {
    let entry = entry.trim();
    let net = match entry.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => match entry.parse::<IpAddr>() {
            Ok(ip) => IpNet::from(ip),
            Err(_) => {
                return Err(format!(
                    "{entry:?} is not a CIDR network (10.0.0.0/8) or an address"
                ))
            }
        },
    };
    if net.trunc() != net {
        return Err(format!(
            "{entry:?} has bits set past its prefix length (did you mean {}?)",
            net.trunc()
        ));
    }
    if let IpNet::V6(v6) = net {
        if judged_as(IpAddr::V6(v6.network())) != IpAddr::V6(v6.network()) {
            return Err(format!(
                "{entry:?} is IPv4 written as IPv6: write the IPv4 network, which is how such addresses are judged"
            ));
        }
    }
    Ok(net)
}

/// The address a connection to `ip` really reaches, for judging: IPv4 carried in IPv6 is
/// taken out (IPv4-mapped `::ffff:0:0/96`, NAT64's well-known `64:ff9b::/96`).
pub fn judged_as(ip: IpAddr) -> IpAddr {
    let IpAddr::V6(v6) = ip else { return ip };
    if let Some(v4) = v6.to_ipv4_mapped() {
        return IpAddr::V4(v4);
    }
    if v6.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        let o = v6.octets();
        return IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]));
    }
    ip
}

impl Networks {
    /// The conf's list; each bad entry is named by its index (`[2]: ...`).
    pub fn parse(entries: &[String]) -> Result<Networks, String> {
        let allowed = entries
            .iter()
            .enumerate()
            .map(|(i, e)| parse_net(e).map_err(|m| format!("[{i}]: {m}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Networks {
            allowed,
            refused: refused(),
        })
    }

    /// Whether a replica may be at `ip`; the error says why not, naming the address.
    pub fn check(&self, ip: IpAddr) -> Result<(), String> {
        let judged = judged_as(ip);
        let shown = if judged == ip {
            ip.to_string()
        } else {
            format!("{ip} (that is {judged})")
        };
        let allowed = self
            .allowed
            .iter()
            .filter(|n| n.contains(&judged))
            .map(IpNet::prefix_len)
            .max();
        let refused = self
            .refused
            .iter()
            .filter(|(n, _)| n.contains(&judged))
            .max_by_key(|(n, _)| n.prefix_len());
        match (allowed, refused) {
            (None, _) => Err(format!(
                "{shown} is outside admin.allowed_networks (by default loopback and the private \
                 ranges); add its network there to allow it"
            )),
            (Some(len), Some((net, why))) if len < net.prefix_len() => Err(format!(
                "{shown} is {why}, refused unless admin.allowed_networks lists {net} itself"
            )),
            _ => Ok(()),
        }
    }

    /// The same for a peer about to be connected to; anything but an IP socket is refused.
    pub fn check_peer(
        &self,
        addr: &pingora_core::protocols::l4::socket::SocketAddr,
    ) -> Result<(), String> {
        match addr.as_inet() {
            Some(inet) => self.check(inet.ip()),
            None => Err(format!("{addr} is not an IP address")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Networks {
        Networks::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("valid")
    }

    #[test]
    fn addresses_are_judged_against_the_default() {
        let d = Networks::default();
        let cases: &[(&str, Result<(), &str>)] = &[
            ("127.0.0.1", Ok(())),
            ("127.3.4.5", Ok(())),
            ("::1", Ok(())),
            ("10.1.2.3", Ok(())),
            ("172.16.0.1", Ok(())),
            ("172.31.255.255", Ok(())),
            ("192.168.1.10", Ok(())),
            ("fd12::1", Ok(())),
            ("172.32.0.1", Err("outside")),
            ("8.8.8.8", Err("outside")),
            ("100.64.0.1", Err("outside")),
            ("2001:db8::1", Err("outside")),
            ("169.254.169.254", Err("outside")),
            ("169.254.1.1", Err("outside")),
            ("fe80::1", Err("outside")),
            ("0.0.0.0", Err("outside")),
            ("::", Err("outside")),
            // Inside fc00::/7, but always refused; CGNAT is not in the default.
            ("fd00:ec2::254", Err("metadata")),
            ("100.100.100.200", Err("outside")),
            // IPv4 in IPv6 is judged as IPv4.
            ("::ffff:127.0.0.1", Ok(())),
            ("::ffff:10.0.0.1", Ok(())),
            ("::ffff:169.254.169.254", Err("that is 169.254.169.254")),
            ("::ffff:8.8.8.8", Err("outside")),
            ("64:ff9b::a9fe:a9fe", Err("that is 169.254.169.254")),
            ("64:ff9b::a00:1", Ok(())),
        ];
        for (ip, want) in cases {
            let got = d.check(ip.parse().expect("ip"));
            match (want, &got) {
                (Ok(()), Ok(())) => {}
                (Err(needle), Err(e)) if e.contains(needle) => {}
                _ => panic!("{ip}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn refusals_win_over_a_broad_allow_unless_listed_as_specifically() {
        let cases: &[(&[&str], &str, Result<(), &str>)] = &[
            (&["0.0.0.0/0"], "8.8.8.8", Ok(())),
            (&["0.0.0.0/0"], "169.254.169.254", Err("metadata")),
            (&["0.0.0.0/0"], "169.254.1.1", Err("link-local")),
            (&["0.0.0.0/0"], "0.0.0.0", Err("unspecified")),
            (&["0.0.0.0/0"], "100.100.100.200", Err("Alibaba")),
            (&["::/0"], "fe80::1", Err("link-local")),
            (&["::/0"], "fd00:ec2::254", Err("AWS")),
            (&["::/0"], "::", Err("unspecified")),
            (&["::/0"], "::ffff:169.254.169.254", Err("outside")),
            (
                &["::/0", "0.0.0.0/0"],
                "::ffff:169.254.169.254",
                Err("metadata"),
            ),
            (&["100.64.0.0/10"], "100.64.0.1", Ok(())),
            (&["100.64.0.0/10"], "100.100.100.200", Err("Alibaba")),
            // Listing link-local opens link-local, not the metadata address inside it.
            (&["169.254.0.0/16"], "169.254.1.1", Ok(())),
            (&["169.254.0.0/16"], "169.254.169.254", Err("metadata")),
            (&["fe80::/10"], "fe80::1", Ok(())),
            // The exact address, as a /32 or bare, lets it through.
            (&["169.254.169.254/32"], "169.254.169.254", Ok(())),
            (&["169.254.169.254"], "169.254.169.254", Ok(())),
            (&["169.254.169.254"], "::ffff:169.254.169.254", Ok(())),
            (&["fd00:ec2::254"], "fd00:ec2::254", Ok(())),
            (&["10.0.0.5"], "10.0.0.5", Ok(())),
            (&["10.0.0.5"], "10.0.0.6", Err("outside")),
            (&[], "127.0.0.1", Err("outside")),
        ];
        for (list, ip, want) in cases {
            let got = nets(list).check(ip.parse().expect("ip"));
            match (want, &got) {
                (Ok(()), Ok(())) => {}
                (Err(needle), Err(e)) if e.contains(needle) => {}
                _ => panic!("{list:?} {ip}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn bad_entries_are_named() {
        let cases: &[(&[&str], &str)] = &[
            (&["10.0.0.0/8", "ten"], "[1]: \"ten\" is not a CIDR"),
            (&["10.0.0.1/8"], "did you mean 10.0.0.0/8"),
            (&["10.0.0.0/33"], "not a CIDR"),
            (&["::ffff:0:0/96"], "IPv4 written as IPv6"),
            (&["::ffff:169.254.169.254"], "IPv4 written as IPv6"),
            (&[""], "not a CIDR"),
        ];
        for (list, needle) in cases {
            let list: Vec<String> = list.iter().map(|s| s.to_string()).collect();
            let e = Networks::parse(&list).expect_err("refused");
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
    }

    #[test]
    fn a_peer_is_judged_by_its_ip() {
        use pingora_core::protocols::l4::socket::SocketAddr;
        let d = Networks::default();
        let ok = SocketAddr::Inet("127.0.0.1:8000".parse().expect("addr"));
        let metadata = SocketAddr::Inet("169.254.169.254:80".parse().expect("addr"));
        let mapped = SocketAddr::Inet("[::ffff:169.254.169.254]:80".parse().expect("addr"));
        assert_eq!(d.check_peer(&ok), Ok(()));
        assert!(d.check_peer(&metadata).is_err());
        assert!(d.check_peer(&mapped).is_err());
    }
}
