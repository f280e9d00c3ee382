// Node: the real node of "up --node". A network namespace of its own (as kind runs its node in a
// container), reached from this one through one veth pair, holds containerd (with runc and the
// standard CNI plugins: bridge + host-local), the real kubelet and kube-proxy (iptables mode),
// all sharing one private mount namespace. Nothing of it touches this namespace's netfilter, and
// its routing only by the link's own /30, one /32 route through it per pod address while the pod
// has it (the CNI plugin of cniroute.go) and the tests' client range (clientRange) made local.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/poolpilot/poolpilot/e2e/cluster/hostnet"
)

// The node's addresses: the link between this namespace and the node's, and the node's pod range
// (its bridge cni0 is the pods' gateway). All inside hostnet.PodRange, clear of its probes.
const (
	hostLinkIP = "10.244.254.1" // this namespace's end: the apiserver and Prometheus listen here
	nodeLinkIP = "10.244.254.2" // the node's end: its InternalIP, the kubelet's API on 10250
	linkBits   = 30
	podCIDR    = "10.244.0.0/24"
	podGateway = "10.244.0.1"
	nodeDev    = "eth0"
	// clientRange is where tests take the source addresses of distinct clients from (the local
	// kubelet's pods see any 127/8 address; the node's only what is routed to it): local here
	// (any address of it can be bound), routed back from the node through the link.
	clientRange = "10.244.128.0/18"
)

// nodeOptions says whether and how "up" runs the real node.
type nodeOptions struct {
	enabled    bool
	name       string
	containerd string
	runc       string
	cniBinDir  string
	images     stringList
	sandbox    string
	// nofile is RLIMIT_NOFILE of every container (containerd's runtime spec); fdClasses adds a
	// runtime handler "nofile-N" (a RuntimeClass's handler) per N, for pods that need another.
	nofile    int
	fdClasses stringList
}

// node is the running node: the process holding its namespaces, its directory and components.
type node struct {
	opts   nodeOptions
	dir    string
	holder *child
	cgroup string
}

// nsPath is the holder's namespace file of kind ("net" or "mnt").
func (n *node) nsPath(kind string) string {
	return fmt.Sprintf("/proc/%d/ns/%s", n.holder.cmd.Process.Pid, kind)
}

// startNodeNamespaces starts the holder of the node's namespaces ("cluster pause" in a new
// network and mount namespace) and wires the veth pair: this end hostLinkIP on hostnet.NodeLink,
// the node's end nodeLinkIP, and clientRange local here and routed back from the node. The pods'
// addresses are routed here one by one, by the CNI plugin, while a pod holds them; the rest of
// podCIDR stays under hostnet's unreachable route. Nothing else is routed between the two: the
// node has no default route, so its pods reach only this machine's cluster addresses, and what
// they send elsewhere fails in the node.
func startNodeNamespaces(dir string, opts nodeOptions) (*node, error) {
	ndir := filepath.Join(dir, "node")
	if err := os.MkdirAll(filepath.Join(ndir, "logs"), 0o755); err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	logPath := filepath.Join(dir, "logs", "node-namespaces.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, "pause")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// Go makes "/" a private mount in the new mount namespace: the node's mounts (containers'
	// root file systems, volumes) stay in it and vanish with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:   syscall.CLONE_NEWNET,
		Unshareflags: syscall.CLONE_NEWNS,
		Pdeathsig:    syscall.SIGKILL,
		Setpgid:      true,
	}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("node namespaces: %w", err)
	}
	holder := &child{name: "node-namespaces", log: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		holder.err = cmd.Wait()
		logFile.Close()
		close(holder.done)
	}()
	n := &node{opts: opts, dir: ndir, holder: holder}
	pid := strconv.Itoa(cmd.Process.Pid)
	link := hostnet.NodeLink
	// A link left by a cluster that was killed outright.
	_, _ = hostnet.IP("link", "del", link)
	steps := [][]string{
		{"link", "add", link, "type", "veth", "peer", "name", nodeDev, "netns", pid},
		{"addr", "add", fmt.Sprintf("%s/%d", hostLinkIP, linkBits), "dev", link},
		{"link", "set", link, "up"},
		{"route", "replace", "local", clientRange, "dev", "lo", "table", "local"},
	}
	for _, s := range steps {
		if _, err := hostnet.IP(s...); err != nil {
			n.stop()
			return nil, err
		}
	}
	inNode := [][]string{
		{"link", "set", "lo", "up"},
		{"addr", "add", fmt.Sprintf("%s/%d", nodeLinkIP, linkBits), "dev", nodeDev},
		{"link", "set", nodeDev, "up"},
		{"route", "add", clientRange, "via", hostLinkIP, "dev", nodeDev},
	}
	for _, s := range inNode {
		if out, err := n.run("ip", s...); err != nil {
			n.stop()
			return nil, fmt.Errorf("in the node: ip %s: %v: %s", strings.Join(s, " "), err, out)
		}
	}
	return n, nil
}

// command is a command in the node's namespaces (nsenter execs it: its pid is the program's).
func (n *node) command(program string, args ...string) *exec.Cmd {
	all := append([]string{"--net=" + n.nsPath("net"), "--mount=" + n.nsPath("mnt"), "--", program}, args...)
	return exec.Command("nsenter", all...)
}

// run runs a command in the node and returns its combined output.
func (n *node) run(program string, args ...string) ([]byte, error) {
	return n.command(program, args...).CombinedOutput()
}

// start runs a node component in the node's namespaces, its output in DIR/logs/NAME.log.
func (n *node) start(name, program string, args ...string) (*child, error) {
	all := append([]string{"--net=" + n.nsPath("net"), "--mount=" + n.nsPath("mnt"), "--", program}, args...)
	return startProgram(filepath.Dir(n.dir), name, "nsenter", all)
}

// stop ends the holder (the namespaces go with their last process) and removes this end of the
// link and the node's cgroups.
func (n *node) stop() {
	n.killLeftovers()
	if n.holder != nil {
		select {
		case <-n.holder.done:
		default:
			_ = n.holder.cmd.Process.Kill()
			<-n.holder.done
		}
	}
	_, _ = hostnet.IP("link", "del", hostnet.NodeLink)
	_, _ = hostnet.IP("route", "del", "local", clientRange, "dev", "lo", "table", "local")
	if n.cgroup != "" {
		removeCgroups(n.cgroup)
	}
}

// cgroupHierarchies are the cgroup v1 hierarchies the kubelet manages pods in.
var cgroupHierarchies = []string{"cpu", "cpuacct", "cpuset", "memory", "pids", "blkio", "devices", "freezer", "systemd"}

// makeCgroups creates the node's cgroup root in every v1 hierarchy (the kubelet's cgroupRoot
// must exist), so that two clusters on one machine never share "kubepods". Its CPU weight is
// the node's capacity, 1024 per CPU, as the kubelet gives kubepods below it: at the default
// 1024 the whole node weighed as much as one other session of this machine (the kernel's
// autogroups weigh 1024 each, whatever their processes' nice values), and under the load of
// other builds all of its pods together got 0.3 of the 2 CPUs (hostile_clients: its backends
// then answered too slowly for the gateway's lease timeout).
func makeCgroups(name string) error {
	for _, h := range cgroupHierarchies {
		base := filepath.Join("/sys/fs/cgroup", h)
		if _, err := os.Stat(base); err != nil {
			continue
		}
		p := filepath.Join(base, name)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", p, err)
		}
		if h == "cpu" {
			shares := strconv.Itoa(1024 * runtime.NumCPU())
			if err := os.WriteFile(filepath.Join(p, "cpu.shares"), []byte(shares), 0o644); err != nil {
				return fmt.Errorf("cgroup %s: cpu.shares: %w", p, err)
			}
		}
		if h == "cpuset" {
			// A new cpuset cgroup has no cpus or mems: copy the parent's, or nothing can join it.
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(base, f))
				if err == nil {
					_ = os.WriteFile(filepath.Join(p, f), v, 0o644)
				}
			}
		}
	}
	return nil
}

// removeCgroups removes the node's cgroup trees, deepest first (a cgroup with children or
// processes cannot be removed; the processes are gone by now).
func removeCgroups(name string) {
	for _, h := range cgroupHierarchies {
		root := filepath.Join("/sys/fs/cgroup", h, name)
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			_ = os.Remove(dirs[i])
		}
	}
}

// containerdConfig is containerd's configuration: everything under the node's directory (its
// socket, root, state, runc's state), the CRI plugin with runc, the CNI config and plugins
// (cniBinDir) and one runtime spec per fd limit.
func (n *node) containerdConfig(cniBinDir string) (string, error) {
	d := n.dir
	var handlers strings.Builder
	runtime := func(name, spec string) {
		fmt.Fprintf(&handlers, `
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%s]
  runtime_type = "io.containerd.runc.v2"
  base_runtime_spec = %q
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.%s.options]
    BinaryName = %q
    Root = %q
    SystemdCgroup = false
`, name, spec, name, n.opts.runc, filepath.Join(d, "runc"))
	}
	spec, err := n.runtimeSpec(n.opts.nofile)
	if err != nil {
		return "", err
	}
	runtime("runc", spec)
	for _, c := range n.opts.fdClasses {
		limit, err := strconv.Atoi(c)
		if err != nil {
			return "", fmt.Errorf("--node-nofile-class %q: %w", c, err)
		}
		spec, err := n.runtimeSpec(limit)
		if err != nil {
			return "", err
		}
		runtime("nofile-"+c, spec)
	}
	return fmt.Sprintf(`version = 2
root = %q
state = %q
oom_score = 0

[grpc]
  address = %q

[ttrpc]
  address = %q

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # Without CAP_SYS_RESOURCE no process may lower its oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
%s`, filepath.Join(d, "containerd", "root"), filepath.Join(d, "containerd", "state"),
		n.socket(), filepath.Join(d, "containerd", "ttrpc.sock"), filepath.Join(d, "containerd", "opt"),
		n.opts.sandbox, cniBinDir, filepath.Join(d, "cni"), handlers.String()), nil
}

func (n *node) socket() string { return filepath.Join(n.dir, "containerd", "containerd.sock") }

// runtimeSpec writes containerd's default OCI spec (`ctr oci spec`) with RLIMIT_NOFILE set to
// limit (soft and hard) and returns its path: the fd limit every container of that runtime
// handler starts with.
func (n *node) runtimeSpec(limit int) (string, error) {
	out, err := exec.Command("ctr", "oci", "spec").Output()
	if err != nil {
		return "", fmt.Errorf("ctr oci spec: %w", err)
	}
	var spec map[string]any
	if err := json.Unmarshal(out, &spec); err != nil {
		return "", fmt.Errorf("ctr oci spec: %w", err)
	}
	process, _ := spec["process"].(map[string]any)
	if process == nil {
		return "", errors.New("ctr oci spec: no process")
	}
	process["rlimits"] = []map[string]any{{"type": "RLIMIT_NOFILE", "hard": limit, "soft": limit}}
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return "", err
	}
	path := filepath.Join(n.dir, fmt.Sprintf("runtime-spec-nofile-%d.json", limit))
	return path, writeFileAtomic(path, data, 0o644)
}

// cniConfig is the pod network: a bridge cni0 with the pods' gateway address, host-local
// addresses from podCIDR (its state in the node's directory), the pod's default route to the
// bridge (inside the node, which routes only to this machine's cluster addresses), and last the
// route of the pod's address from this machine's namespace (hostNetns) through the link
// (cniroute.go).
func (n *node) cniConfig(hostNetns string) string {
	ipam := filepath.Join(n.dir, "cni", "ipam")
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "poolpilot",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "isDefaultGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %q, "gateway": %q}]],
        "dataDir": %q
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": %q, "hostNetns": %q, "via": %q, "dev": %q, "ipamDir": %q}
  ]
}
`, podCIDR, podGateway, ipam, cniRoutePlugin, hostNetns, nodeLinkIP, hostnet.NodeLink, ipam)
}

// cniBinDir makes the node's CNI bin directory: a link to each plugin of --cni-bin-dir and one
// named poolpilot-route to this binary.
func (n *node) cniBinDir() (string, error) {
	dir := filepath.Join(n.dir, "cni-bin")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	plugins, err := os.ReadDir(n.opts.cniBinDir)
	if err != nil {
		return "", fmt.Errorf("the CNI plugins: %w", err)
	}
	for _, p := range plugins {
		if err := os.Symlink(filepath.Join(n.opts.cniBinDir, p.Name()), filepath.Join(dir, p.Name())); err != nil {
			return "", err
		}
	}
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	return dir, os.Symlink(self, filepath.Join(dir, cniRoutePlugin))
}

// startContainerd writes the configuration, starts containerd in the node and waits for its
// socket, then imports the images (OCI archives) into the CRI's namespace.
func (n *node) startContainerd(ctx context.Context) (*child, error) {
	for _, sub := range []string{"containerd", "cni", "runc"} {
		if err := os.MkdirAll(filepath.Join(n.dir, sub), 0o755); err != nil {
			return nil, err
		}
	}
	binDir, err := n.cniBinDir()
	if err != nil {
		return nil, err
	}
	cfg, err := n.containerdConfig(binDir)
	if err != nil {
		return nil, err
	}
	cfgPath := filepath.Join(n.dir, "containerd.toml")
	if err := writeFileAtomic(cfgPath, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	hostNetns := fmt.Sprintf("/proc/%d/ns/net", os.Getpid())
	if err := writeFileAtomic(filepath.Join(n.dir, "cni", "10-poolpilot.conflist"), []byte(n.cniConfig(hostNetns)), 0o644); err != nil {
		return nil, err
	}
	c, err := n.start("containerd", n.opts.containerd, "--config", cfgPath)
	if err != nil {
		return nil, err
	}
	if err := pollUntil(ctx, c, "containerd serving", func() bool {
		_, err := n.run("ctr", "--address", n.socket(), "version")
		return err == nil
	}); err != nil {
		return c, withLogTail(err, c.log)
	}
	for _, archive := range n.opts.images {
		start := time.Now()
		out, err := n.run("ctr", "--address", n.socket(), "-n", "k8s.io", "images", "import", "--no-unpack=false", archive)
		if err != nil {
			return c, fmt.Errorf("importing %s: %v: %s", archive, err, out)
		}
		logf("imported %s into containerd (%s): %s", filepath.Base(archive), time.Since(start).Round(time.Millisecond),
			strings.TrimSpace(string(out)))
	}
	return c, nil
}

// kubeletConfig is the kubelet's KubeletConfiguration: cgroup v1 allowed (this machine's
// layout), cgroupfs under the node's own cgroup root, containerd's socket, its API on the node's
// address with the serving pair and the apiserver's client CA, no image or eviction pressure
// from a busy development disk, no DNS servers of the machine leaking into pods, and a
// container's log rotated only past 256 MiB (the default 10 MiB rotates a gateway's access log
// within a minute of a few hundred calls a second, and `kubectl logs` reads only the newest
// file: e2e/tests/scenarios/token_budgets.rs reads every call of a phase from it).
func (n *node) kubeletConfig(p *pki) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%s
cgroupsPerQOS: true
containerRuntimeEndpoint: unix://%s
address: %s
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: %s
tlsPrivateKeyFile: %s
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %s}
authorization:
  mode: AlwaysAllow
clusterDomain: cluster.local
resolvConf: %s
failSwapOn: false
oomScoreAdj: 0
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%"}
mergeDefaultEvictionSettings: false
serializeImagePulls: false
maxPods: 250
podPidsLimit: -1
syncFrequency: 10s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 5s
shutdownGracePeriod: 0s
podLogsDir: %s
containerLogMaxSize: 256Mi
containerLogMaxFiles: 2
`, n.cgroup, n.socket(), nodeLinkIP, p.path(kubeletServingCert), p.path(kubeletServingKey), p.path(kubeletClientCA),
		filepath.Join(n.dir, "resolv.conf"), filepath.Join(n.dir, "pod-logs"))
}

// kubeProxyConfig is kube-proxy's configuration: iptables mode in the node, every Service
// connection masqueraded to the bridge's address (so a reply from a pod on the same bridge comes
// back through the node and is un-NATed), no change to this machine's conntrack table size.
func (n *node) kubeProxyConfig(kubeconfig string) string {
	return fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
hostnameOverride: %s
clusterCIDR: %s
clientConnection: {kubeconfig: %s}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
nodePortAddresses: [%s/32]
iptables:
  masqueradeAll: true
  localhostNodePorts: false
  syncPeriod: 10s
  minSyncPeriod: 0s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`, n.opts.name, hostnet.PodRange, kubeconfig, nodeLinkIP)
}

// startNode starts containerd, the kubelet and kube-proxy in the node and waits for the Node to
// be Ready. server is the apiserver's URL on hostLinkIP.
func (n *node) startNode(ctx context.Context, p *pki, server, admin string) ([]*child, error) {
	var children []*child
	n.cgroup = "poolpilot-" + strconv.Itoa(os.Getpid())
	if err := makeCgroups(n.cgroup); err != nil {
		return nil, err
	}
	cd, err := n.startContainerd(ctx)
	if cd != nil {
		children = append(children, cd)
	}
	if err != nil {
		return children, err
	}
	if err := p.issueKubelet(n.opts.name, []net.IP{net.ParseIP(nodeLinkIP)}); err != nil {
		return children, err
	}
	kubeletKubeconfig := filepath.Join(n.dir, "kubelet.kubeconfig")
	if err := p.writeKubeconfig(kubeletKubeconfig, server, "system:node:"+n.opts.name, []string{"system:nodes"}); err != nil {
		return children, err
	}
	proxyKubeconfig := filepath.Join(n.dir, "kube-proxy.kubeconfig")
	if err := p.writeKubeconfig(proxyKubeconfig, server, "system:kube-proxy", nil); err != nil {
		return children, err
	}
	// Pods' DNS: no name servers of this machine (the cluster has no DNS server yet).
	if err := writeFileAtomic(filepath.Join(n.dir, "resolv.conf"), []byte("options ndots:1\n"), 0o644); err != nil {
		return children, err
	}
	kubeletCfg := filepath.Join(n.dir, "kubelet.yaml")
	if err := writeFileAtomic(kubeletCfg, []byte(n.kubeletConfig(p)), 0o644); err != nil {
		return children, err
	}
	self, err := os.Executable()
	if err != nil {
		return children, err
	}
	kubelet, err := n.start("kubelet", self, "kubelet", "--config="+kubeletCfg, "--kubeconfig="+kubeletKubeconfig,
		"--root-dir="+filepath.Join(n.dir, "kubelet"), "--node-ip="+nodeLinkIP, "--hostname-override="+n.opts.name, "--v=1")
	if err != nil {
		return children, err
	}
	children = append(children, kubelet)
	proxyCfg := filepath.Join(n.dir, "kube-proxy.yaml")
	if err := writeFileAtomic(proxyCfg, []byte(n.kubeProxyConfig(proxyKubeconfig)), 0o644); err != nil {
		return children, err
	}
	proxy, err := n.start("kube-proxy", self, "kube-proxy", "--config="+proxyCfg, "--v=1")
	if err != nil {
		return children, err
	}
	children = append(children, proxy)
	if err := waitNodeReady(ctx, admin, n.opts.name, kubelet); err != nil {
		return children, withLogTail(fmt.Errorf("kubelet: %w", err), kubelet.log)
	}
	return children, nil
}

// runPause is the holder of the node's namespaces and the pods' sandbox process alike: it
// sleeps until SIGTERM or SIGINT, reaping any child it inherits.
func runPause(args []string) int {
	_ = args
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				pid, _ := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 {
					break
				}
			}
			continue
		}
		return 0
	}
	return 0
}

// killLeftovers kills what the components leave running when they stop: the containers (every
// process in the node's cgroups) and containerd's shims (every process in the node's network
// namespace but its holder).
func (n *node) killLeftovers() {
	if n.cgroup != "" {
		_ = filepath.WalkDir(filepath.Join("/sys/fs/cgroup/pids", n.cgroup), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil
			}
			data, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(data)) {
				if pid, err := strconv.Atoi(f); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			return nil
		})
	}
	if n.holder == nil {
		return
	}
	netns, err := os.Readlink(n.nsPath("net"))
	if err != nil {
		return
	}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == n.holder.cmd.Process.Pid {
			continue
		}
		if ns, err := os.Readlink(filepath.Join("/proc", e.Name(), "ns", "net")); err == nil && ns == netns {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	// Wait (briefly) for the cgroups to empty, so that they can be removed.
	time.Sleep(500 * time.Millisecond)
}
