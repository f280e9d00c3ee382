//! The watched parts of the namespace fingerprint (`pass.rs`, [`fingerprint`]), kept up to date
//! by the watches instead of walked out of the caches at every reconcile.
//!
//! Each watch (pods, policies, every EndpointSlice watch) feeds its events to a [`Digest`]
//! right after its reflector has applied them to the cache. A digest holds one 64-bit hash per
//! object (of what the fingerprint reads of it: [`Digested`]) and, per namespace, their
//! wrapping sum: an event replaces one object's term in its namespace's sum, a re-list replaces
//! the whole set at its end (`InitDone`), as the cache does. Reading a namespace's part is then
//! one lookup, where walking the caches cost every reconcile a copy of the cache's list and a
//! hash of every pod and policy of the namespace.
//!
//! The sum is the same whatever the order of the events that led to a set of objects, so a
//! digest kept by the events equals the one computed afresh from the cache ([`fresh`]); the
//! tests check that over random sequences of events. As with any 64-bit digest, two different
//! sets may collide; that would only keep a pass one change longer (`pass.rs`).
//!
//! [`fingerprint`]: super::pass::fingerprint

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::DeserializeGuard;
use kube::runtime::watcher;
use parking_lot::Mutex;
use poolpilot_api::ConnectionPolicy;

/// The seed of every hash here (fixed: the digests only need to agree within one process).
const SEED: u64 = 0x706f_6f6c_7069_6c74;

/// A new hasher with the fixed seed (foldhash: fast, not cryptographic; the names hashed are
/// the API server's).
pub(crate) fn hasher() -> impl Hasher {
    foldhash::quality::FixedState::with_seed(SEED).build_hasher()
}

/// What the fingerprint reads of one kind of object.
pub trait Digested {
    /// The object's namespace and name (`None`: not a namespaced object with a name; left out).
    fn identity(&self) -> Option<(&str, &str)>;
    /// Hashes what the fingerprint reads of it, its namespace and name included.
    fn digest_into(&self, h: &mut impl Hasher);
}

/// An object's namespace and name, when it has both.
fn named(m: &ObjectMeta) -> Option<(&str, &str)> {
    Some((m.namespace.as_deref()?, m.name.as_deref()?))
}

/// Hashes an object by its namespace, name and resource version (any change of it).
fn by_version(m: &ObjectMeta, h: &mut impl Hasher) {
    (&m.namespace, &m.name, &m.resource_version).hash(h);
}

/// A pod: its resource version (any change of it).
impl Digested for Pod {
    fn identity(&self) -> Option<(&str, &str)> {
        named(&self.metadata)
    }

    fn digest_into(&self, h: &mut impl Hasher) {
        by_version(&self.metadata, h);
    }
}

/// An EndpointSlice: its resource version.
impl Digested for EndpointSlice {
    fn identity(&self) -> Option<(&str, &str)> {
        named(&self.metadata)
    }

    fn digest_into(&self, h: &mut impl Hasher) {
        by_version(&self.metadata, h);
    }
}

/// A policy: its name, uid, generation, whether it is being deleted and whether this operator
/// can read it. Its status is left out: a status write changes nothing a pass is made from.
impl Digested for DeserializeGuard<ConnectionPolicy> {
    fn identity(&self) -> Option<(&str, &str)> {
        named(self.meta())
    }

    fn digest_into(&self, h: &mut impl Hasher) {
        let m = self.meta();
        (
            &m.namespace,
            &m.name,
            &m.uid,
            m.generation,
            m.deletion_timestamp.is_some(),
            self.0.is_ok(),
        )
            .hash(h);
    }
}

/// The metadata of a policy, readable or not.
trait Meta {
    fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
}

impl Meta for DeserializeGuard<ConnectionPolicy> {
    fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        match &self.0 {
            Ok(p) => &p.metadata,
            Err(invalid) => &invalid.metadata,
        }
    }
}

/// One object's term in its namespace's sum.
fn term<K: Digested>(object: &K) -> u64 {
    let mut h = hasher();
    object.digest_into(&mut h);
    h.finish()
}

/// The digest of one watch's objects, per namespace, kept by its events.
#[derive(Debug, Default)]
pub struct Digest {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Each object's term, by (namespace, name).
    terms: HashMap<(String, String), u64>,
    /// Per namespace, the wrapping sum of its objects' terms and how many there are.
    sums: HashMap<String, (u64, usize)>,
    /// A re-list under way (`Init` .. `InitDone`): the terms of the objects listed so far.
    relist: Option<HashMap<(String, String), u64>>,
}

impl Inner {
    fn put(&mut self, ns: &str, name: &str, term: u64) {
        let old = self.terms.insert((ns.to_owned(), name.to_owned()), term);
        let (sum, count) = self.sums.entry(ns.to_owned()).or_default();
        *sum = sum.wrapping_add(term);
        match old {
            Some(old) => *sum = sum.wrapping_sub(old),
            None => *count += 1,
        }
    }

    fn remove(&mut self, ns: &str, name: &str) {
        let Some(old) = self.terms.remove(&(ns.to_owned(), name.to_owned())) else {
            return;
        };
        if let Some((sum, count)) = self.sums.get_mut(ns) {
            *sum = sum.wrapping_sub(old);
            *count -= 1;
            if *count == 0 {
                self.sums.remove(ns);
            }
        }
    }

    /// Every namespace's sum, from the terms.
    fn sum_up(terms: &HashMap<(String, String), u64>) -> HashMap<String, (u64, usize)> {
        let mut sums: HashMap<String, (u64, usize)> = HashMap::new();
        for ((ns, _), t) in terms {
            let (sum, count) = sums.entry(ns.clone()).or_default();
            *sum = sum.wrapping_add(*t);
            *count += 1;
        }
        sums
    }
}

impl Digest {
    /// Takes in one event of the watch, after its reflector applied it to the cache.
    pub fn apply<K: Digested>(&self, event: &watcher::Event<K>) {
        let mut inner = self.inner.lock();
        match event {
            watcher::Event::Apply(o) => {
                if let Some((ns, name)) = o.identity() {
                    inner.put(ns, name, term(o));
                }
            }
            watcher::Event::Delete(o) => {
                if let Some((ns, name)) = o.identity() {
                    inner.remove(ns, name);
                }
            }
            watcher::Event::Init => inner.relist = Some(HashMap::new()),
            watcher::Event::InitApply(o) => {
                if let Some((ns, name)) = o.identity() {
                    let t = term(o);
                    let relist = inner.relist.get_or_insert_default();
                    relist.insert((ns.to_owned(), name.to_owned()), t);
                }
            }
            watcher::Event::InitDone => {
                let terms = inner.relist.take().unwrap_or_default();
                inner.sums = Inner::sum_up(&terms);
                inner.terms = terms;
            }
        }
    }

    /// The digest of namespace `ns`'s objects (0: none).
    pub fn namespace(&self, ns: &str) -> u64 {
        self.inner.lock().sums.get(ns).map_or(0, |(sum, _)| *sum)
    }
}

/// The digest of the objects of `ns` among `objects`, computed afresh: what a [`Digest`] fed
/// every event that led to them holds.
pub fn fresh<'a, K: Digested + 'a>(objects: impl IntoIterator<Item = &'a K>, ns: &str) -> u64 {
    objects
        .into_iter()
        .filter(|o| o.identity().is_some_and(|(n, _)| n == ns))
        .fold(0, |sum, o| sum.wrapping_add(term(o)))
}

/// The digests of the watches the fingerprint reads: one per watch, as the caches are.
#[derive(Clone, Debug, Default)]
pub struct World {
    /// The ConnectionPolicy watch's.
    pub policies: std::sync::Arc<Digest>,
    /// The pod watch's.
    pub pods: std::sync::Arc<Digest>,
    /// The EndpointSlice watches', in the order of [`Stores::slices`](super::Stores::slices).
    pub slices: Vec<std::sync::Arc<Digest>>,
}

impl World {
    /// The digest of the EndpointSlices a pass of `ns` may read: `ns`'s own and those of
    /// `allowed` (the backend namespaces), from every slice watch.
    pub fn slices(&self, ns: &str, allowed: &[String]) -> u64 {
        let mut namespaces: Vec<&str> = std::iter::once(ns)
            .chain(allowed.iter().map(String::as_str))
            .collect();
        namespaces.sort_unstable();
        namespaces.dedup();
        self.slices
            .iter()
            .flat_map(|d| namespaces.iter().map(|n| d.namespace(n)))
            .fold(0, u64::wrapping_add)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kube::runtime::reflector;
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn pod(ns: &str, name: &str, version: u32) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": name, "resourceVersion": version.to_string()},
        }))
        .unwrap()
    }

    fn policy(name: &str, generation: i64, status: &str) -> DeserializeGuard<ConnectionPolicy> {
        DeserializeGuard(Ok(serde_json::from_value(json!({
            "apiVersion": "poolpilot.io/v1alpha1", "kind": "ConnectionPolicy",
            "metadata": {"namespace": "ns", "name": name, "uid": format!("{name}-uid"), "generation": generation},
            "spec": {"gatewaySelector": {}, "backends": []},
            "status": {"conditions": [{"type": "Accepted", "status": status, "reason": "r", "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        }))
        .unwrap()))
    }

    /// One step of a watch: an object of a namespace (`0`/`1`) and name (`0..4`) applied at a
    /// version, deleted, or a re-list of some objects.
    #[derive(Clone, Debug)]
    enum Step {
        Apply(u8, u8, u32),
        Delete(u8, u8),
        Relist(Vec<(u8, u8, u32)>),
    }

    fn step() -> impl Strategy<Value = Step> {
        let object = (0u8..2, 0u8..4);
        prop_oneof![
            4 => (object.clone(), 0u32..3).prop_map(|((n, o), v)| Step::Apply(n, o, v)),
            2 => object.prop_map(|(n, o)| Step::Delete(n, o)),
            1 => proptest::collection::vec((0u8..2, 0u8..4, 0u32..3), 0..6).prop_map(Step::Relist),
        ]
    }

    fn events(step: &Step) -> Vec<watcher::Event<Pod>> {
        let make = |n: u8, o: u8, v: u32| pod(&format!("ns-{n}"), &format!("gw-{o}"), v);
        match step {
            Step::Apply(n, o, v) => vec![watcher::Event::Apply(make(*n, *o, *v))],
            Step::Delete(n, o) => vec![watcher::Event::Delete(make(*n, *o, 0))],
            Step::Relist(listed) => std::iter::once(watcher::Event::Init)
                .chain(
                    listed
                        .iter()
                        .map(|(n, o, v)| watcher::Event::InitApply(make(*n, *o, *v))),
                )
                .chain(std::iter::once(watcher::Event::InitDone))
                .collect(),
        }
    }

    proptest! {
        /// After any sequence of a watch's events, the digest kept by them equals the one
        /// computed afresh from the cache the same events built, in every namespace.
        #[test]
        fn the_kept_digest_equals_a_fresh_one_after_any_events(steps in proptest::collection::vec(step(), 0..40)) {
            let (cache, mut writer) = reflector::store::<Pod>();
            let digest = Digest::default();
            for step in &steps {
                for event in events(step) {
                    writer.apply_watcher_event(&event);
                    digest.apply(&event);
                    // Between a re-list's start and its end the cache still serves the old set.
                    let objects = cache.state();
                    for ns in ["ns-0", "ns-1"] {
                        prop_assert_eq!(
                            digest.namespace(ns),
                            fresh(objects.iter().map(AsRef::as_ref), ns),
                            "after {:?}", event
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn what_the_fingerprint_reads_moves_the_digest_and_nothing_else_does() {
        let digest = Digest::default();
        digest.apply(&watcher::Event::Apply(policy("a", 1, "True")));
        let before = digest.namespace("ns");
        assert_ne!(before, 0);
        digest.apply(&watcher::Event::Apply(policy("a", 1, "False")));
        assert_eq!(digest.namespace("ns"), before, "a status write");
        digest.apply(&watcher::Event::Apply(policy("a", 2, "False")));
        let edited = digest.namespace("ns");
        assert_ne!(edited, before, "a new generation");
        assert_eq!(
            digest.namespace("other"),
            0,
            "another namespace has no objects"
        );
        digest.apply(&watcher::Event::Delete(policy("a", 2, "False")));
        assert_eq!(digest.namespace("ns"), 0, "the last one gone");
    }

    #[test]
    fn the_slices_of_a_pass_are_its_namespace_and_the_backend_namespaces_counted_once() {
        let slice = |ns: &str, name: &str| -> EndpointSlice {
            serde_json::from_value(json!({
                "metadata": {"namespace": ns, "name": name, "resourceVersion": "1"},
                "addressType": "IPv4", "endpoints": [],
            }))
            .unwrap()
        };
        let (own, extra) = (Digest::default(), Digest::default());
        own.apply(&watcher::Event::Apply(slice("ns", "a")));
        own.apply(&watcher::Event::Apply(slice("elsewhere", "b")));
        extra.apply(&watcher::Event::Apply(slice("llm", "c")));
        let world = World {
            slices: vec![own.into(), extra.into()],
            ..World::default()
        };
        let sum = |ns: &[&str]| {
            let by_ns: BTreeMap<&str, u64> = ns
                .iter()
                .map(|n| {
                    (
                        *n,
                        world
                            .slices
                            .iter()
                            .map(|d| d.namespace(n))
                            .fold(0, u64::wrapping_add),
                    )
                })
                .collect();
            by_ns.values().fold(0u64, |a, b| a.wrapping_add(*b))
        };
        assert_eq!(world.slices("ns", &["llm".into()]), sum(&["ns", "llm"]));
        assert_eq!(
            world.slices("ns", &["ns".into(), "llm".into()]),
            sum(&["ns", "llm"]),
            "its own namespace among the backend namespaces counts once"
        );
        assert_ne!(world.slices("ns", &[]), world.slices("ns", &["llm".into()]));
    }
}
