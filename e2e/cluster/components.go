// Components: the real Kubernetes commands (kube-apiserver, kube-controller-manager, kubelet,
// kube-proxy, kubectl) wrapped so that one binary can run each of them, hyperkube style.
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserverapp "k8s.io/kubernetes/cmd/kube-apiserver/app"
	kcmapp "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxyapp "k8s.io/kubernetes/cmd/kube-proxy/app"
	schedapp "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubeletapp "k8s.io/kubernetes/cmd/kubelet/app"
)

func runAPIServer(args []string) int {
	cmd := apiserverapp.NewAPIServerCommand()
	cmd.SetArgs(args)
	return cli.Run(cmd)
}

func runControllerManager(args []string) int {
	cmd := kcmapp.NewControllerManagerCommand()
	cmd.SetArgs(args)
	return cli.Run(cmd)
}

func runKubectl(args []string) int {
	// kubectl inspects os.Args itself (plugin lookup), so present it as if it were invoked directly.
	os.Args = append([]string{"kubectl"}, args...)
	cmd := kubectlcmd.NewDefaultKubectlCommand()
	if err := cli.RunNoErrOutput(cmd); err != nil {
		kubectlutil.CheckErr(err)
	}
	return 0
}

func runKubelet(args []string) int {
	cmd := kubeletapp.NewKubeletCommand(context.Background())
	cmd.SetArgs(args)
	return cli.Run(cmd)
}

func runKubeProxy(args []string) int {
	cmd := proxyapp.NewProxyCommand()
	cmd.SetArgs(args)
	return cli.Run(cmd)
}

func runScheduler(args []string) int {
	cmd := schedapp.NewSchedulerCommand()
	cmd.SetArgs(args)
	return cli.Run(cmd)
}
