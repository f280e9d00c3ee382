//go:build tools

// Package prometheus pins the real Prometheus server, built from its Go module with Kubernetes
// service discovery compiled in (Debian's 2.42 package lacks it), and promtool from the same
// module (the rules in manifests/monitoring are checked and unit-tested with it). Nothing here is
// our code: the module exists so that go.mod/go.sum fix the exact version that `make prometheus`
// and `make promtool` build.
package prometheus

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
