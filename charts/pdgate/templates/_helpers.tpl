{{/* Names ------------------------------------------------------------------------------ */}}

{{- define "pdgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource-name prefix; component suffixes ("-metaserver", "-prefill") keep it under 63. */}}
{{- define "pdgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels: call with (dict "root" $ "component" "proxy") ------------------------------ */}}

{{- define "pdgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdgate.labels" -}}
{{ include "pdgate.selectorLabels" . }}
helm.sh/chart: {{ include "pdgate.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdgate
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Component names -------------------------------------------------------------------- */}}

{{- define "pdgate.proxy.name" -}}{{ include "pdgate.fullname" . }}-proxy{{- end -}}
{{- define "pdgate.metaserver.name" -}}{{ include "pdgate.fullname" . }}-metaserver{{- end -}}
{{- define "pdgate.redis.name" -}}{{ include "pdgate.fullname" . }}-redis{{- end -}}
{{- define "pdgate.secret.name" -}}{{ include "pdgate.fullname" . }}-auth{{- end -}}

{{- define "pdgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Images ----------------------------------------------------------------------------- */}}

{{- define "pdgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Metaserver wiring ------------------------------------------------------------------ */}}

{{/* The URL the proxy and the engines use: the metaserver Service, in-namespace name. */}}
{{- define "pdgate.metaserver.url" -}}
{{- printf "http://%s:%d" (include "pdgate.metaserver.name" .) (int .Values.metaserver.port) -}}
{{- end -}}

{{/* Secret and key holding the metaserver token. */}}
{{- define "pdgate.token.secretName" -}}
{{- default (include "pdgate.secret.name" .) .Values.auth.existingSecret -}}
{{- end -}}
{{- define "pdgate.token.secretKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* True when the metaserver runs in roles mode (each part its own credential). */}}
{{- define "pdgate.auth.roles" -}}
{{- if and .Values.auth.enabled (eq .Values.auth.mode "roles") -}}true{{- end -}}
{{- end -}}

{{/* The parts that hold a credential of their own in roles mode (Secret keys <part>-token). */}}
{{- define "pdgate.auth.parts" -}}proxy prefill decode{{- end -}}

{{/*
An env entry reading a part's metaserver credential from the Secret; call with
(dict "root" $ "name" "ENV" "part" "metaserver"|"proxy"|"prefill"|"decode"). In roles mode the
proxy and each engine pool get their own (key <part>-token); the single token ("token", or
existingSecretKey) is then the admin credential, which only the metaserver holds.
*/}}
{{- define "pdgate.token.env" -}}
{{- if .root.Values.auth.enabled -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "pdgate.token.secretName" .root }}
      {{- if and (include "pdgate.auth.roles" .root) (ne .part "metaserver") }}
      key: {{ .part }}-token
      {{- else }}
      key: {{ include "pdgate.token.secretKey" .root }}
      {{- end }}
{{- end -}}
{{- end -}}

{{/* "redis", "external-url", "external-secret" or "memory". */}}
{{- define "pdgate.store.kind" -}}
{{- if .Values.redis.enabled -}}redis
{{- else if .Values.redis.external.existingSecret -}}external-secret
{{- else if .Values.redis.external.url -}}external-url
{{- else -}}memory
{{- end -}}
{{- end -}}

{{/* Does the chart's own Secret need to exist? */}}
{{- define "pdgate.secret.needed" -}}
{{- if or (and .Values.auth.enabled (not .Values.auth.existingSecret)) (and .Values.redis.enabled .Values.redis.auth.enabled) -}}true{{- end -}}
{{- end -}}

{{/* Reject value combinations the schema cannot express. */}}
{{- define "pdgate.validate" -}}
{{- $store := include "pdgate.store.kind" . -}}
{{- if and .Values.redis.enabled (or .Values.redis.external.url .Values.redis.external.existingSecret) -}}
{{- fail "redis.enabled and redis.external are exclusive: set redis.enabled=false to use an external Redis" -}}
{{- end -}}
{{- if and .Values.redis.external.url .Values.redis.external.existingSecret -}}
{{- fail "set only one of redis.external.url and redis.external.existingSecret" -}}
{{- end -}}
{{- if and (eq $store "memory") (gt (int .Values.metaserver.replicas) 1) -}}
{{- fail "metaserver.replicas > 1 needs shared state: enable redis.enabled or set redis.external" -}}
{{- end -}}
{{- if and .Values.proxy.autoscaling.enabled (gt (int .Values.proxy.autoscaling.minReplicas) (int .Values.proxy.autoscaling.maxReplicas)) -}}
{{- fail "proxy.autoscaling.minReplicas must not exceed maxReplicas" -}}
{{- end -}}
{{- if and .Values.engine.drain.enabled (lt (int .Values.engine.terminationGracePeriodSeconds) (add (int .Values.engine.drain.timeoutS) 30)) -}}
{{- fail (printf "engine.terminationGracePeriodSeconds (%d) must be at least engine.drain.timeoutS + 30 (%d): the preStop drain runs inside the grace period, and vLLM needs time to stop after it" (int .Values.engine.terminationGracePeriodSeconds) (add (int .Values.engine.drain.timeoutS) 30)) -}}
{{- end -}}
{{- if not (hasKey .Values.presets .Values.accelerator) -}}
{{- fail (printf "accelerator %q has no entry in presets" .Values.accelerator) -}}
{{- end -}}
{{- if ne .Values.connector.kind "vllm-ascend" -}}
{{- $p := int .Values.prefill.tensorParallelSize -}}
{{- $d := int .Values.decode.tensorParallelSize -}}
{{- if or (mod (max $p $d) (min $p $d)) -}}
{{- fail (printf "prefill.tensorParallelSize %d and decode.tensorParallelSize %d cannot disaggregate: one must divide the other for prefill's KV heads to map onto decode's ranks" $p $d) -}}
{{- end -}}
{{- $heads := int .Values.model.kvHeads -}}
{{- if $heads -}}
{{- range $side, $tp := dict "prefill" $p "decode" $d -}}
{{- if or (and (le $tp $heads) (mod $heads $tp)) (and (gt $tp $heads) (mod $tp $heads)) -}}
{{- fail (printf "%s.tensorParallelSize %d cannot split model.kvHeads %d (each rank must hold whole KV heads, or the heads whole multiples of ranks)" $side $tp $heads) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The revision every engine registers (connector key "revision"): P and D of different
revisions are never paired. model.revision, else the model and the image tag. */}}
{{- define "pdgate.revision" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- default (printf "%s@%s" .Values.model.name $tag) .Values.model.revision | trunc 128 -}}
{{- end -}}
