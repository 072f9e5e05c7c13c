//go:build tools

// Package tools pins kwok's command for the test cluster build
// (tests/cluster/cluster.sh builds sigs.k8s.io/kwok/cmd/kwok from this module).
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
