{{/* The router's namespace: namespace, else the release's. */}}
{{- define "llmf.ns" -}}
{{- default .Release.Namespace .Values.namespace -}}
{{- end -}}

{{/*
An image reference: (dict "root" $ "img" .Values.x.image "project" true).
Project images fall back to image.registry and image.tag (then appVersion);
others (Redis) use their own fields only.
*/}}
{{- define "llmf.image" -}}
{{- $g := .root.Values.image -}}
{{- $reg := .img.registry -}}
{{- $tag := .img.tag -}}
{{- if .project -}}
{{- $reg = default $g.registry $reg -}}
{{- $tag = default (default .root.Chart.AppVersion $g.tag) $tag -}}
{{- end -}}
{{- if $reg -}}{{ trimSuffix "/" $reg }}/{{- end -}}{{ .img.repository }}:{{ $tag }}
{{- end -}}

{{- define "llmf.labels" -}}
app.kubernetes.io/part-of: istio-llm-filter
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The metadata center's URL, as its clients call it. */}}
{{- define "llmf.mcURL" -}}
{{ ternary "https" "http" .Values.metadataCenter.tls.enabled }}://metadata-center.{{ include "llmf.ns" . }}.svc.cluster.local:{{ .Values.metadataCenter.port }}
{{- end -}}

{{- define "llmf.workerName" -}}
worker-{{ .Values.worker.modelName }}
{{- end -}}

{{/* Istio's outbound cluster of the model's Service: the rule's cluster. */}}
{{- define "llmf.workerCluster" -}}
outbound|{{ .Values.worker.port }}||{{ include "llmf.workerName" . }}.{{ include "llmf.ns" . }}.svc.cluster.local
{{- end -}}

{{/*
The paths the gateway's routes send to the router, as [match, path]
pairs (match prefix or exact; the HTTPRoute's PathPrefix or Exact): the
OpenAI-compatible APIs under /v1/ and /v2/ (vLLM's /v2/rerank), and the
unversioned /rerank and /score vLLM serves (docs/envoy-filter.md, "Paths").
The same as istio/gateway.yaml's and deploy/inferencepool/gateway.yaml's.
*/}}
{{- define "llmf.apiPaths" -}}
- [prefix, /v1/]
- [prefix, /v2/]
- [exact, /rerank]
- [exact, /score]
{{- end -}}

{{/* Where the token Secret is mounted in every pod that reads it. */}}
{{- define "llmf.authDir" -}}/etc/llm-filter/mc-auth{{- end -}}
{{- define "llmf.mcCADir" -}}/etc/llm-filter/mc-ca{{- end -}}

{{/*
The filter document both gateway modes share (docs/configuration.md):
(dict "root" $ "cluster" C "caFile" F "extra" D).
*/}}
{{- define "llmf.filterDoc" -}}
{{- $v := .root.Values -}}
{{- $mc := dict "address" (include "llmf.mcURL" .root) "auth_token_file" (printf "%s/token" (include "llmf.authDir" .root)) "query_timeout" $v.routing.queryTimeout "update_timeout" $v.routing.updateTimeout -}}
{{- if and $v.metadataCenter.tls.enabled .caFile -}}
{{- $_ := set $mc "tls" (dict "ca_file" .caFile) -}}
{{- end -}}
{{- $rule := dict "cluster" .cluster "backend" $v.routing.backend "scene_name" $v.routing.sceneName -}}
{{- $doc := dict "protocol" "openai" "metadata_center" $mc "prompt_hash" (dict "chunk_size" $v.routing.promptHashChunkSize) "model_mapping_rule" (dict $v.worker.modelName (list $rule)) "lb_mapping_rule" $v.routing.lbMappingRule -}}
{{- toYaml (merge $doc .extra) -}}
{{- end -}}

{{/* Refuse values that would render a broken install. */}}
{{- define "llmf.validate" -}}
{{- $v := .Values -}}
{{- if not (has $v.gateway.mode (list "envoyfilter" "endpointPicker")) -}}
{{- fail (printf "gateway.mode %q: want envoyfilter or endpointPicker" $v.gateway.mode) -}}
{{- end -}}
{{- if not (has $v.metadataCenter.store (list "memory" "redis")) -}}
{{- fail (printf "metadataCenter.store %q: want memory or redis" $v.metadataCenter.store) -}}
{{- end -}}
{{- if not (has $v.worker.model.source (list "generated" "pvc")) -}}
{{- fail (printf "worker.model.source %q: want generated or pvc" $v.worker.model.source) -}}
{{- end -}}
{{- if and (eq $v.metadataCenter.store "redis") $v.redis.external (not $v.redis.externalConfig.address) -}}
{{- fail "redis.external: set redis.externalConfig.address" -}}
{{- end -}}
{{- if ge (add (int64 $v.worker.preStopSeconds) (int64 $v.worker.drainTimeoutSeconds)) (int64 $v.worker.terminationGracePeriodSeconds) -}}
{{- fail (printf "worker: preStopSeconds %v + drainTimeoutSeconds %v must stay below terminationGracePeriodSeconds %v" $v.worker.preStopSeconds $v.worker.drainTimeoutSeconds $v.worker.terminationGracePeriodSeconds) -}}
{{- end -}}
{{- end -}}

{{/* The endpoint picker's file (filter/gatewayfile): the pool is the cluster. */}}
{{- define "llmf.fleet" -}}
{{- $e := .Values.endpointPicker -}}
listen: 0.0.0.0:{{ $e.grpcPort }}
log_level: info
connect_retries: {{ $e.connectRetries }}
filter:
  {{- include "llmf.filterDoc" (dict "root" . "cluster" (include "llmf.workerName" .) "caFile" (printf "%s/ca.crt" (include "llmf.mcCADir" .)) "extra" dict) | nindent 2 }}
{{- end -}}
