//go:build tools

// Package tools pins the Gateway API Inference Extension's reference endpoint picker (EPP)
// for the picker test (tests/cluster/gie/build.sh builds
// sigs.k8s.io/gateway-api-inference-extension/cmd/epp from this module). v1.3.0 is the
// last release whose module still holds the metric-driven picker (queue, running
// requests, KV-cache use, prefix affinity); later ones moved it to llm-d-router, which
// the Go module proxy here does not serve.
package tools

import (
	_ "sigs.k8s.io/gateway-api-inference-extension/cmd/epp"
)
