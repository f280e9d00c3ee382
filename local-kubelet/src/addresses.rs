//! Pod addresses: the pool the local kubelet hands them out from, and putting them on (and
//! taking them off) the loopback interface with iproute2's `ip`.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};

/// An address in the pod range that no pod ever holds: the local kubelet never hands out
/// 10.244.255.0/24. A fixture that needs "an address nothing listens on" uses it: a connect
/// fails at once on this machine.
pub const UNHELD_POD_ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 244, 255, 2);

/// Pod addresses: 10.244.0.1 to 10.244.254.254 (kind's pod range), one per pod uid, each added
/// to the loopback interface while its pod lives, so that pods reach each other and Prometheus
/// reaches them. `cluster up` routes the rest of the range to nowhere, so a connect to a pod
/// that is gone fails on this machine; 10.244.255.0/24 is never handed
/// out, for fixtures that need an address nothing holds ([`UNHELD_POD_ADDRESS`]). Not 127.0.0.0/8 itself: the apiserver
/// refuses loopback addresses in Endpoints and EndpointSlices, so Services would have no
/// endpoints.
#[derive(Debug, Default)]
pub(crate) struct IpPool {
    by_uid: HashMap<String, Ipv4Addr>,
    next: u32,
}

impl IpPool {
    const FIRST: u32 = u32::from_be_bytes([10, 244, 0, 1]);
    const LAST: u32 = u32::from_be_bytes([10, 244, 254, 254]);

    /// The address of pod `uid`: the one it has, else its `previous` one (a restarted kubelet
    /// keeps what the pod status reports) when free and claimable, else the next free one.
    /// `claim` puts an address on the host and says false when it cannot be had (another
    /// kubelet on this machine holds it).
    pub fn allocate(
        &mut self,
        uid: &str,
        previous: Option<Ipv4Addr>,
        mut claim: impl FnMut(Ipv4Addr) -> bool,
    ) -> Option<Ipv4Addr> {
        if let Some(ip) = self.by_uid.get(uid) {
            return Some(*ip);
        }
        let used: HashSet<Ipv4Addr> = self.by_uid.values().copied().collect();
        let in_range = |ip: &Ipv4Addr| (Self::FIRST..=Self::LAST).contains(&u32::from(*ip));
        let ip = match previous.filter(|ip| in_range(ip) && !used.contains(ip) && claim(*ip)) {
            Some(ip) => ip,
            None => {
                let span = Self::LAST - Self::FIRST + 1;
                let mut tried = 0;
                loop {
                    let candidate = Ipv4Addr::from(Self::FIRST + self.next % span);
                    self.next += 1;
                    tried += 1;
                    if tried > span {
                        return None;
                    }
                    // Skip .0 and .255 in each /24, which some programs refuse to bind.
                    let last = candidate.octets()[3];
                    if last != 0 && last != 255 && !used.contains(&candidate) && claim(candidate) {
                        break candidate;
                    }
                }
            }
        };
        self.by_uid.insert(uid.to_owned(), ip);
        Some(ip)
    }

    pub fn release(&mut self, uid: &str) -> Option<Ipv4Addr> {
        self.by_uid.remove(uid)
    }

    /// Forgets every address, returning them.
    pub fn drain(&mut self) -> Vec<Ipv4Addr> {
        self.by_uid.drain().map(|(_, ip)| ip).collect()
    }
}

/// Adds `ip`/32 to the loopback interface; false when it is already there (another kubelet's)
/// or cannot be added.
pub(crate) fn add_host_address(ip: Ipv4Addr) -> bool {
    let status = std::process::Command::new("ip")
        .args(["-4", "addr", "add", &format!("{ip}/32"), "dev", "lo"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    match status {
        Ok(s) => s.success(),
        Err(e) => {
            tracing::error!(error = %e, "cannot run `ip` (iproute2) to add pod addresses");
            false
        }
    }
}

/// Whether `ip`/32 is on the loopback interface, i.e. a pod of a local kubelet holds it (a
/// released address is gone; a connection to it fails with "No route to host").
pub fn host_has_address(ip: IpAddr) -> bool {
    std::process::Command::new("ip")
        .args(["-o", "addr", "show", "dev", "lo"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .any(|word| word.split('/').next() == Some(ip.to_string().as_str()))
        })
}

/// Removes `ip`/32 from the loopback interface.
pub(crate) fn remove_host_address(ip: Ipv4Addr) {
    let _ = std::process::Command::new("ip")
        .args(["-4", "addr", "del", &format!("{ip}/32"), "dev", "lo"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_pool_gives_each_pod_its_own_address_in_the_pod_range() {
        let mut pool = IpPool::default();
        let free = |_: Ipv4Addr| true;
        let a = pool.allocate("a", None, free).unwrap();
        let b = pool.allocate("b", None, free).unwrap();
        assert_eq!(a, Ipv4Addr::new(10, 244, 0, 1));
        assert_eq!(b, Ipv4Addr::new(10, 244, 0, 2));
        assert!(!a.is_loopback(), "the apiserver refuses loopback endpoints");
        assert_eq!(pool.allocate("a", None, free), Some(a), "stable per pod");
        // A restarted kubelet keeps a pod's reported address when it is free.
        assert_eq!(
            pool.allocate("c", Some(Ipv4Addr::new(10, 244, 9, 9)), free),
            Some(Ipv4Addr::new(10, 244, 9, 9))
        );
        assert_ne!(
            pool.allocate("d", Some(a), free),
            Some(a),
            "an address in use is not handed out twice"
        );
        assert_eq!(pool.release("a"), Some(a));
        assert!(!pool.by_uid.contains_key("a"));
    }

    #[test]
    fn ip_pool_never_hands_out_the_unheld_addresses() {
        let unheld = UNHELD_POD_ADDRESS;
        let mut pool = IpPool {
            // The last address of 10.244.254.0/24 comes next; then the range wraps around.
            next: IpPool::LAST - IpPool::FIRST,
            ..Default::default()
        };
        assert_eq!(
            pool.allocate("reported", Some(unheld), |_| true),
            Some(Ipv4Addr::new(10, 244, 254, 254)),
            "a pod reporting an unheld address gets another"
        );
        assert_eq!(
            pool.allocate("next", None, |_| true),
            Some(Ipv4Addr::new(10, 244, 0, 1))
        );
        assert_eq!(unheld.octets()[..3], [10, 244, 255]);
    }

    #[test]
    fn ip_pool_skips_addresses_another_kubelet_holds() {
        let mut pool = IpPool::default();
        let taken = [Ipv4Addr::new(10, 244, 0, 1), Ipv4Addr::new(10, 244, 0, 2)];
        let claim = |ip: Ipv4Addr| !taken.contains(&ip);
        assert_eq!(
            pool.allocate("a", Some(taken[0]), claim),
            Some(Ipv4Addr::new(10, 244, 0, 3))
        );
    }

    #[test]
    fn ip_pool_skips_network_and_broadcast_octets() {
        let mut pool = IpPool {
            next: 253,
            ..Default::default()
        };
        let ips: Vec<Ipv4Addr> = (0..4)
            .map(|i| pool.allocate(&i.to_string(), None, |_| true).unwrap())
            .collect();
        assert_eq!(
            ips,
            [
                Ipv4Addr::new(10, 244, 0, 254),
                Ipv4Addr::new(10, 244, 1, 1),
                Ipv4Addr::new(10, 244, 1, 2),
                Ipv4Addr::new(10, 244, 1, 3)
            ]
        );
    }
}
