package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// validRegistration bounds a pod's registration (it is answered with every
// route query of its cluster) and returns its TTL.
func validRegistration(r *api.PodRegistration) (time.Duration, error) {
	switch {
	case r.TTLMS != 0 && (r.TTLMS < api.MinRegistrationTTLMS || r.TTLMS > api.MaxRegistrationTTLMS):
		return 0, fmt.Errorf("register.ttl_ms must be within %d..%d (or 0 for %d), got %d",
			api.MinRegistrationTTLMS, api.MaxRegistrationTTLMS, api.DefaultRegistrationTTLMS, r.TTLMS)
	case len(r.Labels) > api.MaxPodLabels:
		return 0, fmt.Errorf("register.labels: %d labels, at most %d are accepted", len(r.Labels), api.MaxPodLabels)
	}
	for k, v := range r.Labels {
		switch {
		case k == "" || len(k) > api.MaxLabelKeyLen || !utf8.ValidString(k):
			return 0, fmt.Errorf("register.labels: key %q must be 1..%d bytes of UTF-8", k, api.MaxLabelKeyLen)
		case len(v) > api.MaxLabelValueLen || !utf8.ValidString(v):
			return 0, fmt.Errorf("register.labels[%q]: value must be at most %d bytes of UTF-8", k, api.MaxLabelValueLen)
		}
	}
	if err := validNames("register.adapters", r.Adapters, api.MaxPodAdapters); err != nil {
		return 0, err
	}
	if err := validNames("register.models", r.Models, api.MaxPodModels); err != nil {
		return 0, err
	}
	ttl := r.TTLMS
	if ttl == 0 {
		ttl = api.DefaultRegistrationTTLMS
	}
	return time.Duration(ttl) * time.Millisecond, nil
}

func validNames(field string, names []string, most int) error {
	if len(names) > most {
		return fmt.Errorf("%s: %d names, at most %d are accepted", field, len(names), most)
	}
	seen := make(map[string]bool, len(names))
	for _, n := range names {
		switch {
		case n == "" || len(n) > api.MaxLabelValueLen || !utf8.ValidString(n):
			return fmt.Errorf("%s: name %q must be 1..%d bytes of UTF-8", field, n, api.MaxLabelValueLen)
		case seen[n]:
			return fmt.Errorf("%s: %q given twice", field, n)
		}
		seen[n] = true
	}
	return nil
}

// pods answers the cluster's live registrations (the gateway's /v1/models
// lists the adapters from it; operators debug with it).
func (s *Server) pods(c *gin.Context) {
	cluster, err := validCluster(c.Query("cluster"))
	if err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	pods, err := s.st.Registry.Pods(ctx, cluster)
	if err != nil {
		s.storeFailed(c, "pods", err)
		return
	}
	if pods == nil {
		pods = map[string]api.PodRegistration{}
	}
	b, err := json.Marshal(pods)
	if err != nil {
		s.storeFailed(c, "pods", errors.Join(errors.New("encode"), err))
		return
	}
	s.raw(c, b)
}

// appendPods writes the route answer's pods (encoding/json sorts the keys
// as the rest of the hand-written answer does).
func appendPods(b []byte, pods map[string]api.PodLabels) []byte {
	js, err := json.Marshal(pods)
	if err != nil {
		return append(b, "{}"...)
	}
	return append(b, js...)
}
