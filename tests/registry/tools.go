//go:build tools

// Package tools pins the CNCF distribution registry for the image tests
// (tests/registry/registry.sh builds github.com/distribution/distribution/v3/cmd/registry
// from this module).
package tools

import (
	_ "github.com/distribution/distribution/v3/cmd/registry"
)
