{{/* kvfleet chart helpers: names, labels, and the container fragments every role shares. */}}
{{- define "kvfleet.labels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvfleet.securityContext" -}}
runAsNonRoot: true
runAsUser: 65532
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "kvfleet.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end }}

{{/* The init container that fills the models emptyDir (model.source=generate). */}}
{{- define "kvfleet.initContainers" -}}
{{- if eq .Values.model.source "generate" }}
initContainers:
  - name: gen-model
    image: {{ include "kvfleet.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["kvfleet"]
    args: [gen-model, {{ printf "--out=%s" .Values.model.path | quote }}, {{ printf "--preset=%s" .Values.model.preset | quote }}]
    resources:
      requests: {cpu: 250m, memory: 256Mi}
      limits: {cpu: "1", memory: 1Gi}
    securityContext:
      {{- include "kvfleet.securityContext" . | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: /models}
      - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end }}

{{- define "kvfleet.volumes" -}}
- name: tmp
  emptyDir: {}
- name: models
  {{- if eq .Values.model.source "generate" }}
  emptyDir: {}
  {{- else }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
  {{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end }}

{{- define "kvfleet.mounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: models, mountPath: /models, readOnly: true}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: /etc/kvfleet/tls, readOnly: true}
{{- end }}
{{- end }}

{{/* --tls-* flags for member $member */}}
{{- define "kvfleet.tlsArgs" -}}
{{- if .ctx.Values.tls.enabled }}
- --tls-cert=/etc/kvfleet/tls/{{ .member }}.pem
- --tls-key=/etc/kvfleet/tls/{{ .member }}.key
- --tls-ca=/etc/kvfleet/tls/ca.pem
{{- end }}
{{- end }}

{{/* The pods' grace period: the drain's delay and timeout, and 10 s to exit. */}}
{{- define "kvfleet.gracePeriod" -}}
{{ add (div (add .Values.drain.delayMs .Values.drain.timeoutMs) 1000) 10 }}
{{- end }}
