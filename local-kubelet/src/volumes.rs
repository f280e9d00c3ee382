//! Pod volumes rendered to folders on the host: ConfigMap, Secret, downward API, projected
//! (ServiceAccount token included), emptyDir and hostPath. Updates are written the way the
//! kubelet writes them (a fresh `..<stamp>` folder swapped in through the `..data` link), so a
//! running process sees every change at once and never a half-written file.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, Pod, Secret, ServiceAccount, Volume,
};
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::time::Instant;

/// Why a pod's volumes could not be rendered; the pod waits with this as its reason.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// A ConfigMap or Secret the pod needs does not exist (yet).
    #[error("{kind} {name:?} not found")]
    SourceNotFound { kind: &'static str, name: String },
    /// A key the pod names is not in its ConfigMap or Secret.
    #[error("key {key:?} not found in {kind} {name:?}")]
    KeyNotFound {
        kind: &'static str,
        name: String,
        key: String,
    },
    /// A field the downward API names is not one we can resolve.
    #[error("unsupported downward API field {0:?}")]
    UnsupportedField(String),
    /// A volume type the local kubelet does not run.
    #[error(
        "volume {0:?}: unsupported volume type (local kubelet runs configMap, secret, downwardAPI, projected, emptyDir, hostPath)"
    )]
    Unsupported(String),
    /// The TokenRequest for a ServiceAccount token failed.
    #[error("token for ServiceAccount {0:?}: {1}")]
    Token(String, #[source] kube::Error),
    /// Writing files failed.
    #[error("writing volume files: {0}")]
    Io(#[from] std::io::Error),
}

/// Where volume contents come from: caches of every ConfigMap and Secret, and a client for
/// ServiceAccount tokens.
#[derive(Clone)]
pub struct VolumeSources {
    /// All ConfigMaps.
    pub configmaps: Store<ConfigMap>,
    /// All Secrets.
    pub secrets: Store<Secret>,
    /// For TokenRequests.
    pub client: kube::Client,
}

/// A pod's rendered volumes, kept in sync by calling [`PodVolumes::sync`] again.
#[derive(Debug)]
pub struct PodVolumes {
    root: PathBuf,
    tokens: HashMap<String, (String, Instant)>,
}

/// Tokens are requested for this long and renewed at 80% of it, as the kubelet does.
const TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

type Files = BTreeMap<String, Vec<u8>>;

impl PodVolumes {
    /// Volumes of one pod, rendered under `root/<volume name>`.
    pub fn new(root: PathBuf) -> Self {
        Self {
            root,
            tokens: HashMap::new(),
        }
    }

    /// The host folder (or hostPath) that stands for volume `name`.
    pub fn path_of(&self, pod: &Pod, name: &str) -> Option<PathBuf> {
        let volume = pod
            .spec
            .as_ref()?
            .volumes
            .as_ref()?
            .iter()
            .find(|v| v.name == name)?;
        Some(match &volume.host_path {
            Some(hp) => PathBuf::from(&hp.path),
            None => self.root.join(name),
        })
    }

    /// Renders every volume of `pod`; unchanged contents are left alone.
    pub async fn sync(&mut self, pod: &Pod, sources: &VolumeSources) -> Result<(), VolumeError> {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        for volume in pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.clone())
            .unwrap_or_default()
        {
            let dir = self.root.join(&volume.name);
            if volume.empty_dir.is_some() {
                std::fs::create_dir_all(&dir)?;
                continue;
            }
            if volume.host_path.is_some() {
                continue;
            }
            let files = self.files_of(&volume, pod, &namespace, sources).await?;
            write_atomically(&dir, &files)?;
        }
        Ok(())
    }

    async fn files_of(
        &mut self,
        volume: &Volume,
        pod: &Pod,
        ns: &str,
        sources: &VolumeSources,
    ) -> Result<Files, VolumeError> {
        // A ConfigMap or Secret reference, as a volume or a projected source holds it.
        let keyed = |kind, name: &str, items: &Option<Vec<KeyToPath>>, optional: Option<bool>| {
            keyed_files(
                sources,
                ns,
                kind,
                name,
                items.as_deref(),
                optional.unwrap_or(false),
            )
        };
        if let Some(cm) = &volume.config_map {
            return keyed(Keyed::ConfigMap, &cm.name, &cm.items, cm.optional);
        }
        if let Some(s) = &volume.secret {
            return keyed(
                Keyed::Secret,
                s.secret_name.as_deref().unwrap_or_default(),
                &s.items,
                s.optional,
            );
        }
        if let Some(downward) = &volume.downward_api {
            return downward_files(pod, downward.items.as_deref().unwrap_or_default());
        }
        if let Some(projected) = &volume.projected {
            let mut files = Files::new();
            for source in projected.sources.clone().unwrap_or_default() {
                if let Some(cm) = &source.config_map {
                    files.extend(keyed(Keyed::ConfigMap, &cm.name, &cm.items, cm.optional)?);
                }
                if let Some(s) = &source.secret {
                    files.extend(keyed(Keyed::Secret, &s.name, &s.items, s.optional)?);
                }
                if let Some(downward) = &source.downward_api {
                    files.extend(downward_files(
                        pod,
                        downward.items.as_deref().unwrap_or_default(),
                    )?);
                }
                if let Some(sat) = &source.service_account_token {
                    let key = format!("{}/{}", volume.name, sat.path);
                    let token = self
                        .token(pod, ns, sat.audience.as_deref(), &key, sources)
                        .await?;
                    files.insert(sat.path.clone(), token.into_bytes());
                }
            }
            return Ok(files);
        }
        Err(VolumeError::Unsupported(volume.name.clone()))
    }

    async fn token(
        &mut self,
        pod: &Pod,
        ns: &str,
        audience: Option<&str>,
        key: &str,
        sources: &VolumeSources,
    ) -> Result<String, VolumeError> {
        if let Some((token, renew_at)) = self.tokens.get(key)
            && Instant::now() < *renew_at
        {
            return Ok(token.clone());
        }
        let sa_name = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        let api: Api<ServiceAccount> = Api::namespaced(sources.client.clone(), ns);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: audience.map(|a| vec![a.to_owned()]),
                expiration_seconds: Some(TOKEN_LIFETIME.as_secs() as i64),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod.metadata.name.clone(),
                    uid: pod.metadata.uid.clone(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let response = api
            .create_token_request(&sa_name, &PostParams::default(), &request)
            .await
            .map_err(|e| VolumeError::Token(sa_name.clone(), e))?;
        let token = response.status.and_then(|s| s.token).unwrap_or_default();
        self.tokens.insert(
            key.to_owned(),
            (token.clone(), Instant::now() + TOKEN_LIFETIME.mul_f32(0.8)),
        );
        Ok(token)
    }
}

/// Where a volume's keyed files come from.
#[derive(Clone, Copy, Debug)]
enum Keyed {
    ConfigMap,
    Secret,
}

/// The files of ConfigMap or Secret `name` in `ns` (`items` picks and renames keys; `optional`:
/// a missing object gives no files).
fn keyed_files(
    sources: &VolumeSources,
    ns: &str,
    kind: Keyed,
    name: &str,
    items: Option<&[KeyToPath]>,
    optional: bool,
) -> Result<Files, VolumeError> {
    let data = match kind {
        Keyed::ConfigMap => sources
            .configmaps
            .get(&ObjectRef::new(name).within(ns))
            .map(|cm| key_files(cm.data.clone(), cm.binary_data.clone())),
        Keyed::Secret => sources
            .secrets
            .get(&ObjectRef::new(name).within(ns))
            .map(|secret| {
                // `stringData` is written over `data`, as the apiserver merges them.
                let mut files = key_files(None, secret.data.clone());
                files.extend(key_files(secret.string_data.clone(), None));
                files
            }),
    };
    let kind = match kind {
        Keyed::ConfigMap => "ConfigMap",
        Keyed::Secret => "Secret",
    };
    source_files(kind, name, data, items, optional)
}

/// The keys of a ConfigMap or Secret as files: the text values, then the binary ones (which win
/// on a key in both).
fn key_files(
    text: Option<BTreeMap<String, String>>,
    binary: Option<BTreeMap<String, k8s_openapi::ByteString>>,
) -> Files {
    let text = text
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.into_bytes()));
    let binary = binary
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0));
    text.chain(binary).collect()
}

/// The files a ConfigMap or Secret (`kind`) projects: all its keys, or the `items` chosen;
/// `data` is `None` when the object does not exist.
fn source_files(
    kind: &'static str,
    name: &str,
    data: Option<Files>,
    items: Option<&[KeyToPath]>,
    optional: bool,
) -> Result<Files, VolumeError> {
    match data {
        Some(all) => select_items(kind, name, all, items, optional),
        None if optional => Ok(Files::new()),
        None => Err(VolumeError::SourceNotFound {
            kind,
            name: name.into(),
        }),
    }
}

fn select_items(
    kind: &'static str,
    name: &str,
    mut all: Files,
    items: Option<&[KeyToPath]>,
    optional: bool,
) -> Result<Files, VolumeError> {
    let Some(items) = items else { return Ok(all) };
    let mut files = Files::new();
    for item in items {
        match all.remove(&item.key) {
            Some(data) => {
                files.insert(item.path.clone(), data);
            }
            None if optional => {}
            None => {
                return Err(VolumeError::KeyNotFound {
                    kind,
                    name: name.into(),
                    key: item.key.clone(),
                });
            }
        }
    }
    Ok(files)
}

fn downward_files(pod: &Pod, items: &[DownwardAPIVolumeFile]) -> Result<Files, VolumeError> {
    let mut files = Files::new();
    for item in items {
        if let Some(field) = &item.field_ref {
            files.insert(
                item.path.clone(),
                pod_field(pod, &field.field_path)?.into_bytes(),
            );
        }
    }
    Ok(files)
}

/// A pod field the downward API can name (`metadata.name`, `metadata.labels['app']`, ...).
pub fn pod_field(pod: &Pod, path: &str) -> Result<String, VolumeError> {
    let meta = &pod.metadata;
    let map_text = |m: &Option<BTreeMap<String, String>>| {
        m.clone()
            .unwrap_or_default()
            .iter()
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let keyed = |prefix: &str, m: &Option<BTreeMap<String, String>>| {
        path.strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix("']"))
            .map(|key| {
                m.as_ref()
                    .and_then(|m| m.get(key).cloned())
                    .unwrap_or_default()
            })
    };
    if let Some(v) = keyed("metadata.labels['", &meta.labels) {
        return Ok(v);
    }
    if let Some(v) = keyed("metadata.annotations['", &meta.annotations) {
        return Ok(v);
    }
    let status = pod.status.as_ref();
    let spec = pod.spec.as_ref();
    Ok(match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => map_text(&meta.labels),
        "metadata.annotations" => map_text(&meta.annotations),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.podIP" => status.and_then(|s| s.pod_ip.clone()).unwrap_or_default(),
        "status.hostIP" => status.and_then(|s| s.host_ip.clone()).unwrap_or_default(),
        other => return Err(VolumeError::UnsupportedField(other.to_owned())),
    })
}

/// Writes `files` into `dir` the way the kubelet's AtomicWriter does: into a new `..<stamp>`
/// folder, then one rename of the `..data` link switches every file at once; top-level names
/// are links through `..data`. Does nothing when the content is unchanged.
pub fn write_atomically(dir: &Path, files: &Files) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let data = dir.join("..data");
    if data.exists() && read_tree(&data)? == *files {
        return Ok(());
    }
    let stamp = format!("..{}", rand::random::<u64>());
    let fresh = dir.join(&stamp);
    for (path, content) in files {
        let target = fresh.join(path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&target, content)?;
    }
    std::fs::create_dir_all(&fresh)?;
    let tmp_link = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp_link);
    std::os::unix::fs::symlink(&stamp, &tmp_link)?;
    let old = std::fs::read_link(&data).ok();
    std::fs::rename(&tmp_link, &data)?;
    // Top-level entries are links through ..data; add new ones, drop those that are gone.
    let top: std::collections::BTreeSet<String> = files
        .keys()
        .map(|p| p.split('/').next().unwrap_or(p).to_owned())
        .collect();
    for name in &top {
        let link = dir.join(name);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(Path::new("..data").join(name), &link)?;
        }
    }
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("..") && !top.contains(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if let Some(old) = old {
        let _ = std::fs::remove_dir_all(dir.join(old));
    }
    Ok(())
}

fn read_tree(dir: &Path) -> std::io::Result<Files> {
    let mut files = Files::new();
    let mut stack = vec![(dir.to_owned(), String::new())];
    while let Some((path, prefix)) = stack.pop() {
        for entry in std::fs::read_dir(&path)?.flatten() {
            let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
            if entry.file_type()?.is_dir() {
                stack.push((entry.path(), format!("{name}/")));
            } else {
                files.insert(name, std::fs::read(entry.path())?);
            }
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(pairs: &[(&str, &str)]) -> Files {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn atomic_writes_swap_the_whole_content() {
        let dir = tempfile::tempdir().unwrap();
        let vol = dir.path().join("config");
        write_atomically(&vol, &files(&[("a.yaml", "one"), ("nested/b", "two")])).unwrap();
        assert_eq!(std::fs::read_to_string(vol.join("a.yaml")).unwrap(), "one");
        assert_eq!(
            std::fs::read_to_string(vol.join("nested/b")).unwrap(),
            "two"
        );
        let first = std::fs::read_link(vol.join("..data")).unwrap();

        // Unchanged content: nothing is rewritten.
        write_atomically(&vol, &files(&[("a.yaml", "one"), ("nested/b", "two")])).unwrap();
        assert_eq!(std::fs::read_link(vol.join("..data")).unwrap(), first);

        // Changed content: a new generation, the old one removed, dropped keys gone.
        write_atomically(&vol, &files(&[("a.yaml", "three")])).unwrap();
        assert_eq!(
            std::fs::read_to_string(vol.join("a.yaml")).unwrap(),
            "three"
        );
        assert!(!vol.join("nested").exists());
        assert!(!vol.join(first).exists());
    }

    #[test]
    fn downward_api_fields() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "labels": {"app": "gw"}},
            "status": {"podIP": "127.0.1.9"}
        }))
        .unwrap();
        assert_eq!(pod_field(&pod, "metadata.name").unwrap(), "p");
        assert_eq!(pod_field(&pod, "metadata.labels['app']").unwrap(), "gw");
        assert_eq!(pod_field(&pod, "status.podIP").unwrap(), "127.0.1.9");
        assert!(pod_field(&pod, "spec.containers").is_err());
    }
}
