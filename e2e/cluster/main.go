// Command cluster is poolpilot's embedded Kubernetes control plane: one multi-call binary that
// carries a real etcd, kube-apiserver, kube-controller-manager and kubectl, all built from the
// Kubernetes Go modules, so tests and the demo run against the real API machinery.
//
// Subcommands:
//
//	cluster up --dir D              start etcd + kube-apiserver + kube-controller-manager, write D/admin.kubeconfig
//	                                (--node: with the node, see node.go)
//	cluster net up|check|down       the host routes that keep the cluster's traffic on this machine
//	cluster kubectl ...             a real kubectl (also when the binary is invoked through a link named "kubectl")
//	cluster kube-apiserver ...      the real kube-apiserver (started by "up" as a child process)
//	cluster kube-controller-manager ...
//	cluster kube-scheduler ...      the real kube-scheduler (started by "up --node")
//	cluster pause                   sleep until SIGTERM (holds the real node's namespaces)
//	cluster kubelet ...             the real kubelet (started by "up --node" in the node's network namespace)
//	cluster kube-proxy ...          the real kube-proxy (likewise)
//	cluster version                 the Kubernetes version this binary was built from
//
// Under the name poolpilot-route it is the real node's CNI plugin that routes each pod's address
// from this machine to the node (cniroute.go).
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/component-base/version"
)

const usage = `usage: cluster <command> [flags]

commands:
  up --dir DIR [flags]            run an embedded control plane until SIGTERM/SIGINT (see "cluster up --help")
  net up|check|down               install, check or remove the routes that keep its traffic on this machine
  kubectl ARGS...                 run the bundled kubectl
  kube-apiserver FLAGS...         run kube-apiserver (normally started by "up")
  kube-controller-manager FLAGS...run kube-controller-manager (normally started by "up")
  kube-scheduler FLAGS...         run kube-scheduler (started by "up --node")
  pause                           sleep until SIGTERM (holds the real node's namespaces)
  kubelet FLAGS...                run the kubelet (started by "up --node")
  kube-proxy FLAGS...             run kube-proxy (started by "up --node")
  version                         print the Kubernetes version compiled in
`

func main() {
	// Busybox-style: a link named kubectl runs kubectl directly.
	switch filepath.Base(os.Args[0]) {
	case "kubectl":
		os.Exit(runKubectl(os.Args[1:]))
	case cniRoutePlugin:
		// The real node's CNI plugin that routes each pod's address here (cniroute.go).
		os.Exit(runCNIRoute())
	}
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	switch cmd {
	case "up":
		os.Exit(runUp(args))
	case "net":
		os.Exit(runNet(args))
	case "kubectl":
		os.Exit(runKubectl(args))
	case "kube-apiserver":
		os.Exit(runAPIServer(args))
	case "kube-controller-manager":
		os.Exit(runControllerManager(args))
	case "kube-scheduler":
		os.Exit(runScheduler(args))
	case "pause":
		os.Exit(runPause(args))
	case "kubelet":
		os.Exit(runKubelet(args))
	case "kube-proxy":
		os.Exit(runKubeProxy(args))
	case "version", "--version":
		fmt.Println(version.Get().GitVersion)
	case "help", "-h", "--help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "cluster: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
}
