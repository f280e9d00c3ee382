//go:build tools

// Package actionlint pins actionlint, the linter of GitHub Actions workflows, built from its Go
// module, that `make workflow-lint` (part of `make lint`) runs over .github/workflows: the
// release workflow cannot run here (it pushes to a public registry), so its syntax, expressions,
// action inputs and shell steps are checked instead. Nothing here is our code: the module exists
// so that go.mod/go.sum fix the exact version.
package actionlint

import (
	_ "github.com/rhysd/actionlint/cmd/actionlint"
)
