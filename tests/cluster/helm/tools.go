//go:build tools

// Package tools pins helm's command for the test cluster build
// (tests/cluster/cluster.sh builds helm.sh/helm/v3/cmd/helm from this module).
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
