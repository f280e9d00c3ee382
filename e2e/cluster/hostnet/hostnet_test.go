// Tests of the host routes against a fake `ip` that keeps a routing table in memory.
package hostnet

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
)

// fakeIP answers `ip` the way iproute2 does for the handful of commands this package runs.
type fakeIP struct {
	routes []Route
	// denied makes route changes fail as they do without CAP_NET_ADMIN.
	denied bool
	// bypass makes `route get` answer as if a policy rule sent the probes elsewhere.
	bypass bool
	calls  []string
}

func (f *fakeIP) run(args ...string) ([]byte, error) {
	cmd := strings.Join(args, " ")
	f.calls = append(f.calls, cmd)
	switch {
	case cmd == "-j -4 route show table all":
		return json.Marshal(f.routes)
	case strings.HasPrefix(cmd, "-4 route replace unreachable "), strings.HasPrefix(cmd, "-4 route del unreachable "):
		if f.denied {
			return nil, fmt.Errorf("ip %s: RTNETLINK answers: Operation not permitted", cmd)
		}
		dst := args[len(args)-1]
		kept := f.routes[:0]
		for _, r := range f.routes {
			if !(r.Type == "unreachable" && r.Dst == dst && r.Table == "") {
				kept = append(kept, r)
			}
		}
		f.routes = kept
		if args[2] == "replace" {
			f.routes = append(f.routes, Route{Type: "unreachable", Dst: dst})
		}
		return nil, nil
	case strings.HasPrefix(cmd, "-4 route get "):
		if f.bypass {
			return []byte(args[3] + " dev wg0 table 51820 src 10.8.0.2\n"), nil // hermetic: not a destination (a fake route)
		}
		for _, r := range f.routes {
			if r.ours() {
				if p, _ := r.prefix(); p.Contains(mustAddr(args[3])) {
					return nil, fmt.Errorf("ip %s: RTNETLINK answers: No route to host", cmd)
				}
			}
		}
		return []byte(args[3] + " via 192.0.2.1 dev eth0\n"), nil // hermetic: not a destination (a fake route)
	}
	return nil, fmt.Errorf("fake ip: unexpected command %q", cmd)
}

// A development machine: a default route, its LAN, loopback and two pod addresses on lo.
func machine() []Route {
	return []Route{
		{Dst: "default", Gateway: "192.0.2.1", Dev: "eth0"}, // hermetic: not a destination (a fake route)
		{Dst: "192.0.2.0/24", Dev: "eth0"},                  // hermetic: not a destination (a fake route)
		{Type: "local", Dst: "127.0.0.0/8", Dev: "lo", Table: "local"},
		{Type: "local", Dst: "10.244.0.5", Dev: "lo", Table: "local"},
		{Type: "local", Dst: "10.244.0.6", Dev: "lo", Table: "local"},
	}
}

func TestInstallAddsBothRoutesAndTheProbesAreUnreachable(t *testing.T) {
	f := &fakeIP{routes: machine()}
	if err := Install(f.run); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"unreachable 10.244.0.0/16", "unreachable 10.96.0.0/16"} {
		if !hasRoute(f.routes, want) {
			t.Errorf("no %q in %v", want, f.routes)
		}
	}
	if err := Check(f.run); err != nil {
		t.Errorf("check after install: %v", err)
	}
}

func TestInstallIsIdempotent(t *testing.T) {
	f := &fakeIP{routes: machine()}
	for i := 0; i < 3; i++ {
		if err := Install(f.run); err != nil {
			t.Fatalf("install #%d: %v", i+1, err)
		}
	}
	if n := len(f.routes); n != len(machine())+2 {
		t.Errorf("%d routes after three installs: %v", n, f.routes)
	}
}

func TestRoutesAlreadyCoveringARangeAreAConflictAndNothingIsInstalled(t *testing.T) {
	for name, conflict := range map[string]Route{
		"a VPN route for all of 10/8":        {Dst: "10.0.0.0/8", Gateway: "10.8.0.1", Dev: "tun0"},         // hermetic: not a destination (a fake route)
		"a kind cluster's pod subnet":        {Dst: "10.244.1.0/24", Gateway: "172.18.0.3", Dev: "br-kind"}, // hermetic: not a destination (a fake route)
		"a Service range in another table":   {Dst: "10.96.0.0/12", Dev: "wg0", Table: "51820"},
		"an interface address in the range":  {Type: "local", Dst: "10.244.7.1", Dev: "docker0", Table: "local"},
		"someone else's blackhole":           {Type: "blackhole", Dst: "10.96.0.0/16"},
		"an unreachable route of other size": {Type: "unreachable", Dst: "10.244.0.0/17"},
	} {
		t.Run(name, func(t *testing.T) {
			f := &fakeIP{routes: append(machine(), conflict)}
			err := Install(f.run)
			if !errors.Is(err, ErrConflict) {
				t.Fatalf("want a conflict, got %v", err)
			}
			if !strings.Contains(err.Error(), conflict.String()) {
				t.Errorf("the message does not name the route %q:\n%v", conflict, err)
			}
			for _, call := range f.calls {
				if strings.Contains(call, "replace") {
					t.Errorf("installed despite the conflict: %q", call)
				}
			}
		})
	}
}

func TestRoutesOutsideTheRangesAreNoConflict(t *testing.T) {
	routes := append(machine(),
		Route{Dst: "10.8.0.0/24", Dev: "tun0"},      // hermetic: not a destination (a fake route)
		Route{Dst: "172.17.0.0/16", Dev: "docker0"}, // hermetic: not a destination (a fake route)
		Route{Dst: "default", Dev: "wg0", Table: "51820"},
		Route{Type: "unreachable", Dst: "10.244.0.0/16"},
	)
	if c := Conflicts(routes); len(c) != 0 {
		t.Errorf("conflicts %v", c)
	}
}

func TestWithoutCapNetAdminInstallRefusesWithTheReason(t *testing.T) {
	f := &fakeIP{routes: machine(), denied: true}
	err := Install(f.run)
	if !errors.Is(err, ErrNotPermitted) {
		t.Fatalf("want ErrNotPermitted, got %v", err)
	}
	if !strings.Contains(err.Error(), "CAP_NET_ADMIN") {
		t.Errorf("the message does not say what is missing: %v", err)
	}
}

func TestCheckFailsWhenARouteIsMissingOrBypassed(t *testing.T) {
	f := &fakeIP{routes: machine()}
	if err := Check(f.run); err == nil || !strings.Contains(err.Error(), "no unreachable route for 10.244.0.0/16") {
		t.Errorf("check without routes: %v", err)
	}
	if err := Install(f.run); err != nil {
		t.Fatal(err)
	}
	f.bypass = true
	if err := Check(f.run); err == nil || !strings.Contains(err.Error(), "policy-routing") {
		t.Errorf("check with a bypassing rule: %v", err)
	}
}

func TestRemoveTakesOnlyOurRoutes(t *testing.T) {
	f := &fakeIP{routes: machine()}
	if err := Install(f.run); err != nil {
		t.Fatal(err)
	}
	if err := Remove(f.run); err != nil {
		t.Fatal(err)
	}
	if got, want := fmt.Sprint(f.routes), fmt.Sprint(machine()); got != want {
		t.Errorf("after remove:\n got %s\nwant %s", got, want)
	}
}

func hasRoute(routes []Route, want string) bool {
	for _, r := range routes {
		if r.String() == want {
			return true
		}
	}
	return false
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func TestTheRealNodesRoutesAreNoConflict(t *testing.T) {
	routes := append(machine(),
		// What "cluster up --node" adds: the link's /30, the node's pods through it, the local
		// range of the tests' client addresses.
		Route{Dst: "10.244.254.0/30", Dev: NodeLink},
		Route{Dst: "10.244.0.0/24", Gateway: "10.244.254.2", Dev: NodeLink},
		Route{Type: "local", Dst: "10.244.128.0/18", Dev: "lo", Table: "local"},
		Route{Type: "local", Dst: "10.244.254.1", Dev: NodeLink, Table: "local"},
	)
	c := Conflicts(routes)
	// The address on the link is the node's own (in the local table, on NodeLink): no conflict.
	if len(c) != 0 {
		t.Errorf("conflicts %v", c)
	}
}
