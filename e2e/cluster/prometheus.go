// Prometheus: runs a real Prometheus (built from its Go module, see ../prometheus) that finds
// pods through Kubernetes service discovery against this cluster, as a read-only
// ServiceAccount, and scrapes the ones annotated prometheus.io/scrape=true.
package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// prometheusOptions says whether and how "up" runs Prometheus.
type prometheusOptions struct {
	path           string
	port           int
	scrapeInterval time.Duration
}

const prometheusIdentity = "poolpilot-e2e-prometheus"

// prometheusConfig is the scrape configuration: the usual prometheus.io/* pod annotations
// (prometheus.io/scheme: https for the gateways' admin port, whose certificate each test makes
// with its own CA, hence no verification), running pods only, with namespace and pod labels
// (what poolpilot's operator queries by).
const prometheusConfig = `global:
  scrape_interval: %[1]s
  scrape_timeout: %[2]s
  evaluation_interval: %[1]s
scrape_configs:
- job_name: kubernetes-pods
  kubernetes_sd_configs:
  - role: pod
    kubeconfig_file: %[3]s
  tls_config:
    insecure_skip_verify: true
  relabel_configs:
  - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape]
    action: keep
    regex: "true"
  - source_labels: [__meta_kubernetes_pod_phase]
    action: keep
    regex: Running
  - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scheme]
    action: replace
    target_label: __scheme__
    regex: (https?)
  - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_path]
    action: replace
    target_label: __metrics_path__
    regex: (.+)
  - source_labels: [__address__, __meta_kubernetes_pod_annotation_prometheus_io_port]
    action: replace
    regex: ([^:]+)(?::\d+)?;(\d+)
    replacement: $1:$2
    target_label: __address__
  - source_labels: [__meta_kubernetes_namespace]
    target_label: namespace
  - source_labels: [__meta_kubernetes_pod_name]
    target_label: pod
  - source_labels: [__meta_kubernetes_pod_label_app_kubernetes_io_name]
    target_label: app
`

// startPrometheus grants the read-only identity, writes its kubeconfig and the configuration,
// starts Prometheus and waits until it is ready. Returns the child and Prometheus' URL.
func startPrometheus(ctx context.Context, dir, adminKubeconfig, server, listen string, p *pki, opts prometheusOptions) (*child, string, error) {
	promDir := filepath.Join(dir, "prometheus")
	if err := os.MkdirAll(promDir, 0o755); err != nil {
		return nil, "", err
	}
	token, err := prometheusToken(ctx, adminKubeconfig)
	if err != nil {
		return nil, "", fmt.Errorf("prometheus identity: %w", err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["poolpilot-e2e"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: p.ca.certPEM}
	cfg.AuthInfos[prometheusIdentity] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["poolpilot-e2e"] = &clientcmdapi.Context{Cluster: "poolpilot-e2e", AuthInfo: prometheusIdentity}
	cfg.CurrentContext = "poolpilot-e2e"
	kubeconfig := filepath.Join(promDir, "kubeconfig")
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, "", err
	}
	if err := writeFileAtomic(kubeconfig, data, 0o600); err != nil {
		return nil, "", err
	}
	timeout := opts.scrapeInterval * 8 / 10
	config := fmt.Sprintf(prometheusConfig, promDuration(opts.scrapeInterval), promDuration(timeout), kubeconfig)
	configPath := filepath.Join(promDir, "prometheus.yml")
	if err := writeFileAtomic(configPath, []byte(config), 0o644); err != nil {
		return nil, "", err
	}
	port := opts.port
	if port == 0 {
		ports, err := freePorts(1)
		if err != nil {
			return nil, "", err
		}
		port = ports[0]
	}
	url := fmt.Sprintf("http://%s:%d", listen, port)
	c, err := startProgram(dir, "prometheus", opts.path, []string{
		"--config.file=" + configPath,
		"--storage.tsdb.path=" + filepath.Join(promDir, "data"),
		"--storage.tsdb.retention.time=6h",
		fmt.Sprintf("--web.listen-address=%s:%d", listen, port),
		"--web.enable-lifecycle",
		"--log.level=warn",
	})
	if err != nil {
		return nil, "", err
	}
	httpc := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := httpc.Get(url + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return c, url, nil
			}
		}
		select {
		case <-c.done:
			return c, "", withLogTail(fmt.Errorf("prometheus exited before it was ready: %v", c.err), c.log)
		case <-ctx.Done():
			return c, "", withLogTail(fmt.Errorf("prometheus not ready in time"), c.log)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// prometheusToken creates the ServiceAccount kube-system/poolpilot-e2e-prometheus with read-only
// discovery rights and returns a day-long token for it.
func prometheusToken(ctx context.Context, adminKubeconfig string) (string, error) {
	client, err := newClient(adminKubeconfig)
	if err != nil {
		return "", err
	}
	read := []string{"get", "list", "watch"}
	role := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: prometheusIdentity},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods", "nodes", "services", "endpoints"}, Verbs: read},
			{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: read},
			{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}},
		},
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: prometheusIdentity},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: prometheusIdentity},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: prometheusIdentity, Namespace: "kube-system"}},
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: prometheusIdentity, Namespace: "kube-system"}}
	if _, err := client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", err
	}
	if _, err := client.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", err
	}
	if _, err := client.CoreV1().ServiceAccounts("kube-system").Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", err
	}
	day := int64(24 * 3600)
	tr, err := client.CoreV1().ServiceAccounts("kube-system").CreateToken(ctx, prometheusIdentity,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &day}}, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	return tr.Status.Token, nil
}

// promDuration writes a duration the way Prometheus' configuration reads it (no fractions).
func promDuration(d time.Duration) string {
	if d%time.Second == 0 {
		return fmt.Sprintf("%ds", int(d/time.Second))
	}
	return strings.TrimSuffix(fmt.Sprintf("%dms", d.Milliseconds()), ".")
}
