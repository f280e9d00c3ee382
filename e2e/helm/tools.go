//go:build tools

// Package helm pins the real Helm v3 client, built from its Go module, that lints the chart in
// charts/poolpilot, renders it for the server-side dry run and installs it on the embedded
// cluster in the e2e tests. Nothing here is our code: the module exists so that go.mod/go.sum fix
// the exact version that `make helm` builds.
package helm

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
