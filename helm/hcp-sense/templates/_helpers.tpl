{{/*
Names, labels and the few derived values every template shares.
*/}}

{{/* The ports the binary listens on (config.toml sets them; the Service maps its own ports onto these). */}}
{{- define "hcp-sense.grpcPort" -}}50051{{- end }}
{{- define "hcp-sense.metricsPort" -}}9464{{- end }}
{{- define "hcp-sense.ingressPort" -}}8080{{- end }}
{{- define "hcp-sense.mcpPort" -}}8090{{- end }}
{{- define "hcp-sense.httpPort" -}}8091{{- end }}

{{/* Where files are mounted in the container. */}}
{{- define "hcp-sense.configDir" -}}/etc/hcp-sense/config{{- end }}
{{- define "hcp-sense.authDir" -}}/etc/hcp-sense/auth{{- end }}
{{- define "hcp-sense.tlsDir" -}}/etc/hcp-sense/tls{{- end }}
{{- define "hcp-sense.clientCaDir" -}}/etc/hcp-sense/tls-client-ca{{- end }}

{{- define "hcp-sense.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fully qualified app name, at most 63 characters (a DNS label). A release name that already
contains the chart name is used as it is.
*/}}
{{- define "hcp-sense.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A name derived from the fullname with a suffix, still at most 63 characters. */}}
{{- define "hcp-sense.suffixed" -}}
{{- $full := include "hcp-sense.fullname" .root }}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .suffix)))) .suffix | trimSuffix "-" }}
{{- end }}

{{- define "hcp-sense.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "hcp-sense.commonLabels" -}}
helm.sh/chart: {{ include "hcp-sense.chart" . }}
app.kubernetes.io/name: {{ include "hcp-sense.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hcp
{{- end }}

{{/* Labels of the server's objects (Deployment, Service, ...). */}}
{{- define "hcp-sense.labels" -}}
{{ include "hcp-sense.commonLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{/*
Selector of the server's pods. The component label keeps the migration Job's pods out of the
Service, the PodDisruptionBudget and the spreading rules.
*/}}
{{- define "hcp-sense.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hcp-sense.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* Labels of the migration Job and its pods. */}}
{{- define "hcp-sense.migrateLabels" -}}
{{ include "hcp-sense.commonLabels" . }}
app.kubernetes.io/component: migrate
{{- end }}

{{- define "hcp-sense.migrateSelectorLabels" -}}
app.kubernetes.io/name: {{ include "hcp-sense.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: migrate
{{- end }}

{{- define "hcp-sense.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hcp-sense.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The migration Job runs before the chart's own ServiceAccount exists (pre-install hook), so it
uses migrations.serviceAccountName, or an existing account named in serviceAccount.name, or the
namespace's default account; its token is never mounted.
*/}}
{{- define "hcp-sense.migrateServiceAccountName" -}}
{{- if .Values.migrations.serviceAccountName }}
{{- .Values.migrations.serviceAccountName }}
{{- else if and (not .Values.serviceAccount.create) .Values.serviceAccount.name }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hcp-sense.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The Secret holding the database URL: the chart's own when database.url is set. */}}
{{- define "hcp-sense.databaseSecretName" -}}
{{- if .Values.database.url }}
{{- include "hcp-sense.suffixed" (dict "root" . "suffix" "database") }}
{{- else }}
{{- .Values.database.existingSecret }}
{{- end }}
{{- end }}

{{/* The Secret holding the page-token key: the chart's own when pageToken.value is set. */}}
{{- define "hcp-sense.pageTokenSecretName" -}}
{{- if .Values.pageToken.value }}
{{- include "hcp-sense.suffixed" (dict "root" . "suffix" "page-token") }}
{{- else }}
{{- .Values.pageToken.existingSecret }}
{{- end }}
{{- end }}

{{/* The Secret holding the NATS URL: the chart's own when nats.url is set; empty without NATS. */}}
{{- define "hcp-sense.natsSecretName" -}}
{{- if .Values.nats.url }}
{{- include "hcp-sense.suffixed" (dict "root" . "suffix" "nats") }}
{{- else }}
{{- .Values.nats.existingSecret }}
{{- end }}
{{- end }}

{{/* Seconds from the pod's deletion to SIGKILL: preStop sleep + the server's grace + a margin for the final flush. */}}
{{- define "hcp-sense.terminationGracePeriodSeconds" -}}
{{- add (int .Values.preStopSleepSecs) (int .Values.config.shutdownGraceSecs) (int .Values.terminationGraceMarginSecs) }}
{{- end }}

{{/*
Checks that values.schema.json cannot express; included by every template that depends on them,
so `helm install`, `helm upgrade` and `helm template` all stop with the same message.
*/}}
{{- define "hcp-sense.validate" -}}
{{- if and (not .Values.auth.existingSecret) (not .Values.insecureNoAuth) }}
{{- fail "hcp-sense: no authentication configured. Set auth.existingSecret to a Secret holding auth.toml (the [auth] table: tokens and/or JWT settings; see the chart README), or set insecureNoAuth=true to serve every RPC to every caller that can reach the pods." }}
{{- end }}
{{- if and (not .Values.database.url) (not .Values.database.existingSecret) }}
{{- fail "hcp-sense: no database configured. Set database.existingSecret to a Secret holding the PostgreSQL URL under database.secretKey, or set database.url to have the chart create that Secret." }}
{{- end }}
{{- if and (not .Values.pageToken.value) (not .Values.pageToken.existingSecret) }}
{{- fail "hcp-sense: no page-token key configured. Set pageToken.existingSecret to a Secret holding the key under pageToken.secretKey, or set pageToken.value; every replica must sign page tokens with the same key." }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "hcp-sense: tls.enabled needs tls.secretName (a kubernetes.io/tls Secret with tls.crt and tls.key)." }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail "hcp-sense: autoscaling.minReplicas must not exceed autoscaling.maxReplicas." }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not (dig "requests" "cpu" "" (.Values.resources | default dict))) }}
{{- fail "hcp-sense: autoscaling.enabled needs resources.requests.cpu: CPU utilisation is measured against the request." }}
{{- end }}
{{- $il := .Values.ingressListener }}
{{- if and $il.service.enabled (not $il.enabled) }}
{{- fail "hcp-sense: ingressListener.service.enabled needs ingressListener.enabled (the Service would point at a port no container opens)." }}
{{- end }}
{{- if and $il.enabled $il.service.enabled (eq $il.service.externalTrafficPolicy "Local") (eq $il.service.type "ClusterIP") }}
{{- fail "hcp-sense: ingressListener.service.externalTrafficPolicy Local needs ingressListener.service.type NodePort or LoadBalancer." }}
{{- end }}
{{- if and $il.enabled $il.service.enabled $il.service.loadBalancerSourceRanges (ne $il.service.type "LoadBalancer") }}
{{- fail "hcp-sense: ingressListener.service.loadBalancerSourceRanges needs ingressListener.service.type LoadBalancer." }}
{{- end }}
{{- if and .Values.http.console (not .Values.http.enabled) }}
{{- fail "hcp-sense: http.console needs http.enabled (the console is served on the JSON door's port, --console requires --http-listen)." }}
{{- end }}
{{- $pdb := .Values.podDisruptionBudget }}
{{- if and $pdb.enabled (hasKey $pdb "minAvailable") (kindIs "float64" $pdb.minAvailable) }}
{{- $replicas := ternary .Values.autoscaling.minReplicas .Values.replicaCount .Values.autoscaling.enabled | int }}
{{- if ge (int $pdb.minAvailable) $replicas }}
{{- fail (printf "hcp-sense: podDisruptionBudget.minAvailable (%d) must be below the replica count (%d), or no node could ever be drained." (int $pdb.minAvailable) $replicas) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A TOML float: always with a decimal point. */}}
{{- define "hcp-sense.tomlFloat" -}}
{{- $f := float64 . }}
{{- if eq $f (floor $f) }}{{ printf "%.1f" $f }}{{ else }}{{ $f }}{{ end }}
{{- end }}

{{/* Egress every hcp-sense pod needs under networkPolicy: DNS and PostgreSQL. */}}
{{- define "hcp-sense.egressBase" -}}
{{- $np := .Values.networkPolicy -}}
# DNS.
- ports:
    - port: {{ int $np.dns.port }}
      protocol: UDP
    - port: {{ int $np.dns.port }}
      protocol: TCP
  {{- with $np.dns.to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
# PostgreSQL.
- ports:
    - port: {{ int $np.postgres.port }}
      protocol: TCP
  {{- with $np.postgres.to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
