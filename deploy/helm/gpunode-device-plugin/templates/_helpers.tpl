{{/* The labels every object carries, as `gpunode plugin manifest` writes them, plus Helm's own. */}}
{{- define "gpunode.labels" -}}
app.kubernetes.io/name: gpunode-device-plugin
app.kubernetes.io/part-of: gpunode
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
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
