{{/*
Names, as `helm create` makes them: the release name, prefixed to the chart's name unless it already holds
it (release "gpunode-device-plugin" -> gpunode-device-plugin; release "lab" -> lab-gpunode-device-plugin),
so two releases never share an object's name. 63 characters at most: a DaemonSet's name goes into its
pods' names and labels.
*/}}
{{- define "gpunode.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpunode.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "gpunode.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The ClusterRole and its binding are cluster-wide: the same release name in two namespaces would share
them, so their name carries the namespace too (253 characters is a cluster-scoped name's limit). */}}
{{- define "gpunode.clusterName" -}}
{{- printf "%s-%s" (include "gpunode.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" }}
{{- end }}

{{/* The DaemonSet's selector: fixed for a release's life (Kubernetes refuses a changed selector), so
nothing here may change on upgrade (no version, no chart label). */}}
{{- define "gpunode.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpunode.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The labels every object carries: `gpunode plugin manifest`'s, plus Helm's standard ones. */}}
{{- define "gpunode.labels" -}}
{{ include "gpunode.selectorLabels" . }}
app.kubernetes.io/part-of: gpunode
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
One TOML value. Not sprig's toToml: Helm reads every number of a values file as a float, and toToml writes
replicas 4 as 4.0, which the plugin refuses (a count is a whole number). Whole floats are written as
integers here; strings as JSON strings, which TOML reads the same (basic strings, \uXXXX escapes).
*/}}
{{- define "gpunode.tomlValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq (floor .) . }}{{ int64 . }}{{ else }}{{ . }}{{ end -}}
{{- else if kindIs "string" . -}}
{{- toJson . -}}
{{- else if kindIs "slice" . -}}
[{{ range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "gpunode.tomlValue" $v }}{{ end }}]
{{- else if kindIs "map" . -}}
{{ "{" }}{{ $first := true }}{{ range $k, $v := . }}{{ if not $first }}, {{ end }}{{ $first = false }}{{ $k }} = {{ include "gpunode.tomlValue" $v }}{{ end }}{{ "}" }}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end }}

{{/* "true" when the plugin reports Events and the GPUHealthy condition: events.enabled, or the config's
own events.enabled (as `gpunode plugin manifest` decides). */}}
{{- define "gpunode.events" -}}
{{- $fromConfig := false }}
{{- with .Values.config.events }}{{ $fromConfig = .enabled }}{{ end }}
{{- if or .Values.events.enabled $fromConfig }}true{{ else }}false{{ end }}
{{- end }}

{{/* The ConfigMap's plugin.toml: .Values.config's keys, its maps as [tables]. Its digest, on the pod
template, rolls the pods when it changes. */}}
{{- define "gpunode.configToml" -}}
# gpunode device plugin config (gpunode plugin run --config)
{{- range $key, $value := .Values.config }}
{{- if not (kindIs "map" $value) }}
{{ $key }} = {{ include "gpunode.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $table, $values := .Values.config }}
{{- if kindIs "map" $values }}
[{{ $table }}]
{{- range $key, $value := $values }}
{{ $key }} = {{ include "gpunode.tomlValue" $value }}
{{- end }}
{{- end }}
{{- end }}
{{ end }}

{{/* The pod template's labels: the chart's own, then podLabels. A podLabels key the chart sets itself is
refused rather than dropped or doubled: the selector labels must stay what the DaemonSet selects. */}}
{{- define "gpunode.component" -}}
{{ if .Values.dra.enabled }}dra-driver{{ else }}device-plugin{{ end }}
{{- end }}

{{- define "gpunode.podLabels" -}}
{{- $own := include "gpunode.labels" . | fromYaml }}
{{- $_ := set $own "app.kubernetes.io/component" (include "gpunode.component" .) }}
{{- range $key, $value := .Values.podLabels }}
{{- if hasKey $own $key }}
{{- fail (printf "podLabels: %q is a label the chart sets itself (the DaemonSet's selector and Helm's standard labels); remove it from podLabels, or use nameOverride / fullnameOverride to change the names" $key) }}
{{- end }}
{{- end }}
{{- include "gpunode.labels" . }}
app.kubernetes.io/component: {{ include "gpunode.component" . }}
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}
