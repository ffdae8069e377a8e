{{/* The release's name for the DaemonSet and its labels. */}}
{{- define "aether-cni.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "aether-cni.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "aether-cni.labels" -}}
{{ include "aether-cni.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
The installer's memory limit from serviceLayerMemory (values.yaml, docs/operating.md
"Memory"): (base + pods x Services x families x bytes per Service) x 10/9, in whole MiB
rounded up.
*/}}
{{- define "aether-cni.memoryLimit" -}}
{{- $m := .Values.serviceLayerMemory -}}
{{- $families := ternary 2 1 $m.dualStack -}}
{{- $layers := mul $m.podsPerNode $m.services $families $m.bytesPerService -}}
{{- $bytes := add (mul $m.baseMiB 1048576) $layers -}}
{{- $withHeadroom := div (add (mul $bytes 10) 8) 9 -}}
{{- printf "%dMi" (div (add $withHeadroom 1048575) 1048576) -}}
{{- end -}}

{{/* The container's resources: limits.memory computed when not given. */}}
{{- define "aether-cni.resources" -}}
{{- $r := deepCopy .Values.resources -}}
{{- $limits := $r.limits | default dict -}}
{{- if not $limits.memory -}}
{{- $_ := set $limits "memory" (include "aether-cni.memoryLimit" .) -}}
{{- end -}}
{{- $_ := set $r "limits" $limits -}}
{{- toYaml $r -}}
{{- end -}}
