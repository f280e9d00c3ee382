// Package hostnet keeps the embedded cluster's traffic on this machine: it installs
// "unreachable" routes for the pod range and the Service range, so that a connect to an address
// in them that no local interface holds fails at once with "No route to host" instead of leaving
// through the default route, while the addresses of live pods keep working (each routed to the
// node by a /32 route of its own, longer than these; cniroute.go in the parent package).
//
// It refuses to touch a machine that already routes either range somewhere (a VPN, a kind
// cluster, a docker bridge): the routes would cut that off. Only the standard library and
// iproute2's `ip` are used, so its tests build in seconds.
package hostnet

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
)

// The cluster's address ranges. The node gives pods addresses from PodRange; kube-apiserver
// gives Services ClusterIPs from ServiceRange, which only kube-proxy inside the node serves.
var (
	PodRange     = netip.MustParsePrefix("10.244.0.0/16")
	ServiceRange = netip.MustParsePrefix("10.96.0.0/16")
	Ranges       = []netip.Prefix{PodRange, ServiceRange}
)

// Probes are addresses that no local interface ever holds, one per range, used to prove that
// the routes are in force: 10.244.255.0/24 is never given to a pod (fixtures that need "an
// address nothing listens on" take theirs from there), and 10.96.0.1 is the ClusterIP of the
// "kubernetes" Service.
var Probes = []netip.Addr{netip.MustParseAddr("10.244.255.1"), netip.MustParseAddr("10.96.0.1")}

// NodeLink is this end of the veth pair to the real node's network namespace ("cluster up
// --node"): the routes on it (its own /30 and the node's pod range through it) are the node's,
// inside PodRange and clear of the probes, and no conflict.
const NodeLink = "ppnode0"

// Runner runs `ip` with the given arguments and returns its standard output, or an error
// carrying its standard error. Tests replace it.
type Runner func(args ...string) ([]byte, error)

// IP runs the real iproute2 `ip`.
func IP(args ...string) ([]byte, error) {
	cmd := exec.Command("ip", args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = err.Error()
		}
		return out, fmt.Errorf("ip %s: %s", strings.Join(args, " "), msg)
	}
	return out, nil
}

// Route is one entry of `ip -j -4 route show table all`.
type Route struct {
	Type    string `json:"type"` // empty for unicast
	Dst     string `json:"dst"`  // "default", "10.244.0.0/16" or a host address
	Gateway string `json:"gateway"`
	Dev     string `json:"dev"`
	Table   string `json:"table"` // empty for the main table
}

// String renders the route the way `ip route` prints it.
func (r Route) String() string {
	var parts []string
	if r.Type != "" && r.Type != "unicast" {
		parts = append(parts, r.Type)
	}
	parts = append(parts, r.Dst)
	if r.Gateway != "" {
		parts = append(parts, "via", r.Gateway)
	}
	if r.Dev != "" {
		parts = append(parts, "dev", r.Dev)
	}
	if r.Table != "" {
		parts = append(parts, "table", r.Table)
	}
	return strings.Join(parts, " ")
}

// prefix is the route's destination as a prefix; ok is false for "default" and for anything
// that does not parse.
func (r Route) prefix() (netip.Prefix, bool) {
	if r.Dst == "" || r.Dst == "default" {
		return netip.Prefix{}, false
	}
	if strings.Contains(r.Dst, "/") {
		p, err := netip.ParsePrefix(r.Dst)
		return p.Masked(), err == nil
	}
	a, err := netip.ParseAddr(r.Dst)
	if err != nil {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, a.BitLen()), true
}

// ours says whether r is one of the routes this package installs.
func (r Route) ours() bool {
	if r.Type != "unreachable" || (r.Table != "" && r.Table != "main") {
		return false
	}
	p, ok := r.prefix()
	return ok && (p == PodRange || p == ServiceRange)
}

// podAddress says whether r is an address on lo (the tests' client range the node's link makes
// local, and the loopback range itself): the local table entries the ranges are meant to sit beside.
func (r Route) podAddress() bool {
	return r.Table == "local" && r.Dev == "lo" && r.Type == "local"
}

// Conflicts lists the routes that already send part of the cluster's ranges somewhere other
// than the default route: installing ours would cut them off (or, for a policy-routing table,
// be bypassed). Default routes, our own routes and addresses on lo are not conflicts.
func Conflicts(routes []Route) []Route {
	var found []Route
	for _, r := range routes {
		p, ok := r.prefix()
		if !ok || p.Bits() == 0 || r.ours() || r.podAddress() || r.Dev == NodeLink {
			continue
		}
		for _, rng := range Ranges {
			if p.Overlaps(rng) {
				found = append(found, r)
				break
			}
		}
	}
	return found
}

// Routes reads every IPv4 route of every table.
func Routes(ip Runner) ([]Route, error) {
	out, err := ip("-j", "-4", "route", "show", "table", "all")
	if err != nil {
		return nil, err
	}
	var routes []Route
	if err := json.Unmarshal(out, &routes); err != nil {
		return nil, fmt.Errorf("ip -j route: %w", err)
	}
	return routes, nil
}

// ErrConflict is wrapped by Install's error when the machine already routes a cluster range.
var ErrConflict = errors.New("the cluster's address ranges are already routed on this machine")

// ErrNotPermitted is wrapped by Install's error when the routes cannot be added (no
// CAP_NET_ADMIN).
var ErrNotPermitted = errors.New("not permitted to add routes")

// Install checks that nothing else routes the cluster's ranges, installs the unreachable routes
// (idempotent) and verifies that they are in force.
func Install(ip Runner) error {
	routes, err := Routes(ip)
	if err != nil {
		return err
	}
	if conflicts := Conflicts(routes); len(conflicts) > 0 {
		lines := make([]string, len(conflicts))
		for i, r := range conflicts {
			lines[i] = "  " + r.String()
		}
		return fmt.Errorf("%w:\n%s\nthe embedded cluster gives pods addresses from %s and Services from %s, "+
			"and routes both to nowhere so that no test packet leaves the machine; that would cut off "+
			"the routes above (a VPN, a kind cluster or a container bridge?). Stop what owns them, "+
			"or run the cluster on another machine", ErrConflict, strings.Join(lines, "\n"), PodRange, ServiceRange)
	}
	for _, rng := range Ranges {
		if _, err := ip("-4", "route", "replace", "unreachable", rng.String()); err != nil {
			if strings.Contains(err.Error(), "Operation not permitted") {
				return fmt.Errorf("%w: %v\nthe embedded cluster needs CAP_NET_ADMIN (run it as root) to route %s and %s "+
					"to nowhere, so that a connect to a pod that is gone or to a ClusterIP fails on this machine "+
					"instead of leaving it; it does not start without that", ErrNotPermitted, err, PodRange, ServiceRange)
			}
			return err
		}
	}
	return Check(ip)
}

// Check verifies that the routes are installed and in force: each probe address gets "No
// route to host" from the kernel.
func Check(ip Runner) error {
	routes, err := Routes(ip)
	if err != nil {
		return err
	}
	for _, rng := range Ranges {
		found := false
		for _, r := range routes {
			if p, ok := r.prefix(); ok && r.ours() && p == rng {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("no unreachable route for %s: traffic to addresses of the embedded cluster "+
				"that nothing holds would leave this machine (`make host-tools` or `cluster net up` installs it)", rng)
		}
	}
	for _, probe := range Probes {
		out, err := ip("-4", "route", "get", probe.String())
		if err == nil {
			return fmt.Errorf("%s, which nothing on this machine holds, is routed (%s) although an unreachable "+
				"route covers it: a policy-routing rule sends it elsewhere (see `ip rule`)", probe, strings.TrimSpace(string(out)))
		}
		if !strings.Contains(err.Error(), "No route to host") {
			return fmt.Errorf("checking the route to %s: %v", probe, err)
		}
	}
	return nil
}

// Remove deletes the unreachable routes (those that are there).
func Remove(ip Runner) error {
	routes, err := Routes(ip)
	if err != nil {
		return err
	}
	for _, r := range routes {
		if r.ours() {
			if _, err := ip("-4", "route", "del", "unreachable", r.Dst); err != nil {
				return err
			}
		}
	}
	return nil
}
