{{/* Chart name. */}}
{{- define "dspark-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name (at most 63 - len("-metrics") characters). */}}
{{- define "dspark-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dspark-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels (immutable on the Deployment). */}}
{{- define "dspark-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dspark-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Common labels. */}}
{{- define "dspark-operator.labels" -}}
helm.sh/chart: {{ include "dspark-operator.chart" . }}
{{ include "dspark-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dspark
{{- end }}

{{- define "dspark-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dspark-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dspark-operator.leaseName" -}}
{{- default (printf "%s-leader" (include "dspark-operator.fullname" .)) .Values.leaderElection.leaseName }}
{{- end }}

{{- define "dspark-operator.image" -}}
{{- $repo := .Values.image.repository -}}
{{- with .Values.image.registry }}{{ $repo = printf "%s/%s" . $repo }}{{ end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest }}
{{- else -}}
{{- printf "%s:%s" $repo (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* An engine image: (list $ REPOSITORY) -> [REGISTRY/]REPOSITORY:TAG. */}}
{{- define "dspark-operator.engineImage" -}}
{{- $root := index . 0 -}}
{{- $repo := index . 1 -}}
{{- $v := $root.Values.engineImages -}}
{{- with (default $root.Values.image.registry $v.registry) }}{{ $repo = printf "%s/%s" . $repo }}{{ end -}}
{{- printf "%s:%s" $repo (default $root.Chart.AppVersion $v.tag) }}
{{- end }}
