package manifesttest

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PodMonitor is the Prometheus Operator's monitoring.coreos.com/v1
// PodMonitor, reduced to the fields this project's manifests may use, with
// the operator's JSON names (prometheus-operator pkg/apis/monitoring/v1,
// podmonitor_types.go). The operator's Go module would pull a newer
// Kubernetes API than this module's; decoding strictly into this subset
// still refuses a misspelt or misplaced field.
type PodMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              PodMonitorSpec `json:"spec"`
}

// PodMonitorSpec is PodMonitor's spec.
type PodMonitorSpec struct {
	JobLabel            string               `json:"jobLabel,omitempty"`
	PodTargetLabels     []string             `json:"podTargetLabels,omitempty"`
	PodMetricsEndpoints []PodMetricsEndpoint `json:"podMetricsEndpoints"`
	Selector            metav1.LabelSelector `json:"selector"`
	NamespaceSelector   *NamespaceSelector   `json:"namespaceSelector,omitempty"`
}

// PodMetricsEndpoint is one scraped endpoint of the selected pods.
type PodMetricsEndpoint struct {
	Port          *string             `json:"port,omitempty"`
	PortNumber    *int32              `json:"portNumber,omitempty"`
	Path          string              `json:"path,omitempty"`
	Scheme        string              `json:"scheme,omitempty"`
	Params        map[string][]string `json:"params,omitempty"`
	Interval      string              `json:"interval,omitempty"`
	ScrapeTimeout string              `json:"scrapeTimeout,omitempty"`
	HonorLabels   bool                `json:"honorLabels,omitempty"`
	TLSConfig     *SafeTLSConfig      `json:"tlsConfig,omitempty"`
}

// SafeTLSConfig is how Prometheus verifies an https endpoint
// (prometheus-operator pkg/apis/monitoring/v1, types.go).
type SafeTLSConfig struct {
	CA                 *SecretOrConfigMap `json:"ca,omitempty"`
	ServerName         *string            `json:"serverName,omitempty"`
	InsecureSkipVerify *bool              `json:"insecureSkipVerify,omitempty"`
}

// SecretOrConfigMap names a key of a Secret or a ConfigMap of the
// PodMonitor's namespace.
type SecretOrConfigMap struct {
	Secret    *corev1.SecretKeySelector    `json:"secret,omitempty"`
	ConfigMap *corev1.ConfigMapKeySelector `json:"configMap,omitempty"`
}

// NamespaceSelector picks the namespaces whose pods are selected (default:
// the PodMonitor's own).
type NamespaceSelector struct {
	Any        bool     `json:"any,omitempty"`
	MatchNames []string `json:"matchNames,omitempty"`
}
