// Net: the host routes that keep the cluster's traffic on this machine (package hostnet), as
// the "net" subcommand and around "up": installed before any pod gets an address, removed by
// the last "up" on this machine to stop.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/poolpilot/poolpilot/e2e/cluster/hostnet"
)

const netUsage = `usage: cluster net up|check|down

  up     refuse if this machine already routes 10.244.0.0/16 or 10.96.0.0/16 elsewhere, else
         install "unreachable" routes for both (idempotent) and check them
  check  exit 1, saying why, unless both routes are installed and in force
  down   remove the routes, unless another "cluster up" on this machine still runs
`

func runNet(args []string) int {
	if len(args) != 1 {
		fmt.Fprint(os.Stderr, netUsage)
		return 2
	}
	routes := fmt.Sprintf("unreachable %s and unreachable %s", hostnet.PodRange, hostnet.ServiceRange)
	var (
		done string
		err  error
	)
	switch args[0] {
	case "up":
		done, err = "installed and in force: "+routes, hostnet.Install(hostnet.IP)
	case "check":
		done, err = "in force: "+routes, hostnet.Check(hostnet.IP)
	case "down":
		done, err = releaseRoutes()
	default:
		fmt.Fprint(os.Stderr, netUsage)
		return 2
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "cluster net %s: %v\n", args[0], err)
		return 1
	}
	fmt.Printf("cluster net %s: %s\n", args[0], done)
	return 0
}

// releaseRoutes removes the routes when no other "cluster up" runs on this machine (while one
// does, its pods and Services still need them) and says which it did.
func releaseRoutes() (string, error) {
	if others := otherClusters(); len(others) > 0 {
		return "routes kept: cluster up still runs as pid " + strings.Join(others, ", "), nil
	}
	return "routes removed", hostnet.Remove(hostnet.IP)
}

// otherClusters lists the pids of the "cluster up" processes on this machine other than this
// one (this binary under any path, with "up" as its first argument).
func otherClusters() []string {
	self := os.Getpid()
	entries, _ := os.ReadDir("/proc")
	var pids []string
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
		if len(argv) >= 2 && filepath.Base(argv[0]) == "cluster" && argv[1] == "up" {
			pids = append(pids, e.Name())
		}
	}
	return pids
}
