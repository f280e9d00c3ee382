{{/* The prefix of every object name: "poolpilot" unless overridden. */}}
{{- define "poolpilot.fullname" -}}
{{- default "poolpilot" .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "poolpilot.labels" -}}
app.kubernetes.io/part-of: poolpilot
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* An image reference: <repository>/<name>:<tag or appVersion>. */}}
{{- define "poolpilot.image" -}}
{{- $root := index . 0 -}}
{{- printf "%s/%s:%s" $root.Values.image.repository (index . 1) (default $root.Chart.AppVersion $root.Values.image.tag) -}}
{{- end -}}

{{/* The listen host of a server: the pod IP or every address. */}}
{{- define "poolpilot.listenHost" -}}
{{- if . -}}$(POD_IP){{- else -}}0.0.0.0{{- end -}}
{{- end -}}

{{/* The restricted pod security context both Deployments use. */}}
{{- define "poolpilot.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "poolpilot.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The gateway's configuration file (as manifests/gateway/gateway.yaml). */}}
{{- define "poolpilot.gatewayConfig" -}}
listeners:
  proxy: 0.0.0.0:8080
  admin: 0.0.0.0:9901
adminTokenFile: /etc/poolpilot/admin/token
adminTls:
  certFile: /etc/poolpilot/admin-tls/tls.crt
  keyFile: /etc/poolpilot/admin-tls/tls.key
limitsFile: /etc/poolpilot/limits/limits.json
limitsPollInterval: 2s
shutdownDelay: {{ .Values.gateway.shutdownDelay }}
drainGrace: {{ .Values.gateway.drainGrace }}
awaitOperator: {{ .Values.gateway.awaitOperator }}
{{- end -}}
