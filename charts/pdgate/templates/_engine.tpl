{{/*
One engine pool (vLLM + the pdgate connector): a headless Service the proxy resolves for
discovery, and a StatefulSet. Call with (dict "root" $ "role" "prefill"|"decode").
*/}}

{{/* The accelerator preset in force. */}}
{{- define "pdgate.engine.preset" -}}
{{- toJson (index .Values.presets .Values.accelerator) -}}
{{- end -}}

{{- define "pdgate.engine.image" -}}
{{- $preset := include "pdgate.engine.preset" . | fromJson -}}
{{- $repo := default $preset.image.repository .Values.engine.image.repository -}}
{{- $tag := .Values.engine.image.tag | default $preset.image.tag | default .Chart.AppVersion -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* The --kv-transfer-config object of one pool, as JSON. */}}
{{- define "pdgate.engine.kvTransferConfig" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- if eq $v.connector.kind "vllm-ascend" -}}
{{- /* vllm-ascend's layerwise config, as its multi-node tutorial writes it */ -}}
{{- $sizes := dict
  "prefill" (dict "dp_size" 1 "tp_size" (int $v.prefill.tensorParallelSize))
  "decode" (dict "dp_size" 1 "tp_size" (int $v.decode.tensorParallelSize))
-}}
{{- toJson (dict
  "kv_connector" "MooncakeLayerwiseConnector"
  "kv_role" (ternary "kv_producer" "kv_consumer" (eq .role "prefill"))
  "kv_port" (toString (int $v.connector.sideChannelPort))
  "kv_connector_extra_config" (mergeOverwrite $sizes (deepCopy $v.connector.extraConfig))
) -}}
{{- else -}}
{{- $preset := include "pdgate.engine.preset" $root | fromJson -}}
{{- $extra := dict
  "metaserver_url" (include "pdgate.metaserver.url" $root)
  "instance_id" "$(POD_NAME)"
  "http_url" (printf "http://$(POD_IP):%d" (int $v.engine.port))
  "side_channel_host" "$(POD_IP)"
  "side_channel_port" (int $v.connector.sideChannelPort)
  "transport" $v.connector.transport
  "mooncake_protocol" (default $preset.protocol $v.connector.protocol)
  "device_name" $v.connector.deviceName
  "device" $preset.device
  "kv_load_timeout_s" $v.connector.kvLoadTimeoutS
  "heartbeat_s" $v.connector.heartbeatS
  "concurrent" (and (eq .role "prefill") (eq $v.proxy.flow "concurrent"))
  "revision" (include "pdgate.revision" $root)
-}}
{{- if include "pdgate.sideChannel.key" $root }}
{{- $secret := include "pdgate.sideChannel.secret" $root | fromJson -}}
{{- $_ := set $extra "side_channel_secret_file" (printf "%s/%s" (include "pdgate.engine.sideChannelDir" $root) $secret.key) -}}
{{- else }}
{{- /* connector.insecureSideChannel: the connector refuses to start unsealed without it */ -}}
{{- $_ := set $extra "insecure_side_channel" true -}}
{{- end }}
{{- if include "pdgate.auth.perPod" $root }}
{{- $_ := set $extra "metaserver_token_file" (printf "%s/token" (include "pdgate.auth.podTokenDir" $root)) -}}
{{- end }}
{{- $extra = mergeOverwrite $extra (deepCopy $v.connector.extraConfig) -}}
{{- $cfg := dict
  "kv_connector" $v.connector.name
  "kv_role" (ternary "kv_producer" "kv_consumer" (eq .role "prefill"))
  "kv_load_failure_policy" $v.connector.kvLoadFailurePolicy
  "kv_connector_extra_config" $extra
-}}
{{- with $v.connector.modulePath }}
{{- $_ := set $cfg "kv_connector_module_path" . -}}
{{- end }}
{{- toJson $cfg -}}
{{- end -}}
{{- end -}}

{{/* vLLM's --kv-events-config (kvRouting): a publisher bound on every interface at eventsPort,
its replay socket one above (what the connector registers with the metaserver). */}}
{{- define "pdgate.engine.kvEventsConfig" -}}
{{- $port := int .Values.kvRouting.eventsPort -}}
{{- toJson (dict
  "enable_kv_cache_events" true
  "publisher" "zmq"
  "endpoint" (printf "tcp://*:%d" $port)
  "replay_endpoint" (printf "tcp://*:%d" (add $port 1))
  "topic" "kv"
) -}}
{{- end -}}

{{/* Where engine pods see the side channel's key file (connector.sideChannelSecret). */}}
{{- define "pdgate.engine.sideChannelDir" -}}/etc/pdgate/side-channel{{- end -}}

{{- define "pdgate.engine" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $role := .role -}}
{{- $pool := index $v $role -}}
{{- $preset := include "pdgate.engine.preset" $root | fromJson -}}
{{- $name := printf "%s-%s" (include "pdgate.fullname" $root) $role -}}
{{- $tp := int $pool.tensorParallelSize -}}
{{- $port := int $v.engine.port -}}
{{- $side := int $v.connector.sideChannelPort -}}
{{- $model := $v.model.name -}}
{{- $resources := deepCopy ($pool.resources | default dict) -}}
{{- $limits := get $resources "limits" | default dict -}}
{{- $requests := get $resources "requests" | default dict -}}
{{- with $preset.resourceName }}
{{- $_ := set $limits . $tp -}}
{{- $_ := set $requests . $tp -}}
{{- end }}
{{- if $v.engine.rdma.enabled }}
{{- $_ := set $limits $v.engine.rdma.resourceName (int $v.engine.rdma.count) -}}
{{- $_ := set $requests $v.engine.rdma.resourceName (int $v.engine.rdma.count) -}}
{{- end }}
{{- $_ := set $resources "limits" $limits -}}
{{- $_ := set $resources "requests" $requests -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdgate.labels" (dict "root" $root "component" $role) | nindent 4 }}
spec:
  # Headless: each ready engine pod is one DNS record, which is how the proxy finds the pool.
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "pdgate.selectorLabels" (dict "root" $root "component" $role) | nindent 4 }}
  ports:
    - name: http
      port: {{ $port }}
      targetPort: http
      protocol: TCP
    {{- range $r := until $tp }}
    - name: side-{{ $r }}
      port: {{ add $side $r }}
      targetPort: side-{{ $r }}
      protocol: TCP
    {{- end }}
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdgate.labels" (dict "root" $root "component" $role) | nindent 4 }}
spec:
  serviceName: {{ $name }}
  replicas: {{ $pool.replicas }}
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "pdgate.selectorLabels" (dict "root" $root "component" $role) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdgate.labels" (dict "root" $root "component" $role) | nindent 8 }}
        pdgate.io/accelerator: {{ $v.accelerator }}
      {{- with $pool.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "pdgate.partServiceAccountName" (dict "root" $root "part" $role) }}
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ $v.engine.terminationGracePeriodSeconds }}
      {{- $podSecurity := deepCopy ($v.engine.podSecurityContext | default dict) }}
      {{- if and $preset.runAsNonRoot (not (hasKey $podSecurity "runAsNonRoot")) }}
      {{- $_ := set $podSecurity "runAsNonRoot" true }}
      {{- end }}
      {{- with $podSecurity }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.engine.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: vllm
          image: {{ include "pdgate.engine.image" $root }}
          imagePullPolicy: {{ $v.engine.image.pullPolicy }}
          {{- if eq $preset.launcher "module" }}
          command: ["python3", "-m", "vllm.entrypoints.openai.api_server"]
          {{- else }}
          command: ["vllm", "serve"]
          {{- end }}
          args:
            {{- if eq $preset.launcher "module" }}
            - --model={{ $model }}
            {{- else }}
            - {{ $model | toJson }}
            {{- end }}
            - --host=0.0.0.0
            - --port={{ $port }}
            - --served-model-name={{ default $model $v.model.servedName }}
            - --tensor-parallel-size={{ $tp }}
            - --dtype={{ $v.model.dtype }}
            {{- if $v.model.maxModelLen }}
            - --max-model-len={{ int $v.model.maxModelLen }}
            {{- end }}
            {{- if $v.model.maxNumBatchedTokens }}
            - --max-num-batched-tokens={{ int $v.model.maxNumBatchedTokens }}
            {{- end }}
            {{- if $v.model.maxNumSeqs }}
            - --max-num-seqs={{ int $v.model.maxNumSeqs }}
            {{- end }}
            {{- if $v.model.trustRemoteCode }}
            - --trust-remote-code
            {{- end }}
            - --kv-transfer-config
            - {{ include "pdgate.engine.kvTransferConfig" (dict "root" $root "role" $role) | toJson }}
            {{- if $v.kvRouting.enabled }}
            - --kv-events-config
            - {{ include "pdgate.engine.kvEventsConfig" $root | toJson }}
            {{- end }}
            {{- range (concat ($preset.extraArgs | default list) $v.engine.extraArgs $pool.extraArgs) }}
            - {{ . | toJson }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - name: POD_NAMESPACE
              valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
            - name: POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
            - name: HF_HOME
              value: {{ $v.model.cache.mountPath | quote }}
            {{- with include "pdgate.token.env" (dict "root" $root "name" "PDGATE_METASERVER_TOKEN" "part" .role) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "pdgate.engineApiKey.env" (dict "root" $root "name" "VLLM_API_KEY") }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.model.hfTokenSecret.name }}
            - name: HF_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ . }}
                  key: {{ $v.model.hfTokenSecret.key }}
            {{- end }}
            {{- with (concat ($preset.env | default list) $v.engine.extraEnv $pool.extraEnv) }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ $port }}
              protocol: TCP
            {{- range $r := until $tp }}
            - name: side-{{ $r }}
              containerPort: {{ add $side $r }}
              protocol: TCP
            {{- end }}
            {{- if $v.kvRouting.enabled }}
            - name: kv-events
              containerPort: {{ int $v.kvRouting.eventsPort }}
              protocol: TCP
            - name: kv-replay
              containerPort: {{ add (int $v.kvRouting.eventsPort) 1 }}
              protocol: TCP
            {{- end }}
          startupProbe:
            httpGet: {path: /health, port: http}
            periodSeconds: 10
            failureThreshold: {{ max 1 (div (int $v.engine.startupTimeoutS) 10) }}
          readinessProbe:
            httpGet: {path: /health, port: http}
            periodSeconds: 5
            failureThreshold: 3
          livenessProbe:
            httpGet: {path: /health, port: http}
            periodSeconds: 15
            timeoutSeconds: 5
            failureThreshold: 4
          {{- if $v.engine.drain.enabled }}
          # Graceful drain (docs/kubernetes.md): mark this instance draining in the metaserver
          # (every proxy stops sending it requests), wait for its in-flight requests, then let
          # SIGTERM stop vLLM; the connector deregisters on shutdown. Python, not curl: the
          # engine images have Python and pdgate. POD_NAME (the instance id) comes from the
          # container's environment, the credential from the pod's projected token (or the
          # environment's token).
          lifecycle:
            preStop:
              exec:
                command:
                  - python3
                  - -m
                  - connector.drain
                  - --metaserver={{ include "pdgate.metaserver.url" $root }}
                  - --engine=http://127.0.0.1:{{ $port }}
                  - --settle={{ int $v.engine.drain.settleS }}
                  - --timeout={{ int $v.engine.drain.timeoutS }}
                  {{- if include "pdgate.auth.perPod" $root }}
                  - --token-file={{ include "pdgate.auth.podTokenDir" $root }}/token
                  {{- end }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          {{- $security := deepCopy ($v.engine.securityContext | default dict) }}
          {{- $caps := get $security "capabilities" | default dict }}
          {{- $add := concat (get $caps "add" | default list) ($preset.addCapabilities | default list) }}
          {{- if $v.engine.rdma.enabled }}
          {{- $add = append $add "IPC_LOCK" }}
          {{- end }}
          {{- if $add }}
          {{- $_ := set $caps "add" (uniq $add) }}
          {{- $_ := set $security "capabilities" $caps }}
          {{- end }}
          {{- with $security }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- if $v.engine.shm.enabled }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            - name: model-cache
              mountPath: {{ $v.model.cache.mountPath }}
            {{- if include "pdgate.auth.perPod" $root }}
            - name: metaserver-token
              mountPath: {{ include "pdgate.auth.podTokenDir" $root }}
              readOnly: true
            {{- end }}
            {{- if include "pdgate.sideChannel.key" $root }}
            - name: side-channel-secret
              mountPath: {{ include "pdgate.engine.sideChannelDir" $root }}
              readOnly: true
            {{- end }}
            {{- range $preset.hostPathMounts }}
            - name: {{ .name }}
              mountPath: {{ .path }}
              readOnly: true
            {{- end }}
      volumes:
        {{- if include "pdgate.auth.perPod" $root }}
        # This pod's identity for the metaserver: a token of the pool's ServiceAccount for the
        # metaserver's audience only, renewed by the kubelet (the connector re-reads it).
        - name: metaserver-token
          projected:
            sources:
              - serviceAccountToken:
                  audience: {{ include "pdgate.auth.podTokenAudience" $root }}
                  expirationSeconds: {{ int $v.auth.serviceAccountToken.expirationSeconds }}
                  path: token
        {{- end }}
        {{- if include "pdgate.sideChannel.key" $root }}
        {{- $secret := include "pdgate.sideChannel.secret" $root | fromJson }}
        - name: side-channel-secret
          secret:
            secretName: {{ $secret.name }}
            items:
              - key: {{ $secret.key }}
                path: {{ $secret.key }}
            defaultMode: 0440
        {{- end }}
        {{- if $v.engine.shm.enabled }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.engine.shm.sizeLimit }}
        {{- end }}
        {{- $cache := $v.model.cache }}
        {{- if eq $cache.type "emptyDir" }}
        - name: model-cache
          emptyDir:
            sizeLimit: {{ $cache.size }}
        {{- else if eq $cache.type "existingClaim" }}
        - name: model-cache
          persistentVolumeClaim:
            claimName: {{ required "model.cache.existingClaim is required for type existingClaim" $cache.existingClaim }}
        {{- else if eq $cache.type "hostPath" }}
        - name: model-cache
          hostPath:
            path: {{ required "model.cache.hostPath is required for type hostPath" $cache.hostPath }}
            type: DirectoryOrCreate
        {{- end }}
        {{- range $preset.hostPathMounts }}
        - name: {{ .name }}
          hostPath:
            path: {{ .path }}
            type: {{ .type | default "Directory" }}
        {{- end }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
  {{- if eq $v.model.cache.type "pvc" }}
  volumeClaimTemplates:
    - metadata:
        name: model-cache
        labels:
          {{- include "pdgate.selectorLabels" (dict "root" $root "component" $role) | nindent 10 }}
      spec:
        accessModes: [ReadWriteOnce]
        {{- with $v.model.cache.storageClass }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ $v.model.cache.size }}
  {{- end }}
{{- end -}}
