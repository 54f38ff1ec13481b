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

{{/* True when engine pods prove their pod with a projected ServiceAccount token (roles mode,
auth.engineIdentity serviceAccountToken) instead of holding a pool token. */}}
{{- define "pdgate.auth.perPod" -}}
{{- if and (include "pdgate.auth.roles" .) (eq .Values.auth.engineIdentity "serviceAccountToken") -}}true{{- end -}}
{{- end -}}

{{/* The parts that hold a token of their own in roles mode (Secret keys <part>-token): the
engine pools only with auth.engineIdentity poolToken. */}}
{{- define "pdgate.auth.parts" -}}
{{- if include "pdgate.auth.perPod" . -}}proxy{{- else -}}proxy prefill decode{{- end -}}
{{- end -}}

{{/* The projected ServiceAccount token engines present to the metaserver (auth.perPod). */}}
{{- define "pdgate.auth.podTokenDir" -}}/var/run/secrets/pdgate/metaserver-token{{- end -}}
{{- define "pdgate.auth.podTokenAudience" -}}pdgate-metaserver{{- end -}}

{{/* ServiceAccounts: one per engine pool and one for the metaserver with per-pod identity
(call with (dict "root" $ "part" "metaserver"|"prefill"|"decode")), else the release's. */}}
{{- define "pdgate.partServiceAccountName" -}}
{{- if include "pdgate.auth.perPod" .root -}}
{{- printf "%s-%s" (include "pdgate.fullname" .root) .part -}}
{{- else -}}
{{- include "pdgate.serviceAccountName" .root -}}
{{- end -}}
{{- end -}}

{{/*
An env entry reading a part's metaserver credential from the Secret; call with
(dict "root" $ "name" "ENV" "part" "metaserver"|"proxy"|"prefill"|"decode"). In roles mode the
proxy and each engine pool get their own (key <part>-token); the single token ("token", or
existingSecretKey) is then the admin credential, which only the metaserver holds. Engines with
per-pod identity get none: they present their projected ServiceAccount token.
*/}}
{{- define "pdgate.token.env" -}}
{{- if and .root.Values.auth.enabled (not (and (include "pdgate.auth.perPod" .root) (has .part (list "prefill" "decode")))) -}}
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
{{- if or (and .Values.auth.enabled (not .Values.auth.existingSecret)) (and .Values.redis.enabled .Values.redis.auth.enabled) (eq (include "pdgate.sideChannel.key" .) "generated") (and .Values.engine.apiKey.enabled (not .Values.engine.apiKey.existingSecret)) -}}true{{- end -}}
{{- end -}}

{{/* An env entry with the engines' API key (engine.apiKey), or nothing; call with
(dict "root" $ "name" "VLLM_API_KEY"|"PD_PROXY_ENGINE_API_KEY"). */}}
{{- define "pdgate.engineApiKey.env" -}}
{{- $k := .root.Values.engine.apiKey -}}
{{- if $k.enabled -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ default (include "pdgate.secret.name" .root) $k.existingSecret }}
      key: {{ ternary $k.existingSecretKey "engine-api-key" (ne $k.existingSecret "") }}
{{- end -}}
{{- end -}}

{{/* Where the engines' side-channel key comes from: "generated" (key side-channel-key of the
release Secret), "existing" (connector.sideChannelSecret.existingSecret), or "" when there is
none: vllm-ascend's own connector, or connector.insecureSideChannel. */}}
{{- define "pdgate.sideChannel.key" -}}
{{- $c := .Values.connector -}}
{{- if and (ne $c.kind "vllm-ascend") (not $c.insecureSideChannel) -}}
{{- ternary "existing" "generated" (ne $c.sideChannelSecret.existingSecret "") -}}
{{- end -}}
{{- end -}}

{{/* The Secret and key holding the side channel's key file (pdgate.sideChannel.key not ""). */}}
{{- define "pdgate.sideChannel.secret" -}}
{{- $s := .Values.connector.sideChannelSecret -}}
{{- if eq (include "pdgate.sideChannel.key" .) "existing" -}}
{{- toJson (dict "name" $s.existingSecret "key" $s.existingSecretKey) -}}
{{- else -}}
{{- toJson (dict "name" (include "pdgate.secret.name" .) "key" "side-channel-key") -}}
{{- end -}}
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
{{- if and .Values.connector.insecureSideChannel .Values.connector.sideChannelSecret.existingSecret -}}
{{- fail "connector.insecureSideChannel and connector.sideChannelSecret.existingSecret contradict each other: leave insecureSideChannel false to seal the side channel with that Secret" -}}
{{- end -}}
{{- if not (hasKey .Values.presets .Values.accelerator) -}}
{{- fail (printf "accelerator %q has no entry in presets" .Values.accelerator) -}}
{{- end -}}
{{- include "pdgate.validate.kvRouting" . -}}
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

{{/* KV-event routing (kvRouting): the combinations that cannot work. */}}
{{- define "pdgate.validate.kvRouting" -}}
{{- $kv := .Values.kvRouting -}}
{{- $p := .Values.proxy -}}
{{- if not $kv.enabled -}}
{{- if has "kv" (list $p.prefillPolicy $p.decodePolicy) -}}
{{- fail "the proxy's kv policy needs the engines' KV events and a tokenizer: set kvRouting.enabled=true (and kvRouting.prefillPolicy / decodePolicy) instead of proxy.prefillPolicy / decodePolicy kv" -}}
{{- end -}}
{{- else -}}
{{- if or (ne .Values.connector.kind "pdgate") (ne .Values.connector.name "PdgateConnector") -}}
{{- fail (printf "kvRouting needs pdgate's connector (connector.kind pdgate, connector.name PdgateConnector), which registers each engine's KV-event port with the metaserver; connector.kind %s / connector.name %s does not" .Values.connector.kind .Values.connector.name) -}}
{{- end -}}
{{- if not (has "kv" (list $kv.prefillPolicy $kv.decodePolicy)) -}}
{{- fail "kvRouting.enabled without the kv policy for prefill or decode (kvRouting.prefillPolicy / decodePolicy) routes on nothing it provides" -}}
{{- end -}}
{{- range $side := list "prefill" "decode" -}}
{{- $mine := index $p (printf "%sPolicy" $side) -}}
{{- $theirs := index $kv (printf "%sPolicy" $side) -}}
{{- if and $mine (ne $mine $theirs) -}}
{{- fail (printf "proxy.%sPolicy %q conflicts with kvRouting.%sPolicy %q: with kvRouting.enabled the proxy's policies come from kvRouting; leave proxy.%sPolicy empty" $side $mine $side $theirs $side) -}}
{{- end -}}
{{- end -}}
{{- $preset := index .Values.presets .Values.accelerator -}}
{{- if has "--no-enable-prefix-caching" (concat ($preset.extraArgs | default list) .Values.engine.extraArgs .Values.prefill.extraArgs .Values.decode.extraArgs) -}}
{{- fail "kvRouting needs vLLM's prefix caching (KV events describe its cache): remove --no-enable-prefix-caching from the engines' extraArgs" -}}
{{- end -}}
{{- $events := int $kv.eventsPort -}}
{{- $side := int .Values.connector.sideChannelPort -}}
{{- $tp := max (int .Values.prefill.tensorParallelSize) (int .Values.decode.tensorParallelSize) -}}
{{- range $port := list $events (add $events 1) -}}
{{- if or (eq $port (int $.Values.engine.port)) (and (ge $port $side) (lt $port (add $side $tp))) -}}
{{- fail (printf "kvRouting.eventsPort %d (replay %d) overlaps engine.port %d or the side-channel ports %d-%d" $events (add $events 1) (int $.Values.engine.port) $side (add $side $tp -1)) -}}
{{- end -}}
{{- end -}}
{{- $tok := $kv.tokenizer -}}
{{- if eq $tok.source "modelCache" -}}
{{- if not (has .Values.model.cache.type (list "existingClaim" "hostPath")) -}}
{{- fail (printf "kvRouting.tokenizer.source modelCache mounts the engines' model cache into the proxy pods, which needs a shared one (model.cache.type existingClaim or hostPath), not %s: use that, or kvRouting.tokenizer.source volume with kvRouting.tokenizer.volume" .Values.model.cache.type) -}}
{{- end -}}
{{- else if not $tok.volume -}}
{{- fail "kvRouting.tokenizer.source volume needs kvRouting.tokenizer.volume (a volume source holding the tokenizer files)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" when the proxy runs with --share-load (proxy.shareLoad, "auto": with kvRouting and
more than one proxy process). */}}
{{- define "pdgate.proxy.shareLoad" -}}
{{- $p := .Values.proxy -}}
{{- if kindIs "bool" $p.shareLoad -}}
{{- if $p.shareLoad -}}true{{- end -}}
{{- else if and .Values.kvRouting.enabled (or (gt (int $p.replicas) 1) $p.autoscaling.enabled (gt (int $p.workers) 1)) -}}true
{{- end -}}
{{- end -}}

{{/* What the proxy's --tokenizer names (kvRouting.tokenizer). */}}
{{- define "pdgate.proxy.tokenizer" -}}
{{- $tok := .Values.kvRouting.tokenizer -}}
{{- $tok.path | default (ternary .Values.model.name $tok.mountPath (eq $tok.source "modelCache")) -}}
{{- end -}}
