//go:build tools

// Package prometheus pins the real Prometheus server, built from its Go module with Kubernetes
// service discovery compiled in (Debian's 2.42 package lacks it). Nothing here is our code: the
// module exists so that go.mod/go.sum fix the exact version that `make prometheus` builds.
package prometheus

import _ "github.com/prometheus/prometheus/cmd/prometheus"
