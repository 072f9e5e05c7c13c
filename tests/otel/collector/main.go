// Command otelcol is the DSpark test build of the OpenTelemetry Collector: the upstream
// collector core (go.opentelemetry.io/collector/otelcol) with the handful of components the
// project uses (see components.go). Built and started by tests/otel/otelcol.sh.
package main

import (
	"fmt"
	"os"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/otelcol"
)

// version is the collector release the wrapper pins (go.mod); set with -ldflags -X.
var version = "v0.165.0"

func main() {
	info := component.BuildInfo{
		Command:     "otelcol",
		Description: "OpenTelemetry Collector (DSpark test build: otlp receiver, batch processor, debug exporter)",
		Version:     version,
	}
	settings := otelcol.CollectorSettings{
		BuildInfo: info,
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				// --config file:PATH (or a bare path) and ${env:VAR} substitutions.
				DefaultScheme: "env",
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(),
					fileprovider.NewFactory(),
				},
			},
		},
		ProviderModules: map[string]string{
			envprovider.NewFactory().Create(confmap.ProviderSettings{}).Scheme():  "go.opentelemetry.io/collector/confmap/provider/envprovider v1.71.0",
			fileprovider.NewFactory().Create(confmap.ProviderSettings{}).Scheme(): "go.opentelemetry.io/collector/confmap/provider/fileprovider v1.71.0",
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		fmt.Fprintf(os.Stderr, "otelcol: %v\n", err)
		os.Exit(1)
	}
}
