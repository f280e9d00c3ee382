//! What every pod worker of the local kubelet shares: the client, the node's identity, the
//! image resolver, the ConfigMap and Secret caches, the pod address pool and the running
//! processes.

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::addresses::{IpPool, add_host_address, remove_host_address};
use crate::api;
use crate::process::ImageResolver;
use crate::volumes;

/// What every pod worker shares.
pub(crate) struct KubeletContext {
    pub client: kube::Client,
    pub node_name: String,
    pub host_ip: String,
    pub state_dir: PathBuf,
    pub images: ImageResolver,
    pub apiserver: (String, u16),
    pub backoff: (Duration, Duration),
    pub volumes: volumes::VolumeSources,
    pub ips: Mutex<IpPool>,
    pub pids: Mutex<HashSet<u32>>,
    /// The running container instances' "has ended" signals, for the API's followers.
    pub instances: Arc<api::Instances>,
}

impl KubeletContext {
    /// The pod's address, put on the loopback interface (see [`IpPool`]).
    pub fn allocate_ip(&self, uid: &str, previous: Option<Ipv4Addr>) -> Option<Ipv4Addr> {
        self.ips.lock().allocate(uid, previous, add_host_address)
    }

    pub fn release_ip(&self, uid: &str) {
        if let Some(ip) = self.ips.lock().release(uid) {
            remove_host_address(ip);
        }
    }

    pub fn track_pid(&self, pid: u32, running: bool) {
        let mut pids = self.pids.lock();
        if running {
            pids.insert(pid);
        } else {
            pids.remove(&pid);
        }
    }

    /// Removes every pod address from the host (the kubelet is stopping).
    pub fn release_all_ips(&self) {
        let ips: Vec<Ipv4Addr> = self.ips.lock().drain();
        for ip in ips {
            remove_host_address(ip);
        }
    }
}
