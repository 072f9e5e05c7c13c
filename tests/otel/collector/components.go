package main

import (
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/debugexporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/processor/batchprocessor"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

// componentRelease is the release of the component modules in go.mod.
const componentRelease = "v0.165.0"

// module is a component's factory and the path of the module it comes from.
type module[F component.Factory] struct {
	factory F
	path    string
}

// factoryMaps returns the factories of ms by component type, and by the same key the module
// (path and release) each comes from.
func factoryMaps[F component.Factory](ms ...module[F]) (map[component.Type]F, map[component.Type]string, error) {
	factories := make([]F, len(ms))
	modules := make(map[component.Type]string, len(ms))
	for i, m := range ms {
		factories[i] = m.factory
		modules[m.factory.Type()] = m.path + " " + componentRelease
	}
	byType, err := otelcol.MakeFactoryMap(factories...)
	return byType, modules, err
}

// components lists the factories compiled into this collector. Adding one means adding its
// module to go.mod at the same collector release (v0.165.0 / v1.71.0).
func components() (otelcol.Factories, error) {
	var err error
	f := otelcol.Factories{Telemetry: otelconftelemetry.NewFactory()}
	if f.Receivers, f.ReceiverModules, err = factoryMaps(module[receiver.Factory]{otlpreceiver.NewFactory(), "go.opentelemetry.io/collector/receiver/otlpreceiver"}); err != nil {
		return otelcol.Factories{}, err
	}
	if f.Processors, f.ProcessorModules, err = factoryMaps(module[processor.Factory]{batchprocessor.NewFactory(), "go.opentelemetry.io/collector/processor/batchprocessor"}); err != nil {
		return otelcol.Factories{}, err
	}
	if f.Exporters, f.ExporterModules, err = factoryMaps(module[exporter.Factory]{debugexporter.NewFactory(), "go.opentelemetry.io/collector/exporter/debugexporter"}); err != nil {
		return otelcol.Factories{}, err
	}
	return f, nil
}
