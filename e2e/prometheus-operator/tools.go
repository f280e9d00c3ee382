//go:build tools

// Package prometheusoperator pins the real prometheus-operator, from its Go module: the e2e tests
// apply its CRDs (example/prometheus-operator-crd in the module, the CRDs of its release) to the
// embedded cluster and server-side apply the chart's PodMonitor and PrometheusRule against them,
// so that what charts/poolpilot renders for kube-prometheus-stack is what that operator accepts;
// and they run the operator itself (cmd/operator) with its config reloader
// (cmd/prometheus-config-reloader), so that a Prometheus configured by it alone scrapes what the
// chart's PodMonitor selects. Nothing here is our code: the module exists so that go.mod/go.sum
// fix the exact version that `make cluster` extracts the CRDs of and builds.
package prometheusoperator

import (
	_ "github.com/prometheus-operator/prometheus-operator/cmd/operator"
	_ "github.com/prometheus-operator/prometheus-operator/cmd/prometheus-config-reloader"
)
