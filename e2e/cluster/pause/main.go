// Command pause is the pods' sandbox process on the real node ("cluster up --node"): the image
// docker.io/poolpilot/pause:local that `make node-images` builds FROM scratch, standing for
// registry.k8s.io/pause, which no machine of ours can pull. It holds the pod's namespaces: it
// sleeps until SIGTERM or SIGINT and reaps the children it inherits as PID 1.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, _ := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 {
				break
			}
		}
	}
}
