{{/* The labels of every object: the kustomize install's, plus Helm's own. */}}
{{- define "tpo.labels" -}}
app.kubernetes.io/name: traffic-policy-operator
app.kubernetes.io/part-of: traffic-policy-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}
