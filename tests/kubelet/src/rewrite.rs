//! Pure helpers: how a container's command line and addresses are translated (`0.0.0.0` to
//! the pod IP, `$(VAR)` expansion, Service names to pod IPs), loopback pod-IP allocation and
//! HTTP probe answers.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

/// Replaces the wildcard bind address `0.0.0.0` (and `[::]`) with the pod IP, so that every
/// pod listens on its own loopback address.
pub fn bind_to_pod_ip(a: &str, ip: &str) -> String {
    a.replace("0.0.0.0", ip).replace("[::]", ip)
}

/// Kubernetes `$(VAR)` expansion (`$$` escapes); unknown references stay as written.
pub fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'$' && i + 1 < b.len() {
            if b[i + 1] == b'$' {
                out.push('$');
                i += 2;
                continue;
            }
            if b[i + 1] == b'(' {
                if let Some(end) = s[i + 2..].find(')') {
                    let name = &s[i + 2..i + 2 + end];
                    if let Some(v) = env.get(name) {
                        out.push_str(v);
                        i += 3 + end;
                        continue;
                    }
                }
            }
        }
        let ch = s[i..].chars().next().unwrap_or('$');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// `<svc>.<ns>.svc[.cluster.local]` host names in an argument: `(start, end, svc, ns, port)`
/// where `port` is the `:NNNN` right after the name, if any.
pub fn service_hosts(a: &str) -> Vec<(usize, usize, String, String, Option<u16>)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(pos) = a[from..].find(".svc") {
        let at = from + pos;
        let mut end = at + ".svc".len();
        if a[end..].starts_with(".cluster.local") {
            end += ".cluster.local".len();
        }
        let next = a[end..].chars().next();
        from = end;
        if !matches!(next, None | Some(':') | Some('/') | Some(' ')) {
            continue;
        }
        let start = a[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'))
            .map(|i| i + 1)
            .unwrap_or(0);
        let Some((svc, ns)) = a[start..at].split_once('.') else {
            continue;
        };
        if svc.is_empty() || ns.is_empty() || ns.contains('.') {
            continue;
        }
        let port = a[end..].strip_prefix(':').and_then(|r| {
            let digits: String = r.chars().take_while(|c| c.is_ascii_digit()).collect();
            digits.parse().ok()
        });
        out.push((start, end, svc.to_string(), ns.to_string(), port));
    }
    out
}

/// Parses a node's `spec.podCIDR` when it is an IPv4 loopback /24 (or wider): the base.
pub fn loopback_cidr(cidr: &str) -> Option<(Ipv4Addr, u8)> {
    let (ip, bits) = cidr.split_once('/')?;
    let ip: Ipv4Addr = ip.parse().ok()?;
    let bits: u8 = bits.parse().ok()?;
    (ip.is_loopback() && (8..=24).contains(&bits)).then_some((ip, bits))
}

/// The first free host address of `base/bits` (skipping `.0`, `.1` and `.255` of each /24)
/// not in `used`.
pub fn allocate(base: Ipv4Addr, bits: u8, used: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
    let start = u32::from(base) & (u32::MAX << (32 - u32::from(bits)));
    let size = 1u32 << (32 - u32::from(bits));
    (0..size)
        .map(|i| Ipv4Addr::from(start + i))
        .filter(|ip| !matches!(ip.octets()[3], 0 | 1 | 255))
        .find(|ip| ip.is_loopback() && !used.contains(ip))
}

/// The host of the first URL in `a` (`scheme://host...`) that is not a loopback address
/// literal or `localhost`, if any: such an argument would make the process leave loopback
/// (or do a DNS lookup). Model sources `hf://ORG/REPO` and `s3://BUCKET/KEY` name no host:
/// where they are fetched from is the HF_ENDPOINT / AWS_ENDPOINT_URL of the environment.
pub fn non_loopback_url(a: &str) -> Option<String> {
    let mut rest = a;
    while let Some(i) = rest.find("://") {
        let after = &rest[i + 3..];
        let scheme = rest[..i]
            .rsplit(|c: char| !c.is_ascii_alphanumeric())
            .next()
            .unwrap_or("");
        if scheme == "hf" || scheme == "s3" {
            rest = after;
            continue;
        }
        let authority = after.split(['/', '?', '#']).next().unwrap_or("");
        let hostport = authority.rsplit('@').next().unwrap_or(authority);
        let host = if let Some(v6) = hostport.strip_prefix('[') {
            v6.split(']').next().unwrap_or("").to_string()
        } else {
            hostport.split(':').next().unwrap_or("").to_string()
        };
        let ok = host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if !ok {
            return Some(host);
        }
        rest = after;
    }
    None
}

/// The status code of an HTTP answer's status line.
pub fn http_status(head: &str) -> Option<u16> {
    let line = head.lines().next()?;
    let mut parts = line.split_whitespace();
    let proto = parts.next()?;
    if !proto.starts_with("HTTP/") {
        return None;
    }
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_expands_and_finds_services() {
        assert_eq!(
            bind_to_pod_ip("0.0.0.0:8080", "127.1.0.2"),
            "127.1.0.2:8080"
        );
        assert_eq!(bind_to_pod_ip("[::]:80", "127.1.0.2"), "127.1.0.2:80");
        let env = BTreeMap::from([("A".to_string(), "1".to_string())]);
        assert_eq!(expand("x$(A)y$(B)$$(A)", &env), "x1y$(B)$(A)");
        let s = service_hosts("http://op-metrics.ns1.svc:8080/healthz");
        assert_eq!(s.len(), 1);
        let (a, b, svc, ns, port) = &s[0];
        assert_eq!(
            (svc.as_str(), ns.as_str(), *port),
            ("op-metrics", "ns1", Some(8080))
        );
        assert_eq!(
            &"http://op-metrics.ns1.svc:8080/healthz"[*a..*b],
            "op-metrics.ns1.svc"
        );
        assert_eq!(service_hosts("x.y.svc.cluster.local")[0].3, "y");
        assert!(service_hosts("a.b.svcx").is_empty());
        assert_eq!(non_loopback_url("http://127.1.0.2:8080/x"), None);
        assert_eq!(
            non_loopback_url("hf://org/repo@main/m.gguf s3://bucket/k"),
            None
        );
        assert_eq!(
            non_loopback_url("--u=http://[::1]:80 https://localhost/"),
            None
        );
        assert_eq!(
            non_loopback_url("http://example.com/x").as_deref(),
            Some("example.com")
        );
        assert_eq!(
            non_loopback_url("http://10.0.0.1:80").as_deref(),
            Some("10.0.0.1")
        );
    }

    #[test]
    fn loopback_ips_are_allocated_from_the_node_range() {
        assert!(loopback_cidr("10.0.0.0/24").is_none());
        let (base, bits) = loopback_cidr("127.1.2.0/24").unwrap();
        let mut used = BTreeSet::new();
        let a = allocate(base, bits, &used).unwrap();
        assert_eq!(a, Ipv4Addr::new(127, 1, 2, 2));
        used.insert(a);
        assert_eq!(
            allocate(base, bits, &used).unwrap(),
            Ipv4Addr::new(127, 1, 2, 3)
        );
        let full: BTreeSet<Ipv4Addr> = (2..=254).map(|i| Ipv4Addr::new(127, 1, 2, i)).collect();
        assert!(allocate(base, bits, &full).is_none());
        assert_eq!(
            http_status("HTTP/1.1 503 Service Unavailable\r\n"),
            Some(503)
        );
        assert_eq!(http_status("garbage"), None);
    }
}
