//! How a container of a pod becomes a process, as a container runtime would build it: the binary
//! that stands for its image, `command`/`args` with `$(VAR)` expanded, the environment (service
//! variables, the pod's identity, `envFrom`, `env` with field, ConfigMap and Secret references),
//! bind mounts of its volumes, the working directory and the open-files limit. No IO beyond the
//! image resolver's look at the bin folders.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{ConfigMap, Container, EnvVar, Pod, Secret};
use kube::ResourceExt as _;
use kube::runtime::reflector::ObjectRef;

use crate::process::{self, BindMount, ImageResolver, ProcessSpec};
use crate::volumes::{PodVolumes, VolumeSources, pod_field};

/// Annotation that sets the open-files limit (`RLIMIT_NOFILE`) of a pod's processes.
pub const NOFILE_ANNOTATION: &str = "poolpilot.io/nofile-limit";

/// Where a container's ConfigMap and Secret references are looked up.
pub(super) trait Objects {
    /// ConfigMap `name` of namespace `ns`, if it exists.
    fn configmap(&self, ns: &str, name: &str) -> Option<ConfigMap>;
    /// Secret `name` of namespace `ns`, if it exists.
    fn secret(&self, ns: &str, name: &str) -> Option<Secret>;
}

/// The kubelet's caches of every ConfigMap and Secret.
impl Objects for VolumeSources {
    fn configmap(&self, ns: &str, name: &str) -> Option<ConfigMap> {
        self.configmaps
            .get(&ObjectRef::new(name).within(ns))
            .map(|c| (*c).clone())
    }

    fn secret(&self, ns: &str, name: &str) -> Option<Secret> {
        self.secrets
            .get(&ObjectRef::new(name).within(ns))
            .map(|s| (*s).clone())
    }
}

/// Everything a pod's process specs are built from besides the container itself.
pub(super) struct SpecInputs<'a> {
    pub pod: &'a Pod,
    /// The pod's address.
    pub ip: Ipv4Addr,
    pub node_name: &'a str,
    pub host_ip: &'a str,
    /// How pods reach the apiserver (`KUBERNETES_SERVICE_HOST`/`_PORT`).
    pub apiserver: &'a (String, u16),
    pub images: &'a ImageResolver,
    pub volumes: &'a PodVolumes,
    /// The pod's folder: the working directory when the container names none that exists.
    pub dir: &'a Path,
    pub objects: &'a dyn Objects,
}

impl SpecInputs<'_> {
    /// The process for container `c`: binary, argv, environment, mounts, limits.
    pub fn process_spec(&self, c: &Container) -> Result<ProcessSpec, process::StartError> {
        let image = c.image.clone().unwrap_or_default();
        let env = self.environment(c);
        let expand = |s: &String| process::expand(s, &env);
        let command: Vec<String> = c
            .command
            .clone()
            .unwrap_or_default()
            .iter()
            .map(expand)
            .collect();
        let args: Vec<String> = c
            .args
            .clone()
            .unwrap_or_default()
            .iter()
            .map(expand)
            .collect();
        let (program, args) = match command.split_first() {
            Some((program, rest)) => (
                self.images.resolve_command(&image, program)?,
                rest.iter().cloned().chain(args).collect(),
            ),
            None => (self.images.resolve(&image)?, args),
        };
        let mut mounts = Vec::new();
        for m in c.volume_mounts.clone().unwrap_or_default() {
            let mut source = self
                .volumes
                .path_of(self.pod, &m.name)
                .ok_or_else(|| process::StartError::MissingVolume(m.name.clone()))?;
            if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
                source = source.join(sub);
            }
            mounts.push(BindMount {
                source,
                target: PathBuf::from(&m.mount_path),
                read_only: m.read_only.unwrap_or(false),
            });
        }
        let nofile_limit = self
            .pod
            .annotations()
            .get(NOFILE_ANNOTATION)
            .and_then(|v| v.parse().ok());
        Ok(ProcessSpec {
            program,
            args,
            env,
            working_dir: c
                .working_dir
                .clone()
                .map(PathBuf::from)
                .filter(|p| p.is_dir())
                .unwrap_or_else(|| self.dir.to_owned()),
            mounts,
            nofile_limit,
        })
    }

    /// The container's environment as a container runtime builds it: a base, the Kubernetes
    /// service variables, the pod's identity, then `envFrom` and `env` in order (later wins,
    /// `$(VAR)` expanded against what came before).
    pub fn environment(&self, c: &Container) -> BTreeMap<String, String> {
        let (api_host, api_port) = self.apiserver;
        let mut env: BTreeMap<String, String> = [
            ("PATH", process::CONTAINER_PATH.to_owned()),
            ("HOME", "/root".to_owned()),
            ("HOSTNAME", self.pod.name_any()),
            ("KUBERNETES_SERVICE_HOST", api_host.clone()),
            ("KUBERNETES_SERVICE_PORT", api_port.to_string()),
            ("KUBERNETES_SERVICE_PORT_HTTPS", api_port.to_string()),
            ("POD_NAME", self.pod.name_any()),
            ("POD_NAMESPACE", self.pod.namespace().unwrap_or_default()),
            ("POD_IP", self.ip.to_string()),
            ("NODE_NAME", self.node_name.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let ns = self.pod.namespace().unwrap_or_default();
        for from in c.env_from.clone().unwrap_or_default() {
            let prefix = from.prefix.clone().unwrap_or_default();
            if let Some(cm) = from
                .config_map_ref
                .and_then(|r| self.objects.configmap(&ns, &r.name))
            {
                for (k, v) in cm.data.unwrap_or_default() {
                    env.insert(format!("{prefix}{k}"), v);
                }
            }
            if let Some(secret) = from
                .secret_ref
                .and_then(|r| self.objects.secret(&ns, &r.name))
            {
                for (k, v) in secret.data.unwrap_or_default() {
                    env.insert(
                        format!("{prefix}{k}"),
                        String::from_utf8_lossy(&v.0).into_owned(),
                    );
                }
            }
        }
        for var in c.env.clone().unwrap_or_default() {
            let value = self.env_value(&var, &env, &ns);
            env.insert(var.name, value);
        }
        env
    }

    fn env_value(&self, var: &EnvVar, env: &BTreeMap<String, String>, ns: &str) -> String {
        if let Some(value) = &var.value {
            return process::expand(value, env);
        }
        let Some(from) = &var.value_from else {
            return String::new();
        };
        if let Some(field) = &from.field_ref {
            let mut pod = self.pod.clone();
            let status = pod.status.get_or_insert_default();
            status.pod_ip = Some(self.ip.to_string());
            status.host_ip = Some(self.host_ip.to_owned());
            return pod_field(&pod, &field.field_path).unwrap_or_default();
        }
        if let Some(key) = &from.config_map_key_ref {
            return self
                .objects
                .configmap(ns, &key.name)
                .and_then(|cm| cm.data.unwrap_or_default().remove(&key.key))
                .unwrap_or_default();
        }
        if let Some(key) = &from.secret_key_ref {
            return self
                .objects
                .secret(ns, &key.name)
                .and_then(|s| s.data.unwrap_or_default().remove(&key.key))
                .map(|v| String::from_utf8_lossy(&v.0).into_owned())
                .unwrap_or_default();
        }
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::ByteString;
    use serde_json::json;

    use super::*;
    use crate::process::StartError;

    /// ConfigMaps and Secrets by (namespace, name).
    #[derive(Default)]
    struct Fixed {
        configmaps: BTreeMap<(String, String), BTreeMap<String, String>>,
        secrets: BTreeMap<(String, String), BTreeMap<String, String>>,
    }

    impl Objects for Fixed {
        fn configmap(&self, ns: &str, name: &str) -> Option<ConfigMap> {
            let data = self.configmaps.get(&(ns.into(), name.into()))?;
            Some(ConfigMap {
                data: Some(data.clone()),
                ..Default::default()
            })
        }

        fn secret(&self, ns: &str, name: &str) -> Option<Secret> {
            let data = self.secrets.get(&(ns.into(), name.into()))?;
            Some(Secret {
                data: Some(
                    data.iter()
                        .map(|(k, v)| (k.clone(), ByteString(v.as_bytes().to_vec())))
                        .collect(),
                ),
                ..Default::default()
            })
        }
    }

    fn objects() -> Fixed {
        let mut objects = Fixed::default();
        objects.configmaps.insert(
            ("models".into(), "settings".into()),
            BTreeMap::from([
                ("MODE".into(), "fast".into()),
                ("PORT".into(), "8000".into()),
            ]),
        );
        objects.secrets.insert(
            ("models".into(), "token".into()),
            BTreeMap::from([("key".into(), "s3cret".into())]),
        );
        objects
    }

    fn pod(containers: serde_json::Value, annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "sim-0",
                "namespace": "models",
                "uid": "u-1",
                "labels": {"app": "sim"},
                "annotations": annotations,
            },
            "spec": {
                "containers": containers,
                "volumes": [
                    {"name": "config", "configMap": {"name": "settings"}},
                    {"name": "host", "hostPath": {"path": "/srv/shared"}},
                ],
            },
        }))
        .unwrap()
    }

    fn container(value: serde_json::Value) -> Container {
        serde_json::from_value(value).unwrap()
    }

    /// Builds the spec of `c` in `pod` on a node whose only image is `poolpilot/modelsim`,
    /// standing for /opt/bin/modelsim.
    fn build(pod: &Pod, c: &Container) -> Result<ProcessSpec, StartError> {
        let images = ImageResolver {
            images: BTreeMap::from([("poolpilot/modelsim".into(), "/opt/bin/modelsim".into())]),
            bin_dirs: Vec::new(),
        };
        let volumes = PodVolumes::new(PathBuf::from("/state/pods/models/sim-0/volumes"));
        let objects = objects();
        let apiserver = ("127.0.0.1".to_owned(), 6443);
        SpecInputs {
            pod,
            ip: Ipv4Addr::new(10, 244, 0, 7),
            node_name: "poolpilot-local",
            host_ip: "127.0.0.1",
            apiserver: &apiserver,
            images: &images,
            volumes: &volumes,
            dir: Path::new("/state/pods/models/sim-0"),
            objects: &objects,
        }
        .process_spec(c)
    }

    #[test]
    fn the_environment_holds_the_service_variables_and_the_pods_identity() {
        let c = container(json!({"name": "sim", "image": "poolpilot/modelsim:dev"}));
        let spec = build(&pod(json!([c]), json!({})), &c).unwrap();
        for (key, value) in [
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", "6443"),
            ("POD_NAME", "sim-0"),
            ("POD_NAMESPACE", "models"),
            ("POD_IP", "10.244.0.7"),
            ("NODE_NAME", "poolpilot-local"),
            ("HOSTNAME", "sim-0"),
            ("PATH", process::CONTAINER_PATH),
        ] {
            assert_eq!(spec.env.get(key).map(String::as_str), Some(value), "{key}");
        }
    }

    #[test]
    fn env_from_comes_before_env_and_later_values_win_with_references_expanded() {
        let c = container(json!({
            "name": "sim",
            "image": "poolpilot/modelsim",
            "envFrom": [
                {"configMapRef": {"name": "settings"}, "prefix": "CM_"},
                {"secretRef": {"name": "token"}},
                {"configMapRef": {"name": "absent"}},
            ],
            "env": [
                {"name": "CM_MODE", "value": "slow"},
                {"name": "URL", "value": "http://$(POD_IP):$(CM_PORT)/$(UNKNOWN)"},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "MODE"}}},
                {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "token", "key": "key"}}},
                {"name": "NONE", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "key"}}},
            ],
        }));
        let env = build(&pod(json!([c]), json!({})), &c).unwrap().env;
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("CM_MODE"), Some("slow"), "env overrides envFrom");
        assert_eq!(get("CM_PORT"), Some("8000"));
        assert_eq!(get("key"), Some("s3cret"), "a Secret's keys without prefix");
        assert_eq!(get("URL"), Some("http://10.244.0.7:8000/$(UNKNOWN)"));
        assert_eq!(get("IP"), Some("10.244.0.7"));
        assert_eq!(get("HOST"), Some("127.0.0.1"));
        assert_eq!(get("APP"), Some("sim"));
        assert_eq!(get("MODE"), Some("fast"));
        assert_eq!(get("KEY"), Some("s3cret"));
        assert_eq!(get("NONE"), Some(""), "a missing reference is empty");
    }

    #[test]
    fn the_image_binary_runs_the_command_with_expanded_args_appended() {
        let c = container(json!({
            "name": "sim",
            "image": "poolpilot/modelsim:v1",
            "command": ["modelsim", "--instance=$(POD_NAME)"],
            "args": ["--port", "$(PORT)"],
            "env": [{"name": "PORT", "value": "8000"}],
        }));
        let spec = build(&pod(json!([c]), json!({})), &c).unwrap();
        assert_eq!(spec.program, PathBuf::from("/opt/bin/modelsim"));
        assert_eq!(spec.args, ["--instance=sim-0", "--port", "8000"]);

        let no_command =
            container(json!({"name": "sim", "image": "poolpilot/modelsim", "args": ["-v"]}));
        let spec = build(&pod(json!([no_command]), json!({})), &no_command).unwrap();
        assert_eq!(spec.program, PathBuf::from("/opt/bin/modelsim"));
        assert_eq!(spec.args, ["-v"]);
    }

    #[test]
    fn an_image_no_binary_stands_for_is_an_image_pull_error() {
        let c = container(json!({"name": "x", "image": "docker.io/library/nginx:1.27"}));
        let err = build(&pod(json!([c]), json!({})), &c).unwrap_err();
        assert_eq!(err.reason(), "ErrImagePull", "{err}");
    }

    #[test]
    fn volume_mounts_bind_the_pods_volume_folders_host_paths_and_sub_paths() {
        let c = container(json!({
            "name": "sim",
            "image": "poolpilot/modelsim",
            "volumeMounts": [
                {"name": "config", "mountPath": "/etc/sim", "readOnly": true},
                {"name": "config", "mountPath": "/etc/sim.yaml", "subPath": "sim.yaml"},
                {"name": "host", "mountPath": "/shared"},
            ],
        }));
        let mounts = build(&pod(json!([c]), json!({})), &c).unwrap().mounts;
        let seen: Vec<(String, String, bool)> = mounts
            .iter()
            .map(|m| {
                (
                    m.source.display().to_string(),
                    m.target.display().to_string(),
                    m.read_only,
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (
                    "/state/pods/models/sim-0/volumes/config".into(),
                    "/etc/sim".into(),
                    true
                ),
                (
                    "/state/pods/models/sim-0/volumes/config/sim.yaml".into(),
                    "/etc/sim.yaml".into(),
                    false
                ),
                ("/srv/shared".into(), "/shared".into(), false),
            ]
        );
    }

    #[test]
    fn a_mount_of_a_volume_the_pod_does_not_declare_is_refused() {
        let c = container(json!({
            "name": "sim",
            "image": "poolpilot/modelsim",
            "volumeMounts": [{"name": "nowhere", "mountPath": "/data"}],
        }));
        let err = build(&pod(json!([c]), json!({})), &c).unwrap_err();
        assert!(
            matches!(&err, StartError::MissingVolume(name) if name == "nowhere"),
            "{err}"
        );
    }

    #[test]
    fn the_nofile_annotation_sets_the_limit_and_a_missing_working_dir_falls_back_to_the_pod_folder()
    {
        let c = container(json!({
            "name": "sim",
            "image": "poolpilot/modelsim",
            "workingDir": "/no/such/folder",
        }));
        let limited = pod(json!([c]), json!({"poolpilot.io/nofile-limit": "256"}));
        let spec = build(&limited, &c).unwrap();
        assert_eq!(spec.nofile_limit, Some(256));
        assert_eq!(spec.working_dir, PathBuf::from("/state/pods/models/sim-0"));

        let unparsable = pod(json!([c]), json!({"poolpilot.io/nofile-limit": "lots"}));
        assert_eq!(build(&unparsable, &c).unwrap().nofile_limit, None);
        let here =
            container(json!({"name": "sim", "image": "poolpilot/modelsim", "workingDir": "/"}));
        assert_eq!(
            build(&pod(json!([here]), json!({})), &here)
                .unwrap()
                .working_dir,
            PathBuf::from("/")
        );
    }
}
