// CNI route: the last plugin of the real node's pod network ("poolpilot-route": this binary,
// linked under that name into the node's CNI bin directory). On ADD it routes the pod's address,
// and only that address, from this machine's network namespace through the node's link; on DEL
// it removes the route again. Every other address of the pod range stays under the unreachable
// route of package hostnet, so a connect from here to an address that no pod holds (one never
// given out, or a deleted pod's) fails at once with "No route to host" instead of being sent into
// the node, where the bridge would answer so only after its ARP timeout.
//
// containerd runs the plugin chain in the node's namespaces while it sets up a pod's sandbox (the
// route exists before the kubelet reports the pod's address) and, in reverse order, while it
// stops it (the route is gone before the kubelet lets the API server delete the pod).
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// cniRoutePlugin is the plugin's name: its "type" in the network configuration and the name of
// its link in the node's CNI bin directory.
const cniRoutePlugin = "poolpilot-route"

// cniRouteConf is the plugin's entry of the network configuration (node.cniConfig), as the
// runtime hands it over on stdin with the previous plugins' result.
type cniRouteConf struct {
	CNIVersion string `json:"cniVersion"`
	// HostNetns is the network namespace to route in (this machine's: "cluster up"'s own).
	HostNetns string `json:"hostNetns"`
	// Via and Dev are the node's end of the link and this end's device.
	Via string `json:"via"`
	Dev string `json:"dev"`
	// IPAMDir is host-local's state directory: the pod's address, when DEL comes without a
	// cached result.
	IPAMDir    string          `json:"ipamDir"`
	PrevResult json.RawMessage `json:"prevResult"`
}

// cniResult is the part of a CNI result the plugin reads: the pod's addresses.
type cniResult struct {
	IPs []struct {
		Address string `json:"address"`
	} `json:"ips"`
}

// runCNIRoute runs one CNI command (CNI_COMMAND) and returns the exit code; errors go to stdout
// in the CNI error format.
func runCNIRoute() int {
	conf := cniRouteConf{CNIVersion: "1.0.0"}
	fail := func(err error) int {
		msg, _ := json.Marshal(map[string]any{"cniVersion": conf.CNIVersion, "code": 999, "msg": err.Error()})
		fmt.Println(string(msg))
		return 1
	}
	command := os.Getenv("CNI_COMMAND")
	if command == "VERSION" {
		fmt.Println(`{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0"]}`)
		return 0
	}
	stdin, err := io.ReadAll(os.Stdin)
	if err != nil {
		return fail(err)
	}
	if err := json.Unmarshal(stdin, &conf); err != nil {
		return fail(fmt.Errorf("%s: the network configuration: %w", cniRoutePlugin, err))
	}
	if conf.HostNetns == "" || conf.Via == "" || conf.Dev == "" {
		return fail(fmt.Errorf("%s: hostNetns, via and dev are required", cniRoutePlugin))
	}
	switch command {
	case "ADD":
		addrs, err := resultAddresses(conf.PrevResult)
		if err != nil {
			return fail(err)
		}
		if len(addrs) == 0 {
			return fail(fmt.Errorf("%s: the previous plugins gave the pod no address", cniRoutePlugin))
		}
		for _, a := range addrs {
			if err := hostRoute(conf, "replace", a); err != nil {
				return fail(err)
			}
		}
		// A chained plugin passes the result on unchanged.
		fmt.Println(string(conf.PrevResult))
		return 0
	case "DEL":
		addrs, err := resultAddresses(conf.PrevResult)
		if err != nil || len(addrs) == 0 {
			addrs = ipamAddresses(conf.IPAMDir, os.Getenv("CNI_CONTAINERID"))
		}
		for _, a := range addrs {
			// DEL is idempotent: a route that is gone already is no error.
			if err := hostRoute(conf, "del", a); err != nil && !strings.Contains(err.Error(), "No such process") {
				return fail(err)
			}
		}
		return 0
	case "CHECK", "GC", "STATUS":
		return 0
	default:
		return fail(fmt.Errorf("%s: unknown CNI_COMMAND %q", cniRoutePlugin, command))
	}
}

// resultAddresses are the IPv4 addresses of a CNI result.
func resultAddresses(raw json.RawMessage) ([]netip.Addr, error) {
	if len(raw) == 0 {
		return nil, errors.New(cniRoutePlugin + ": no prevResult (it must follow the bridge plugin)")
	}
	var r cniResult
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, fmt.Errorf("%s: prevResult: %w", cniRoutePlugin, err)
	}
	var addrs []netip.Addr
	for _, ip := range r.IPs {
		p, err := netip.ParsePrefix(ip.Address)
		if err != nil {
			return nil, fmt.Errorf("%s: prevResult address %q: %w", cniRoutePlugin, ip.Address, err)
		}
		if p.Addr().Is4() {
			addrs = append(addrs, p.Addr())
		}
	}
	return addrs, nil
}

// ipamAddresses are the addresses host-local holds for a container: its state directory has a
// file per address, named by it and holding the container's id on the first line.
func ipamAddresses(dir, containerID string) []netip.Addr {
	if dir == "" || containerID == "" {
		return nil
	}
	var addrs []netip.Addr
	networks, _ := os.ReadDir(dir)
	for _, n := range networks {
		files, _ := os.ReadDir(filepath.Join(dir, n.Name()))
		for _, f := range files {
			a, err := netip.ParseAddr(f.Name())
			if err != nil {
				continue
			}
			data, err := os.ReadFile(filepath.Join(dir, n.Name(), f.Name()))
			if err == nil && strings.TrimSpace(strings.SplitN(string(data), "\n", 2)[0]) == containerID {
				addrs = append(addrs, a)
			}
		}
	}
	return addrs
}

// hostRoute adds ("replace") or removes ("del") the route of one pod address in the host's
// network namespace.
func hostRoute(conf cniRouteConf, verb string, addr netip.Addr) error {
	args := []string{"--net=" + conf.HostNetns, "--", "ip", "-4", "route", verb,
		addr.String() + "/32", "via", conf.Via, "dev", conf.Dev}
	out, err := exec.Command("nsenter", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: nsenter %s: %v: %s", cniRoutePlugin, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
