// Up: installs the host routes that keep the cluster's traffic on this machine, starts etcd,
// kube-apiserver and kube-controller-manager (with --node: kube-scheduler and the node of
// node.go, the apiserver on the node link's address), waits until the cluster really serves, publishes the admin kubeconfig and a ready marker, and tears it all down on
// SIGTERM/SIGINT (or when a watched parent process goes away).
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/component-base/version"

	"github.com/poolpilot/poolpilot/e2e/cluster/hostnet"
)

// defaultControllers are the kube-controller-manager loops of a test cluster. node-lifecycle and
// pod-garbage-collector are added with the node ("up --node"): without a kubelet's heartbeats
// they would evict and delete every pod.
var defaultControllers = []string{
	"deployment-controller", "replicaset-controller", "statefulset-controller", "job-controller",
	"garbage-collector-controller", "namespace-controller",
	"serviceaccount-controller", "serviceaccount-token-controller", "root-ca-certificate-publisher-controller",
	"endpoints-controller", "endpointslice-controller", "endpointslice-mirroring-controller",
	"clusterrole-aggregation-controller", "disruption-controller",
}

// readyMarker is what "up" writes to DIR/ready once the cluster serves; tests and make targets
// read it to find the cluster.
type readyMarker struct {
	PID        int    `json:"pid"`
	Server     string `json:"server"`
	Kubeconfig string `json:"kubeconfig"`
	Version    string `json:"version"`
	Prometheus string `json:"prometheus,omitempty"`
	// Node is the name of the node ("up --node"); empty without one.
	Node string `json:"node,omitempty"`
}

// child is a control-plane component running as a child process of "up".
type child struct {
	name string
	log  string
	cmd  *exec.Cmd
	// done is closed when the process has exited; err is its exit status then.
	done chan struct{}
	err  error
}

func runUp(args []string) int {
	fs := flag.NewFlagSet("up", flag.ContinueOnError)
	dir := fs.String("dir", "", "state directory (required): pki/, etcd/, logs, admin.kubeconfig, ready")
	port := fs.Int("port", 0, "kube-apiserver secure port on 127.0.0.1 (0 picks a free port)")
	controllers := fs.String("controllers", strings.Join(defaultControllers, ","), "kube-controller-manager --controllers")
	watchClients := fs.Bool("watch-clients", false, "shut down once no process registered in DIR/clients/<pid> has been alive for 5s")
	timeout := fs.Duration("timeout", 3*time.Minute, "give up if the cluster is not ready within this time")
	var nodeOpts nodeOptions
	fs.BoolVar(&nodeOpts.enabled, "node", false, "run the real node (containerd, runc, CNI, the kubelet, kube-proxy) in a network namespace of its own, and kube-scheduler; instead of --kubelet")
	fs.StringVar(&nodeOpts.name, "real-node-name", "poolpilot-node", "name of the real node's Node")
	fs.StringVar(&nodeOpts.containerd, "containerd", "/usr/bin/containerd", "containerd binary of the real node")
	fs.StringVar(&nodeOpts.runc, "runc", "/usr/sbin/runc", "runc binary of the real node")
	fs.StringVar(&nodeOpts.cniBinDir, "cni-bin-dir", "/usr/lib/cni", "directory of the CNI plugins (bridge, host-local, loopback, portmap)")
	fs.Var(&nodeOpts.images, "image", "an OCI archive to import into the real node's containerd (repeatable)")
	fs.StringVar(&nodeOpts.sandbox, "sandbox-image", "docker.io/poolpilot/pause:local", "the pods' sandbox image (imported with --image)")
	fs.IntVar(&nodeOpts.nofile, "node-nofile", 4096, "RLIMIT_NOFILE of every container on the real node (containerd's runtime spec)")
	fs.Var(&nodeOpts.fdClasses, "node-nofile-class", "add a containerd runtime handler nofile-N with RLIMIT_NOFILE N, for a RuntimeClass (repeatable)")
	var prom prometheusOptions
	fs.StringVar(&prom.path, "prometheus", "", "run this Prometheus binary with Kubernetes service discovery against the cluster")
	fs.IntVar(&prom.port, "prometheus-port", 0, "Prometheus port on 127.0.0.1 (0 picks a free port)")
	fs.DurationVar(&prom.scrapeInterval, "scrape-interval", 2*time.Second, "Prometheus scrape and evaluation interval")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "cluster up: --dir is required")
		return 2
	}
	absDir, err := filepath.Abs(*dir)
	if err != nil {
		fmt.Fprintf(os.Stderr, "cluster up: %v\n", err)
		return 1
	}
	if err := up(absDir, *port, *controllers, *watchClients, *timeout, nodeOpts, prom); err != nil {
		fmt.Fprintf(os.Stderr, "cluster up: %v\n", err)
		return 1
	}
	return 0
}

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, " ") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

func up(dir string, port int, controllers string, watchClients bool, timeout time.Duration, nodeOpts nodeOptions, prom prometheusOptions) error {
	// Every "up" starts a fresh cluster: stale state from an earlier run would only confuse tests.
	for _, stale := range []string{"ready", "etcd", "pki", "kubelet", "prometheus", "logs", "node"} {
		if err := os.RemoveAll(filepath.Join(dir, stale)); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return err
	}
	// Whoever starts the next cluster in this folder waits for this process to be gone.
	if err := writeFileAtomic(filepath.Join(dir, "up.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return err
	}
	// Before any pod gets an address or any Service a ClusterIP: a connect to one that nothing
	// holds must fail here, not leave the machine by the default route.
	if err := hostnet.Install(hostnet.IP); err != nil {
		return fmt.Errorf("host routes: %w", err)
	}
	logf("routing %s (pods) and %s (Services) to nowhere unless an address is on lo", hostnet.PodRange, hostnet.ServiceRange)
	// Runs last, after every child (the node with its pods) has stopped.
	defer func() {
		done, err := releaseRoutes()
		if err != nil {
			done = fmt.Sprintf("removing them failed: %v", err)
		}
		logf("host routes: %s", done)
	}()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if watchClients {
		ctx = watchClientProcesses(ctx, filepath.Join(dir, "clients"))
	}

	ports, err := freePorts(4)
	if err != nil {
		return err
	}
	if port == 0 {
		port = ports[2]
	}
	// With the real node, the apiserver (and Prometheus) listen on this end of the node's link,
	// where the node's kubelet, kube-proxy and pods reach them; this machine reaches it too.
	listen := "127.0.0.1"
	var realNode *node
	if nodeOpts.enabled {
		realNode, err = startNodeNamespaces(dir, nodeOpts)
		if err != nil {
			return fmt.Errorf("node namespaces: %w", err)
		}
		defer realNode.stop()
		listen = hostLinkIP
		logf("node network namespace up: %s (here, %s) <-> %s (the node), pods of %s routed here one by one", hostLinkIP, hostnet.NodeLink, nodeLinkIP, podCIDR)
	}
	server := fmt.Sprintf("https://%s:%d", listen, port)

	p, err := generatePKI(filepath.Join(dir, "pki"))
	if err != nil {
		return fmt.Errorf("pki: %w", err)
	}
	admin := filepath.Join(dir, "admin.kubeconfig")
	kcmKubeconfig := filepath.Join(dir, "pki", "controller-manager.kubeconfig")
	if err := p.writeKubeconfig(kcmKubeconfig, server, "system:kube-controller-manager", nil); err != nil {
		return err
	}

	etcdLog := filepath.Join(dir, "logs", "etcd.log")
	etcd, err := startEtcd(dir, ports[0], ports[1], etcdLog)
	if err != nil {
		return withLogTail(err, etcdLog)
	}
	defer etcd.Close()
	logf("etcd serving on 127.0.0.1:%d", ports[0])

	apiserver, err := startChild(dir, "kube-apiserver", apiserverFlags(dir, p, listen, port, ports[0], nodeOpts.enabled))
	if err != nil {
		return err
	}
	children := []*child{apiserver}
	defer func() { stopChildren(children) }()

	deadline, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := waitReady(deadline, server, p, apiserver); err != nil {
		return withLogTail(fmt.Errorf("kube-apiserver: %w", err), apiserver.log)
	}
	// Only now publish the admin identity: whoever sees the file can use the cluster at once.
	if err := p.writeKubeconfig(admin, server, "poolpilot-admin", []string{"system:masters"}); err != nil {
		return err
	}
	logf("kube-apiserver ready at %s", server)

	if nodeOpts.enabled && controllers == strings.Join(defaultControllers, ",") {
		// A real kubelet heartbeats: the node lifecycle controller lifts the not-ready taint the
		// kubelet registers its Node with, and the pod garbage collector may run.
		controllers += ",node-lifecycle-controller,pod-garbage-collector-controller"
	}
	kcm, err := startChild(dir, "kube-controller-manager", controllerManagerFlags(p, kcmKubeconfig, controllers))
	if err != nil {
		return err
	}
	children = append(children, kcm)
	if err := waitControllers(deadline, admin, kcm); err != nil {
		return withLogTail(fmt.Errorf("kube-controller-manager: %w", err), kcm.log)
	}
	logf("kube-controller-manager running (%s)", controllers)

	if nodeOpts.enabled {
		schedKubeconfig := filepath.Join(dir, "pki", "scheduler.kubeconfig")
		if err := p.writeKubeconfig(schedKubeconfig, server, "system:kube-scheduler", nil); err != nil {
			return err
		}
		sched, err := startChild(dir, "kube-scheduler", schedulerFlags(schedKubeconfig))
		if err != nil {
			return err
		}
		children = append(children, sched)
		logf("kube-scheduler started")
		nodeChildren, err := realNode.startNode(deadline, p, server, admin)
		children = append(children, nodeChildren...)
		if err != nil {
			return fmt.Errorf("real node: %w", err)
		}
		logf("real node %s ready: containerd, kubelet %s, kube-proxy (iptables)", nodeOpts.name, version.Get().GitVersion)
	}

	promURL := ""
	if prom.path != "" {
		c, url, err := startPrometheus(deadline, dir, admin, server, listen, p, prom)
		if c != nil {
			children = append(children, c)
		}
		if err != nil {
			return err
		}
		promURL = url
		logf("prometheus ready at %s", url)
	}

	marker, _ := json.MarshalIndent(readyMarker{PID: os.Getpid(), Server: server, Kubeconfig: admin, Version: version.Get().GitVersion, Prometheus: promURL, Node: realNodeName(nodeOpts)}, "", "  ")
	if err := writeFileAtomic(filepath.Join(dir, "ready"), marker, 0o644); err != nil {
		return err
	}
	defer os.Remove(filepath.Join(dir, "ready"))
	logf("READY kubeconfig=%s", admin)

	// Any component's exit ends the cluster.
	exited := make(chan string, len(children))
	for _, c := range children {
		go func(c *child) { <-c.done; exited <- c.name }(c)
	}
	select {
	case <-ctx.Done():
		// Withdraw the marker first, so that nobody starts to reuse a cluster that is stopping.
		os.Remove(filepath.Join(dir, "ready"))
		logf("shutting down")
		return nil
	case name := <-exited:
		return childExited(children, name)
	case err := <-etcd.Err():
		return withLogTail(fmt.Errorf("etcd failed: %v", err), etcdLog)
	}
}

func apiserverFlags(dir string, p *pki, listen string, port, etcdPort int, realNode bool) []string {
	issuer := "https://kubernetes.default.svc.cluster.local"
	// Without the node every component listens on loopback, which the endpoint reconciler
	// refuses to publish for the "kubernetes" Service; with it, the Service's endpoint is the
	// node link's address, where pods reach it through kube-proxy.
	reconciler := "--endpoint-reconciler-type=none"
	if realNode {
		reconciler = "--endpoint-reconciler-type=lease"
	}
	return []string{
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", etcdPort),
		"--bind-address=" + listen,
		"--advertise-address=" + listen,
		fmt.Sprintf("--secure-port=%d", port),
		"--cert-dir=" + p.dir,
		"--tls-cert-file=" + p.path("apiserver.crt"),
		"--tls-private-key-file=" + p.path("apiserver.key"),
		"--client-ca-file=" + p.path("ca.crt"),
		"--service-account-issuer=" + issuer,
		"--api-audiences=" + issuer,
		"--service-account-key-file=" + p.path("sa.pub"),
		"--service-account-signing-key-file=" + p.path("sa.key"),
		"--service-cluster-ip-range=10.96.0.0/16",
		"--authorization-mode=Node,RBAC",
		// As OpenShift runs it: setting an ownerReference with blockOwnerDeletion needs `update`
		// on the owner's finalizers subresource (the operator's limits ConfigMaps point at
		// their ConnectionPolicy so; its RBAC must say so, and the e2e tests catch it if not).
		"--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
		// How `kubectl logs`, `exec` and `port-forward` reach the kubelet: the Node's InternalIP
		// (the node link's address) and daemonEndpoints port, its serving certificate checked
		// against the cluster CA, with the one client certificate the kubelet accepts.
		"--kubelet-preferred-address-types=InternalIP",
		"--kubelet-certificate-authority=" + p.path("ca.crt"),
		"--kubelet-client-certificate=" + p.path(apiserverKubeletCert),
		"--kubelet-client-key=" + p.path(apiserverKubeletKey),
		"--allow-privileged=true",
		reconciler,
		"--profiling=false",
		"--v=1",
	}
}

// realNodeName is the real node's name, or empty without one.
func realNodeName(o nodeOptions) string {
	if !o.enabled {
		return ""
	}
	return o.name
}

func schedulerFlags(kubeconfig string) []string {
	return []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-kubeconfig=" + kubeconfig,
		"--authorization-kubeconfig=" + kubeconfig,
		"--leader-elect=false",
		"--secure-port=0",
		"--v=1",
	}
}

func controllerManagerFlags(p *pki, kubeconfig, controllers string) []string {
	return []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-kubeconfig=" + kubeconfig,
		"--authorization-kubeconfig=" + kubeconfig,
		"--leader-elect=false",
		"--use-service-account-credentials=true",
		"--service-account-private-key-file=" + p.path("sa.key"),
		"--root-ca-file=" + p.path("ca.crt"),
		"--cluster-signing-cert-file=" + p.path("ca.crt"),
		"--cluster-signing-key-file=" + p.path("ca.key"),
		"--secure-port=0",
		"--controllers=" + controllers,
		"--concurrent-deployment-syncs=10",
		"--concurrent-replicaset-syncs=10",
		"--concurrent-gc-syncs=20",
		"--v=1",
	}
}

// startChild runs this same binary with a component subcommand, its output in DIR/logs/NAME.log.
func startChild(dir, name string, flags []string) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return startProgram(dir, name, self, append([]string{name}, flags...))
}

// startProgram runs a program as a child of "up", its output in DIR/logs/NAME.log.
func startProgram(dir, name, program string, args []string) (*child, error) {
	logPath := filepath.Join(dir, "logs", name+".log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(program, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// If "up" is killed outright, its children must not outlive it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, log: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		logFile.Close()
		close(c.done)
	}()
	return c, nil
}

// stopChildren stops the components in reverse start order: SIGTERM, then SIGKILL after 15s.
func stopChildren(children []*child) {
	for i := len(children) - 1; i >= 0; i-- {
		c := children[i]
		select {
		case <-c.done:
			continue
		default:
		}
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(15 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	}
}

// waitReady polls /readyz with the cluster CA until it answers 200, then waits for the default
// namespace, as Kubernetes' own test server does.
func waitReady(ctx context.Context, server string, p *pki, c *child) error {
	pool := x509.NewCertPool()
	pool.AddCert(p.ca.cert)
	httpc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	last := "no answer yet"
	for {
		resp, err := httpc.Get(server + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		select {
		case <-c.done:
			return fmt.Errorf("exited before becoming ready: %v", c.err)
		case <-ctx.Done():
			return fmt.Errorf("not ready in time (last /readyz: %s)", last)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// childExited reports the unexpected exit of the named child with its log tail.
func childExited(children []*child, name string) error {
	for _, c := range children {
		if c.name == name {
			return withLogTail(fmt.Errorf("%s exited: %v", name, c.err), c.log)
		}
	}
	return fmt.Errorf("%s exited", name)
}

// newClient builds a client-go clientset from a kubeconfig file.
func newClient(kubeconfig string) (*kubernetes.Clientset, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

// pollUntil calls check every 250ms until it reports done, the component c exits, or ctx ends.
func pollUntil(ctx context.Context, c *child, what string, check func() bool) error {
	for !check() {
		select {
		case <-c.done:
			return fmt.Errorf("exited before %s: %v", what, c.err)
		case <-ctx.Done():
			return fmt.Errorf("%s did not happen in time", what)
		case <-time.After(250 * time.Millisecond):
		}
	}
	return nil
}

// waitControllers waits for the default ServiceAccount of the default namespace: it is created
// by kube-controller-manager, so it proves the controllers run and can write.
func waitControllers(ctx context.Context, kubeconfig string, c *child) error {
	client, err := newClient(kubeconfig)
	if err != nil {
		return err
	}
	return pollUntil(ctx, c, "the default ServiceAccount appeared", func() bool {
		_, err := client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	})
}

// waitNodeReady waits until the kubelet has registered its Node as Ready.
func waitNodeReady(ctx context.Context, kubeconfig, name string, c *child) error {
	client, err := newClient(kubeconfig)
	if err != nil {
		return err
	}
	return pollUntil(ctx, c, "node "+name+" was Ready", func() bool {
		node, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == "Ready" && cond.Status == "True" {
				return true
			}
		}
		return false
	})
}

// watchClientProcesses returns a context that ends once none of the processes registered as
// files named by their pid in dir has been alive for clientGrace. Test processes that start or
// reuse the cluster register there; a cluster started for tests thus outlives each test binary
// but not the last one.
func watchClientProcesses(parent context.Context, dir string) context.Context {
	const clientGrace = 5 * time.Second
	ctx, cancel := context.WithCancel(parent)
	go func() {
		defer cancel()
		lastSeen := time.Now()
		for {
			entries, _ := os.ReadDir(dir)
			for _, e := range entries {
				pid, err := strconv.Atoi(e.Name())
				if err != nil || syscall.Kill(pid, 0) == syscall.ESRCH {
					os.Remove(filepath.Join(dir, e.Name()))
					continue
				}
				lastSeen = time.Now()
			}
			if time.Since(lastSeen) > clientGrace {
				logf("no client process left")
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
		}
	}()
	return ctx
}

func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	var listeners []net.Listener
	defer func() {
		for _, l := range listeners {
			l.Close()
		}
	}()
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		listeners = append(listeners, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// withLogTail appends the last lines of a component's log to an error, so a startup failure
// explains itself.
func withLogTail(err error, logPath string) error {
	data, readErr := os.ReadFile(logPath)
	if readErr != nil || len(data) == 0 {
		return err
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > 40 {
		lines = lines[len(lines)-40:]
	}
	return fmt.Errorf("%w\n--- last lines of %s ---\n%s", err, logPath, strings.Join(lines, "\n"))
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "%s cluster: %s\n", time.Now().Format("15:04:05"), fmt.Sprintf(format, args...))
}
